"""The in-process cluster used by router tests serves Generate correctly."""

import pytest

from tests.cluster.client import generate_tokens
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_hf_equivalence import make_prompts
from tests.router.inproc_cluster import InprocCluster


@pytest.mark.timeout(300)
def test_generate_through_inproc_cluster(tiny_model_dir):
    prompts = make_prompts(2048, (3, 70, 200), seed=31)
    cluster = InprocCluster(str(tiny_model_dir)).start()
    try:
        outputs = cluster.run(generate_tokens(cluster.grpc_endpoint, prompts, 8))
        assert outputs == hf_greedy(tiny_model_dir, prompts, 8)
        cluster.assert_idle()
    finally:
        cluster.stop()
