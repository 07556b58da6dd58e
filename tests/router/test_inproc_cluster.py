"""The shared in-process cluster the API tests use serves Generate correctly."""

import pytest

from tests.helpers.grpc_calls import generate_tokens
from tests.helpers.hf_reference import hf_greedy
from tests.helpers.prompts import make_prompts


@pytest.mark.timeout(300)
def test_generate_through_inproc_cluster(cluster, tiny_model_dir):
    prompts = make_prompts(2048, (3, 70, 200), seed=31)
    outputs = cluster.run(generate_tokens(cluster.grpc_endpoint, prompts, 8))
    assert outputs == hf_greedy(tiny_model_dir, prompts, 8)
    # conftest then checks that both workers and the router's policy are idle again.
