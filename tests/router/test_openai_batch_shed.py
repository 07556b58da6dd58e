"""A completions batch under SLO admission (`shed`): a prompt the router sheds fails the
whole request with 429 before anything streams, and the prompts it had admitted are
cancelled, their worker calls ended and their KV freed."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import openai
import pytest

from tandem.router.policy import SloConfig
from tests.helpers.inproc_cluster import InprocCluster, openai_client, shared_router_config
from tests.helpers.prompts import make_prompts

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 600  # room for the 400-token prompt in the module's 1,024-token context


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path) -> Iterator[InprocCluster]:
    model_dir = str(tiny_model_dir)
    router = replace(shared_router_config(model_dir), admission_policy="shed")
    cluster = InprocCluster(model_dir, router_config=router)
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def client(cluster: InprocCluster) -> Iterator[openai.OpenAI]:
    yield from openai_client(cluster.http_endpoint)


def test_a_shed_prompt_fails_the_batch_and_frees_the_admitted_ones(client, cluster):
    short, long = make_prompts(2048, (8, 400), seed=51)
    policy = cluster.router.policy_runtime.policy
    slo = SloConfig().resolve()

    def predicted_ttft_s(prompt: list[int]) -> float:
        placement = policy.selector.select(prompt, MAX_TOKENS, slo)
        return placement.predicted_ttft_s + policy.admission.ttft_padding_s

    model = cluster.router.config.model_name
    for stream in (False, True):
        # Predicted now: each observed request refits the router's latency models.
        fast, slow = predicted_ttft_s(short), predicted_ttft_s(long)
        assert fast < slow
        target = (fast + slow) / 2  # the short prompt is admitted, the long one shed
        placed, shed = sum(policy.decisions.values()), policy.rejections["ttft"]
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(
                model=model, prompt=[short, short, long], stream=stream, max_tokens=MAX_TOKENS,
                temperature=0.0, extra_body={"ignore_eos": True, "ttft_slo_s": target},
            )  # fmt: skip
        assert "ttft" in info.value.body["message"].lower(), info.value.body
        # Both short prompts were placed (charged to workers), the long one shed...
        assert sum(policy.decisions.values()) - placed == 2
        assert policy.rejections["ttft"] - shed == 1
        # ... and the placed ones were cancelled: nothing charged or held anywhere within
        # 0.3 s, where their 600 tokens each would take seconds.
        cluster.assert_idle(timeout_s=0.3)
