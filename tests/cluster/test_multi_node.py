"""Three Ray nodes on one machine (`ray.cluster_utils.Cluster`), shaped as the Helm
chart's pods: each offers one worker of one role.

Each worker asks for its role's Ray resource, so the prefill worker lands on the node
that offers `tandem_prefill` and decode workers on the others; KV crosses nodes over
TCP (to the node's address, which the workers bind and advertise) and the text equals
`transformers` greedy generation. Without `--threads`, a worker on the driver's node
runs the threads the launcher decided, one on another node its own node's CPUs; and
workers that have a node each keep libgomp's spin (`cluster.worker_env`).
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
from tandem.engine.host_cpus import available_cpus
from tandem.router.membership import WorkerLifecycle
from tests.helpers.grpc_calls import generate_tokens
from tests.helpers.hf_reference import hf_greedy
from tests.helpers.prompts import make_prompts
from tests.helpers.ray_pools import assert_idle, cluster_config

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

MAX_TOKENS = 8


NODES_TIMEOUT_S = 120


def _start_nodes() -> tuple[Cluster, str, set[str]]:
    """A head that offers one `tandem_prefill` and two nodes that offer one
    `tandem_decode` each, with the driver connected (retried while a node's start times
    out)."""
    clusters: list[Cluster] = []

    def start() -> tuple[Cluster, str, set[str]]:
        cluster = Cluster()
        clusters.append(cluster)
        head = cluster.add_node(num_cpus=2, resources={"tandem_prefill": 1})
        decode_nodes = [cluster.add_node(num_cpus=2, resources={"tandem_decode": 1})
                        for _ in range(2)]  # fmt: skip
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes(timeout=NODES_TIMEOUT_S)
        return cluster, head.node_id, {node.node_id for node in decode_nodes}

    def undo() -> None:
        ray.shutdown()
        clusters[-1].shutdown()

    return start_with_retries(start, undo)


@pytest.fixture(scope="module")
def nodes():
    cluster, prefill_node, decode_nodes = _start_nodes()
    yield prefill_node, decode_nodes
    ray.shutdown()
    cluster.shutdown()


def test_placement_by_role_and_cross_node_kv(nodes, tiny_model_dir):
    prefill_node, decode_nodes = nodes
    prompts = make_prompts(2048, (4, 33, 90, 200), seed=8)
    expected = hf_greedy(tiny_model_dir, prompts, MAX_TOKENS)

    async def scenario() -> None:
        cluster = LocalCluster(cluster_config(tiny_model_dir))
        try:
            await cluster.start()
            membership = await cluster.membership()
            nodes = {w.role.value: w.node for w in membership.workers
                     if w.state is WorkerLifecycle.SERVING}  # fmt: skip
            assert nodes["prefill"] == prefill_node and nodes["decode"] in decode_nodes
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


def test_a_worker_on_another_node_counts_that_nodes_cpus(nodes, tiny_model_dir):
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


def worker_env(pid: int) -> dict[str, str]:
    """The environment a worker process started with (this machine's /proc)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        entries = f.read().split(b"\0")
    return dict(e.decode().split("=", 1) for e in entries if b"=" in e)


def test_workers_with_a_node_each_keep_the_openmp_spin(nodes, tiny_model_dir):
    """1P+2D under `shared` (each worker all of its node's CPUs): counted as on one node,
    the prefill and both decode workers would sleep their OpenMP threads
    (OMP_WAIT_POLICY=PASSIVE); each node offers one worker's role resource, so none
    shares a node's cores and every one keeps libgomp's spin."""
    prefill_node, decode_nodes = nodes
    config = cluster_config(tiny_model_dir)
    config.engine = dataclasses.replace(config.engine, num_threads=None)
    config.pools = dataclasses.replace(config.pools, num_decode=2)

    async def scenario() -> None:
        cluster = LocalCluster(config)
        try:
            await cluster.start()
            membership = await cluster.membership()
            placed = {w.node for w in membership.workers}
            assert placed == {prefill_node, *decode_nodes}
            for worker in membership.workers:
                assert "OMP_WAIT_POLICY" not in worker_env(worker.pid), worker.worker_id
            await assert_idle(membership, auth=cluster.config.worker.cluster_auth)
        finally:
            await cluster.stop()

    asyncio.run(scenario())
