"""A completions batch under SLO admission (`shed`): a prompt the router sheds fails the
whole request with 429 before anything streams, and the prompts it had admitted are
cancelled, their worker calls ended and their KV freed. Here the shed prompt is one the
decode worker has no room for beside the admitted ones (80 KV blocks: each short prompt
holds 38 with its 600 tokens, the long one would need 63)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import openai
import pytest

from tandem.engine.config import EngineConfig
from tests.helpers.inproc_cluster import InprocCluster, openai_client, shared_router_config
from tests.helpers.prompts import make_prompts

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 600  # room for the 400-token prompt in the module's 1,024-token context
NUM_BLOCKS = 80  # of 16 tokens: two short prompts' 38 each, not the long one's 63 beside


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path) -> Iterator[InprocCluster]:
    model_dir = str(tiny_model_dir)
    router = replace(shared_router_config(model_dir), admission_policy="shed")
    engine = EngineConfig(model=model_dir, num_threads=1, max_model_len=1024, num_blocks=NUM_BLOCKS)
    cluster = InprocCluster(model_dir, router_config=router, engine_config=engine)
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def client(cluster: InprocCluster) -> Iterator[openai.OpenAI]:
    yield from openai_client(cluster.http_endpoint)


def test_a_shed_prompt_fails_the_batch_and_frees_the_admitted_ones(client, cluster):
    short, long = make_prompts(2048, (8, 400), seed=51)
    policy = cluster.router.policy_runtime.policy
    model = cluster.router.config.model_name
    for stream in (False, True):
        placed, shed = sum(policy.decisions.values()), policy.rejections["kv_blocks"]
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(
                model=model, prompt=[short, short, long], stream=stream, max_tokens=MAX_TOKENS,
                temperature=0.0, extra_body={"ignore_eos": True},
            )  # fmt: skip
        assert "kv_blocks" in info.value.body["message"].lower(), info.value.body
        # Both short prompts were placed (charged to workers), the long one shed...
        assert sum(policy.decisions.values()) - placed == 2
        assert policy.rejections["kv_blocks"] - shed == 1
        # ... and the placed ones were cancelled: nothing charged or held anywhere within
        # 0.3 s, where their 600 tokens each would take seconds.
        cluster.assert_idle(timeout_s=0.3)


def test_a_prompt_too_long_for_its_ttft_target_is_served_when_idle(client, cluster):
    """Its own prefill misses the target even with no queue: refused, it would be
    refused again on every retry (it was: 429 with Retry-After 1-2 s, forever), so on an
    idle cluster it is served, as best effort."""
    (long,) = make_prompts(2048, (400,), seed=52)
    policy = cluster.router.policy_runtime.policy
    reply = client.completions.create(
        model=cluster.router.config.model_name, prompt=long, max_tokens=4, temperature=0.0,
        extra_body={"ttft_slo_s": 1e-6},
    )  # fmt: skip
    assert reply.choices[0].finish_reason == "length"
    assert policy.rejections["ttft"] == policy.rejections["ttft_out_of_reach"] == 0
