"""Threads per worker when workers share a node: `--thread-policy` (default shared)."""

from __future__ import annotations

from tandem.cluster.cli import build_parser, cluster_config_from_args
from tandem.cluster.config import RayConfig, ThreadPolicy
from tandem.cluster.pool_controller import PoolController
from tandem.cluster.threads import AwayThreads, threads_per_worker
from tandem.cluster.worker_env import NodePools, WorkerEnvRule, node_capacity
from tandem.engine.host_cpus import available_cpus
from tandem.worker.config import WorkerRole


def env_of(
    role: WorkerRole, num_threads: int, pools: NodePools, num_cores: int, device: str,
    environ: dict[str, str],
) -> dict[str, str]:  # fmt: skip
    """The variables a `role` worker gets under that rule while the node runs `pools`."""
    return WorkerEnvRule.of(num_threads, num_cores, device, environ).env(role, pools)


def test_shared_gives_every_worker_the_node_and_split_divides_it() -> None:
    assert threads_per_worker(ThreadPolicy.SHARED, 16, 2) == 16
    assert threads_per_worker(ThreadPolicy.SPLIT, 16, 2) == 8
    assert threads_per_worker(ThreadPolicy.SPLIT, 2, 3) == 1
    assert threads_per_worker(ThreadPolicy.SHARED, 0, 2) == 1


def test_a_worker_away_from_the_serve_node_counts_its_own_cpus() -> None:
    shared = AwayThreads("home", ThreadPolicy.SHARED, node_workers=2)
    assert shared.on("home") is None  # serve's decision stands on its own node
    assert shared.on("other") == available_cpus()
    # `split` on a node that may hold two workers: half of it (at least one thread).
    split = AwayThreads("home", ThreadPolicy.SPLIT, node_workers=2)
    assert split.on("other") == max(1, available_cpus() // 2)


def test_thread_policy_flag(tiny_model_dir) -> None:
    def config(*flags: str):
        argv = ["serve", "--model", str(tiny_model_dir), "--device", "cpu", *flags]
        return cluster_config_from_args(build_parser().parse_args(argv))

    assert RayConfig().thread_policy is ThreadPolicy.SHARED
    assert config().ray.thread_policy is ThreadPolicy.SHARED
    assert config("--thread-policy", "split").ray.thread_policy is ThreadPolicy.SPLIT
    assert config("--threads", "3").engine.num_threads == 3  # --threads wins over a policy


def test_worker_env_makes_prefill_threads_sleep_only_when_workers_oversubscribe() -> None:
    prefill, decode = WorkerRole.PREFILL, WorkerRole.DECODE
    one_each = NodePools.of([prefill, decode])
    # 2 workers x 2 threads on 2 cores (shared on a 2-core node): the bursty prefill
    # worker's threads sleep at once; the decode worker keeps libgomp's spin.
    assert env_of(prefill, 2, one_each, 2, "cpu", {}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert env_of(decode, 2, one_each, 2, "cpu", {}) == {}
    # Threads that fit the cores (split, or one worker) keep libgomp's default spin.
    assert env_of(prefill, 1, one_each, 2, "cpu", {}) == {}
    assert env_of(prefill, 2, NodePools.of([prefill]), 2, "cpu", {}) == {}
    one_colocated = NodePools.of([WorkerRole.COLOCATED])
    assert env_of(WorkerRole.COLOCATED, 2, one_colocated, 2, "cpu", {}) == {}
    # The operator's own setting wins (and reaches workers on joined nodes as it is);
    # GPU workers get no wait policy.
    active = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert env_of(prefill, 2, one_each, 2, "cpu", active) == active
    spin = {"GOMP_SPINCOUNT": "1000"}
    assert env_of(prefill, 2, one_each, 2, "cpu", spin) == spin
    assert env_of(prefill, 8, one_each, 2, "cuda", {}) == {}


def test_worker_env_makes_decode_threads_sleep_when_decode_workers_oversubscribe() -> None:
    # Two decode workers of 2 threads on 2 cores step at once: spinning, each holds the
    # cores the other needs (1P+2D on 2 cores: 78.6 against 275.7 output tok/s
    # at concurrency 8), so both sleep at once; so do two colocated workers.
    prefill, decode, colocated = WorkerRole.PREFILL, WorkerRole.DECODE, WorkerRole.COLOCATED
    passive = {"OMP_WAIT_POLICY": "PASSIVE"}
    two_decode = NodePools.of([prefill, decode, decode])
    assert env_of(decode, 2, two_decode, 2, "cpu", {}) == passive
    assert env_of(prefill, 2, two_decode, 2, "cpu", {}) == passive
    assert env_of(colocated, 2, NodePools.of([colocated] * 2), 2, "cpu", {}) == passive
    # Prefill workers are not counted against the decode side: they sleep already.
    assert env_of(decode, 2, NodePools.of([prefill, prefill, decode]), 2, "cpu", {}) == {}
    # split: one thread each, and the two decode workers' threads fit the 2 cores.
    assert env_of(decode, 1, two_decode, 2, "cpu", {}) == {}
    assert env_of(decode, 2, two_decode, 2, "cuda", {}) == {}


def test_pools_at_start_count_the_decode_workers_the_auto_planner_may_start(tiny_model_dir) -> None:
    # A worker's wait policy is fixed when it starts: under `--planner auto` the decode
    # side is set for the most decode workers the budget allows (budget less 1 prefill).
    def pools(*flags: str) -> NodePools:
        argv = ["serve", "--model", str(tiny_model_dir), "--device", "cpu", *flags]
        return NodePools.at_start(cluster_config_from_args(build_parser().parse_args(argv)))

    assert pools("--prefill", "2") == NodePools(3, 1)
    assert pools("--prefill", "2", "--planner", "observe") == NodePools(3, 1)
    assert pools("--prefill", "2", "--planner", "auto") == NodePools(3, 2)
    assert pools("--planner", "auto", "--max-workers", "4") == NodePools(4, 3)
    assert pools("--planner", "auto") == NodePools(2, 1)  # budget 2: one of each, always
    assert pools("--colocated", "2", "--planner", "auto") == NodePools(2, 2)


def test_worker_env_forwards_triton_interpret_to_every_worker() -> None:
    # Start-up checked `--attention-backend triton` against the serve process's
    # TRITON_INTERPRET; a worker on a node that joined with `ray start` must see it too.
    interpret = {"TRITON_INTERPRET": "1", "HOME": "/root"}
    for role in WorkerRole:
        for device in ("cpu", "cuda"):
            env = env_of(role, 1, NodePools.of([role]), 2, device, interpret)
            assert env == {"TRITON_INTERPRET": "1"}
    one_each = NodePools.of([WorkerRole.PREFILL, WorkerRole.DECODE])
    both = env_of(WorkerRole.PREFILL, 2, one_each, 2, "cpu", interpret)
    assert both == {"TRITON_INTERPRET": "1", "OMP_WAIT_POLICY": "PASSIVE"}


def test_a_decode_worker_that_scale_adds_sleeps_where_two_oversubscribe(tiny_model_dir) -> None:
    # 1P+1D on 2 cores, 2 threads each: the decode worker spins. `tandem scale` to two
    # decode workers: the one it adds sleeps (1P+2D on 2 cores with it spinning too:
    # 61.5 output tok/s at concurrency 8; with it passive: 155.4).
    argv = ["serve", "--model", str(tiny_model_dir), "--device", "cpu"]
    config = cluster_config_from_args(build_parser().parse_args(argv))
    rule = WorkerEnvRule.of(2, 2, "cpu", {"HOME": "/root"})
    controller = PoolController(config, 2, rule)
    prefill, decode = WorkerRole.PREFILL, WorkerRole.DECODE

    def worker_env(role: WorkerRole) -> dict[str, str]:
        """What the controller gives a `role` worker it starts now."""
        return rule.env(role, controller.node_pools(role))

    assert worker_env(decode) == {}
    assert worker_env(prefill) == {"OMP_WAIT_POLICY": "PASSIVE"}
    controller.state.set_targets({prefill: 1, decode: 2})
    assert worker_env(decode) == {"OMP_WAIT_POLICY": "PASSIVE"}
    # Back to one: a replacement decode worker spins again.
    controller.state.set_targets({prefill: 1, decode: 1})
    assert worker_env(decode) == {}


def test_node_capacity_counts_the_role_resources_one_node_offers() -> None:
    """`ray.nodes()` entries: Helm's shape (a head without workers, one worker's role
    resource per pod) holds one worker a node; a local node offers the budget of each."""
    prefill, decode = WorkerRole.PREFILL, WorkerRole.DECODE

    def node(alive: bool = True, **resources: float) -> dict:
        return {"Alive": alive, "Resources": {"CPU": 8.0, **resources}}

    helm = [node(), node(tandem_prefill=1), node(tandem_decode=1), node(tandem_decode=1)]
    assert node_capacity(decode, helm) == NodePools(1, 1)
    assert node_capacity(prefill, helm) == NodePools(1, 0)
    assert node_capacity(WorkerRole.COLOCATED, helm) is None  # no node takes one
    local = [node(tandem_prefill=3, tandem_decode=3)]
    assert node_capacity(decode, local) == NodePools(6, 3)
    # A dead node's resources are not counted.
    gone = [node(tandem_decode=1), node(alive=False, tandem_decode=4, tandem_prefill=4)]
    assert node_capacity(decode, gone) == NodePools(1, 1)
    # Capped: 1P+2D counted as on one node, on a node that holds one worker.
    assert NodePools(3, 2).capped(NodePools(1, 1)) == NodePools(1, 1)
