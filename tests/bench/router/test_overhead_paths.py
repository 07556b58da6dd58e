"""The router-overhead benchmark's two paths against a real cluster whose workers require
a cluster token, as `tandem serve`'s do: via the router and straight to the workers, with
the same greedy tokens. (Its direct path once carried no token: every call UNAUTHENTICATED,
and `tandem-bench router` stopped at its first request.)"""

from __future__ import annotations

import asyncio

import pytest

from tandem.bench.router.overhead import measure_overhead
from tandem.proto.cluster_auth import ClusterAuth, generate_token
from tests.helpers.inproc_cluster import InprocCluster

pytestmark = pytest.mark.timeout(120)


def test_both_paths_run_and_agree(tiny_model_dir):
    auth = ClusterAuth(token=generate_token())
    cluster = InprocCluster(str(tiny_model_dir), cluster_auth=auth)
    cluster.start()
    try:
        workers = {w.role.value: w.endpoint for w in cluster.workers}
        measure = measure_overhead(
            f"grpc://{cluster.grpc_endpoint}", workers, auth,
            num_requests=3, max_tokens=3, num_warmup=1,
        )  # fmt: skip
        result = asyncio.run(asyncio.wait_for(measure, 60))
    finally:
        cluster.stop()
    assert result.num_requests == 3 and result.outputs_match
