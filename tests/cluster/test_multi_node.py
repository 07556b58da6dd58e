"""Two Ray nodes on one machine (`ray.cluster_utils.Cluster`), one per role.

Each worker asks for its role's Ray resource, so the prefill worker lands on the node
that offers `tandem_prefill` and the decode worker on the other; KV crosses nodes
over TCP (to the node's address, which the workers bind and advertise) and the
text equals `transformers` greedy generation. Without `--threads`, a worker on the
driver's node runs the threads the launcher decided, one on the other node its own
node's CPUs.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import ray
from ray.cluster_utils import Cluster

from tandem.cluster.config import ThreadPolicy
from tandem.cluster.launcher import LocalCluster
from tandem.cluster.ray_start import start_with_retries
from tandem.cluster.threads import available_cpus
from tandem.router.membership import WorkerLifecycle
from tests.helpers.grpc_calls import generate_tokens
from tests.helpers.hf_reference import hf_greedy
from tests.helpers.prompts import make_prompts
from tests.helpers.ray_pools import assert_idle, cluster_config

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

MAX_TOKENS = 8


NODES_TIMEOUT_S = 120


def _start_two_nodes() -> tuple[Cluster, str, str]:
    """A head that offers `tandem_prefill` and a second node that offers
    `tandem_decode`, with the driver connected (retried while a node's start times out)."""
    clusters: list[Cluster] = []

    def start() -> tuple[Cluster, str, str]:
        cluster = Cluster()
        clusters.append(cluster)
        head = cluster.add_node(num_cpus=2, resources={"tandem_prefill": 2})
        decode_node = cluster.add_node(num_cpus=2, resources={"tandem_decode": 2})
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes(timeout=NODES_TIMEOUT_S)
        return cluster, head.node_id, decode_node.node_id

    def undo() -> None:
        ray.shutdown()
        clusters[-1].shutdown()

    return start_with_retries(start, undo)


@pytest.fixture(scope="module")
def two_nodes():
    cluster, prefill_node, decode_node = _start_two_nodes()
    yield prefill_node, decode_node
    ray.shutdown()
    cluster.shutdown()


def test_placement_by_role_and_cross_node_kv(two_nodes, tiny_model_dir):
    prefill_node, decode_node = two_nodes
    prompts = make_prompts(2048, (4, 33, 90, 200), seed=8)
    expected = hf_greedy(tiny_model_dir, prompts, MAX_TOKENS)

    async def scenario() -> None:
        cluster = LocalCluster(cluster_config(tiny_model_dir))
        try:
            await cluster.start()
            membership = await cluster.membership()
            nodes = {w.role.value: w.node for w in membership.workers
                     if w.state is WorkerLifecycle.SERVING}  # fmt: skip
            assert nodes == {"prefill": prefill_node, "decode": decode_node}
            # Several nodes: workers bind and advertise the node's address, not loopback.
            node_ip = ray.util.get_node_ip_address()
            for worker in membership.workers:
                assert worker.endpoint.rsplit(":", 1)[0] == node_ip, worker
                assert worker.metrics_url.startswith(f"http://{node_ip}:"), worker
            got = await generate_tokens(cluster.router.grpc_endpoint, prompts, MAX_TOKENS)
            assert got == expected
            await assert_idle(membership, auth=cluster.config.worker.cluster_auth)
        finally:
            await cluster.stop()

    asyncio.run(scenario())


def test_a_worker_on_another_node_counts_that_nodes_cpus(two_nodes, tiny_model_dir):
    """`split` without `--threads`: the launcher (on the driver's node, the prefill one)
    gives each of the two starting workers half of its CPUs; the decode worker, on the
    other node, runs all of that node's (one machine here: the same count)."""
    config = cluster_config(tiny_model_dir)
    config.engine = dataclasses.replace(config.engine, num_threads=None)
    config.ray = dataclasses.replace(config.ray, thread_policy=ThreadPolicy.SPLIT)

    async def scenario() -> None:
        cluster = LocalCluster(config)
        try:
            await cluster.start()
            membership = await cluster.membership()
            threads = {w.role.value: w.threads for w in membership.workers}
            cpus = available_cpus()
            assert threads == {"prefill": max(1, cpus // 2), "decode": cpus}
            await assert_idle(membership, auth=cluster.config.worker.cluster_auth)
        finally:
            await cluster.stop()

    asyncio.run(scenario())
