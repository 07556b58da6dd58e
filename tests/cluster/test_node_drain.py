"""`tandem drain --this-node`: what a Ray node about to go runs first (the Helm chart's
worker pods run it on SIGTERM).

Four Ray nodes on one machine (`ray.cluster_utils.Cluster`): the head (this driver, the
pool controller) with no CPUs; a node offering `tandem_prefill`; a node at its own
loopback address (127.0.0.2) offering two `tandem_decode`; and, added once the decode
worker serves there, a fourth (127.0.0.3) offering one. Streams are running on the
decode worker when a process on its node (connected to Ray through that node's raylet,
as a pod's shell is) runs the command: Ray places nothing new on the node though it has
room, the replacement serves on the fourth node, the streams finish whole, the old
worker stops with every block back, and the command exits 0.
"""

from __future__ import annotations

import asyncio
import sys

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tandem.cluster.cli import main
from tandem.cluster.launcher import LocalCluster
from tandem.cluster.ray_start import start_with_retries
from tandem.router.membership import Membership
from tests.helpers.grpc_calls import start_streams, stream_tokens
from tests.helpers.parallel import DISRUPTS_ITS_CLUSTER
from tests.helpers.prompts import make_prompts
from tests.helpers.ray_pools import assert_idle, cluster_config, serving, wait_membership

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow, DISRUPTS_ITS_CLUSTER]

NODES_TIMEOUT_S = 120
MAX_TOKENS = 160
DECODE_NODE_IP = "127.0.0.2"
FOURTH_NODE_IP = "127.0.0.3"
# `tandem drain` run by a process whose Ray node is the one at argv[1] (Ray picks a
# driver's node by its address), as a worker pod's shell runs it.
ON_NODE = """
import sys
import ray
from tandem.cluster.cli import main
ray.init(address=sys.argv[2], _node_ip_address=sys.argv[1], log_to_driver=False)
sys.exit(main(["drain", *sys.argv[3:]]))
"""


@pytest.fixture(scope="module")
def ray_nodes():
    """(cluster, head, prefill node, decode node), the driver connected to the head."""
    clusters: list[Cluster] = []

    def start() -> tuple[Cluster, str, str, str]:
        cluster = Cluster()
        clusters.append(cluster)
        head = cluster.add_node(num_cpus=0)
        prefill_node = cluster.add_node(num_cpus=2, resources={"tandem_prefill": 1})
        decode_node = cluster.add_node(
            num_cpus=2, resources={"tandem_decode": 2}, node_ip_address=DECODE_NODE_IP
        )
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes(timeout=NODES_TIMEOUT_S)
        return cluster, head.node_id, prefill_node.node_id, decode_node.node_id

    def undo() -> None:
        ray.shutdown()
        clusters[-1].shutdown()

    cluster, *nodes = start_with_retries(start, undo)
    yield cluster, *nodes
    ray.shutdown()
    cluster.shutdown()


@ray.remote(num_cpus=0)
class Probe:
    def ping(self) -> str:
        return "pong"


def ray_places_a_decode_actor(node_id: str | None = None, wait_s: float = 5.0) -> bool:
    """Whether Ray starts a new actor that asks for one `tandem_decode` (on `node_id`, if
    given: Ray honours that even on a draining node) within `wait_s`."""
    options: dict = {"resources": {"tandem_decode": 1}}
    if node_id is not None:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    probe = Probe.options(**options).remote()  # type: ignore[attr-defined]
    try:
        ready, _ = ray.wait([probe.ping.remote()], timeout=wait_s)
        return bool(ready)
    finally:
        ray.kill(probe)


def drain(*argv: str) -> int:
    return main(["drain", *argv])


def test_drain_this_node_moves_its_worker_and_loses_no_stream(ray_nodes, tiny_model_dir, capsys):
    ray_cluster, head, prefill_node, decode_node = ray_nodes
    prompts = make_prompts(2048, (20, 45, 70), seed=31)
    ids = [f"drain-{i}" for i in range(len(prompts))]

    async def scenario() -> None:
        cluster = LocalCluster(cluster_config(tiny_model_dir))
        command: asyncio.subprocess.Process | None = None
        try:
            await cluster.start()
            address = cluster.ray_address
            before = await cluster.membership()
            (old,) = serving(before, "decode")
            assert (old.node, serving(before, "prefill")[0].node) == (decode_node, prefill_node)
            # The controller runs where `LocalCluster` runs (the head here), never on a
            # worker's node that may go (Ray would place it anywhere otherwise).
            controller_node = await cluster.controller.__ray_call__.remote(
                lambda _: ray.get_runtime_context().get_node_id()
            )
            assert controller_node == head
            fourth = ray_cluster.add_node(
                num_cpus=2, resources={"tandem_decode": 1}, node_ip_address=FOURTH_NODE_IP
            )
            ray_cluster.wait_for_nodes(timeout=NODES_TIMEOUT_S)

            # Refused (exit 2), nothing changes: a node not in the cluster; the head, by
            # the start of its id (as `tandem pools` shows it) or as `--this-node` (this
            # driver's node).
            for argv, reason in (
                (["--node", "ab" * 28], "no alive Ray node with an id starting 'abab"),
                (["--node", head[:12]], f"node: {head} is the Ray head node"),
                (["--this-node"], f"node: {head} is the Ray head node"),
            ):
                assert await asyncio.to_thread(drain, *argv, "--ray-address", address) == 2
                assert reason in capsys.readouterr().err
            assert (await cluster.membership()).workers == before.workers

            # The decode node has room for one more decode worker. (Checked there: a probe
            # actor started and killed on the fourth node just before the replacement
            # went there once took that node's raylet down with it, Ray 2.60 logging no
            # reason, and the replacement never came up.)
            assert await asyncio.to_thread(ray_places_a_decode_actor, decode_node)

            streams = await start_streams(cluster.router.grpc_endpoint, ids, prompts)
            command = await asyncio.create_subprocess_exec(
                sys.executable, "-c", ON_NODE, DECODE_NODE_IP, address,
                "--this-node", "--ray-address", address, "--timeout", "120",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip

            def replacements(m: Membership) -> list:
                return [w for w in serving(m, "decode") if w.worker_id != old.worker_id]

            moved = await wait_membership(cluster, replacements, 120.0, "a replacement serving")
            (new,) = replacements(moved)
            assert new.node == fourth.node_id
            # Ray places nothing new on the draining node, though it has room (and the
            # replacement took the fourth node's only place).
            assert not await asyncio.to_thread(ray_places_a_decode_actor)
            out, err = await asyncio.wait_for(command.communicate(), 150.0)
            assert command.returncode == 0, err.decode()[-3000:]
            assert out.decode().strip() == (
                f"node {decode_node}: drained and stopped: {old.worker_id}"
            )
            results = await asyncio.gather(*streams)

            after = await cluster.controller.wait_at_target.remote(120.0)
            assert [w.worker_id for w in serving(after, "decode")] == [new.worker_id]
            assert old.worker_id not in [w.worker_id for w in after.workers]
            # The one replacement went straight to the fourth node: none came up on
            # the draining node to be drained in turn.
            loads = await cluster.controller.drained_loads.remote()
            assert list(loads) == [old.worker_id]
            last = loads[old.worker_id]
            assert last.is_idle and last.num_free_blocks == last.num_blocks
            # Nothing lost: each stream whole, and token-equal to a run on the new worker.
            endpoint = cluster.router.grpc_endpoint
            again = await asyncio.gather(*(stream_tokens(endpoint, f"again-{i}", p)
                                           for i, p in enumerate(prompts)))  # fmt: skip
            assert [tokens for tokens, _ in results] == [tokens for tokens, _ in again]
            assert all(len(tokens) == MAX_TOKENS for tokens, _ in results)
            await assert_idle(after, auth=cluster.config.worker.cluster_auth)
        finally:
            if command is not None and command.returncode is None:
                command.kill()
                await command.wait()
            await cluster.stop()

    asyncio.run(scenario())


def test_drain_this_node_needs_the_ray_address(capsys):
    assert main(["drain", "--this-node", "--address", "127.0.0.1:1"]) == 2
    assert "--node and --this-node need --ray-address" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["drain", "--worker", "decode-0", "--node", "ab" * 28])
    for argv in ([], ["--node", ""], ["--worker", " "], ["--worker", "d", "--timeout", "inf"]):
        with pytest.raises(SystemExit):
            main(["drain", *argv])
