"""`n > 1` when the decode worker prefills locally (conditional disaggregation), on the
session's shared cluster: a short prompt on an idle cluster is prefilled by the decode
worker; sequence 0 prefills, the others start after its first token and find the
prompt's full blocks in that worker's prefix cache."""

from __future__ import annotations

import openai
import pytest

from tests.helpers.grpc_calls import worker_stats
from tests.helpers.inproc_cluster import SHARED_API_KEY, InprocCluster
from tests.helpers.prompts import make_prompts

pytestmark = pytest.mark.timeout(300)

N = 3
PROMPT = make_prompts(2048, (40,), seed=43)[0]  # two full 16-token blocks


def stats(cluster: InprocCluster, role: str):
    worker = next(w for w in cluster.workers if w.role == role)
    return cluster.run(worker_stats(worker.endpoint, role, cluster.cluster_auth))


def test_n_with_local_prefill_reuses_the_first_sequence_prefix(cluster):
    client = openai.OpenAI(
        base_url=f"{cluster.http_endpoint}/v1", api_key=SHARED_API_KEY, max_retries=0, timeout=60
    )
    prefill_before = stats(cluster, "prefill").prefix_cache_queries
    decode_before = stats(cluster, "decode")
    try:
        response = client.completions.create(
            model=cluster.router.config.model_name, prompt=PROMPT, n=N, max_tokens=6,
            temperature=0.0, extra_body={"ignore_eos": True},
        )  # fmt: skip
    finally:
        client.close()
    assert [c.index for c in response.choices] == list(range(N))
    assert len({c.text for c in response.choices}) == 1  # greedy: all alike
    assert response.usage.completion_tokens == N * 6
    # The decode worker prefilled (the prefill worker saw nothing) ...
    assert stats(cluster, "prefill").prefix_cache_queries == prefill_before
    decode_after = stats(cluster, "decode")
    assert decode_after.prefix_cache_queries - decode_before.prefix_cache_queries == N * 40
    # ... and sequences 1..n-1 found the prompt's two full blocks cached.
    hits = decode_after.prefix_cache_hits - decode_before.prefix_cache_hits
    assert hits >= (N - 1) * 32
