"""`n > 1` when the decode worker prefills locally (conditional disaggregation). The
cluster has a decode worker only, so every prefill is local whatever the latency models
predict: sequence 0 prefills, the others start after its first token and find the
prompt's full blocks in that worker's prefix cache."""

from __future__ import annotations

import openai
import pytest

from tandem.worker.config import WorkerRole
from tests.helpers.grpc_calls import worker_stats
from tests.helpers.process_cluster import ProcessCluster
from tests.helpers.prompts import make_prompts

pytestmark = pytest.mark.timeout(300)

N = 3
PROMPT = make_prompts(2048, (40,), seed=43)[0]  # two full 16-token blocks


def test_n_with_local_prefill_reuses_the_first_sequence_prefix(tiny_model_dir):
    cluster = ProcessCluster(str(tiny_model_dir), {"decode-0": WorkerRole.DECODE}).start()
    client = openai.OpenAI(
        base_url=f"{cluster.http_endpoint}/v1", api_key="unused", max_retries=0, timeout=60
    )
    try:
        [(endpoint, role)] = cluster.live_workers()
        before = cluster.run(worker_stats(endpoint, role))
        response = client.completions.create(
            model=cluster.router.config.model_name, prompt=PROMPT, n=N, max_tokens=6,
            temperature=0.0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert [c.index for c in response.choices] == list(range(N))
        assert len({c.text for c in response.choices}) == 1  # greedy: all alike
        assert response.usage.completion_tokens == N * 6
        after = cluster.run(worker_stats(endpoint, role))
        assert after.prefix_cache_queries - before.prefix_cache_queries == N * 40
        # Sequences 1..n-1 found the prompt's two full blocks cached.
        assert after.prefix_cache_hits - before.prefix_cache_hits >= (N - 1) * 32
        cluster.assert_idle()
    finally:
        client.close()
        cluster.stop()
