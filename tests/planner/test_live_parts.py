"""The live planner's parts without a cluster: counter deltas, serve flags, models."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from tandem.cluster.cli import CliError, build_parser, cluster_config_from_args
from tandem.planner.live import laws_from_router
from tandem.planner.live_config import PlannerMode
from tandem.planner.observe import Counters, load_between, read_counters
from tandem.router.metrics import RouterMetrics
from tandem.router.policy import DecodeLatencyModel, PrefillLatencyModel, WorkerState


def test_counter_deltas_become_the_observed_load():
    registry = CollectorRegistry()
    ttft = Histogram("tandem:time_to_first_token_seconds", "", ["model_name"], registry=registry)
    prompt = Counter("tandem:prompt_tokens", "", ["model_name"], registry=registry)
    generated = Histogram("tandem:request_generation_tokens", "", ["model_name"],
                          registry=registry)  # fmt: skip
    done = Counter("tandem:request_success", "", ["model_name", "finished_reason"],
                   registry=registry)  # fmt: skip
    good = Counter("tandem:goodput_requests", "", ["model_name"], registry=registry)
    before = read_counters(registry, cached_tokens=0)
    for _ in range(10):
        ttft.labels("m").observe(0.1)
    prompt.labels("m").inc(1000)
    for num_tokens in (20, 30, 40, 50, 60, 60, 70, 70):
        generated.labels("m").observe(num_tokens)
    done.labels("m", "length").inc(6)
    done.labels("m", "stop").inc(2)
    good.labels("m").inc(4)
    load = load_between(before, read_counters(registry, cached_tokens=250), interval_s=2.0)
    assert load.num_requests == 10 and load.arrival_rate_rps == 5.0
    assert load.mean_prompt_tokens == 100.0
    assert load.mean_output_tokens == 50.0  # 400 tokens over 8 finished requests
    assert load.prefix_hit_share == 0.25
    assert load.goodput_rps == 2.0


def test_the_mean_output_length_counts_finished_requests_only():
    """Tokens of requests still streaming are not output lengths yet: counted in, a window
    of long streams read 1.6x their length (200 tokens a request for 128)."""
    metrics = RouterMetrics("m")
    before = read_counters(metrics.registry, cached_tokens=0)
    done, running = metrics.record(10), metrics.record(10)
    done.on_tokens(128)
    done.finish("length")
    running.on_tokens(300)
    load = load_between(before, read_counters(metrics.registry, cached_tokens=0), 1.0)
    assert load.num_finished == 1
    assert load.mean_output_tokens == 128.0


def test_requests_shed_for_overload_count_as_arrivals():
    """An overloaded cluster that sheds requests (admission shed) served only part of its
    demand; the planner plans for all of it (counting only the served, it saw a cluster
    just busy enough). Requests refused for want of any worker are not load."""
    metrics = RouterMetrics("m")
    before = read_counters(metrics.registry, cached_tokens=0)
    for _ in range(10):
        metrics.ttft.labels("m").observe(0.1)
    metrics.rejected.labels("m", "overloaded").inc(6)
    metrics.rejected.labels("m", "unavailable").inc(3)
    load = load_between(before, read_counters(metrics.registry, cached_tokens=0), 2.0)
    assert load.num_requests == 10 and load.arrival_rate_rps == 8.0


def test_models_are_averaged_per_role():
    def worker(wid, role, prefill, decode):
        return WorkerState(wid, role, block_size=16, num_blocks=100,
                           prefill_model=PrefillLatencyModel(prefill),
                           decode_model=DecodeLatencyModel(decode))  # fmt: skip

    laws = laws_from_router(
        [worker("p0", "prefill", (0.01, 1e-4, 0.0), (9, 9, 9)),
         worker("p1", "prefill", (0.03, 3e-4, 0.0), (9, 9, 9)),
         worker("d0", "decode", (9, 9, 9), (0.02, 1e-3, 1e-7))],
        transfer_s_per_token=1e-6,
    )  # fmt: skip
    assert laws.prefill_fixed_s == pytest.approx(0.02)
    assert laws.prefill_per_token_s == pytest.approx(2e-4)
    assert laws.decode_fixed_s == pytest.approx(0.02)
    assert laws.transfer_s_per_token == 1e-6


def serve_config(model_dir, *flags):
    args = build_parser().parse_args(["serve", "--model", str(model_dir), *flags])
    return cluster_config_from_args(args)


def test_serve_planner_flags(tiny_model_dir):
    default = serve_config(tiny_model_dir).planner
    assert default.mode is PlannerMode.OBSERVE and default.interval_s == 60
    assert default.max_workers is None
    chosen = serve_config(tiny_model_dir, "--planner", "auto", "--planner-interval", "5",
                          "--max-workers", "4").planner  # fmt: skip
    assert (chosen.mode, chosen.interval_s, chosen.max_workers) == (PlannerMode.AUTO, 5, 4)
    with pytest.raises(CliError, match="--max-workers must be >= 2"):
        serve_config(tiny_model_dir, "--max-workers", "1")
    with pytest.raises(SystemExit):
        serve_config(tiny_model_dir, "--planner", "sometimes")
    # A budget for no planner did nothing, silently.
    with pytest.raises(CliError, match="--max-workers is the live planner's budget"):
        serve_config(tiny_model_dir, "--planner", "off", "--max-workers", "3")


@pytest.mark.parametrize("operator_lands", ["while planning", "after the re-read"])
def test_an_operators_scale_during_a_plan_is_not_undone(operator_lands):
    """The planner read the split, planned for seconds, then set one step from that split
    as whole targets: a `tandem scale` landing meanwhile (3P+3D here) was replaced by
    2P+1D, three workers at once. It now reads the pools again after planning, and its
    scale is made only if the targets are still the split it planned from (a
    compare-and-set at the pools' owner: an operator's scale can land after that read)."""
    import asyncio
    import types

    from prometheus_client import CollectorRegistry

    from tandem.planner.live import LivePlanner
    from tandem.planner.live_config import PlannerConfig, PlannerMode
    from tandem.planner.live_inputs import InputWindow
    from tandem.planner.live_plan import LivePlanResult
    from tandem.router.membership import (
        Membership,
        PoolTargets,
        TargetsChanged,
        WorkerInfo,
        WorkerLifecycle,
    )
    from tandem.router.pool_gauges import PlannerGauges
    from tandem.worker.config import WorkerRole

    class Pools:
        """The pools' owner (admin backend) at some targets, every worker serving."""

        def __init__(self) -> None:
            self.targets, self.scales, self.num_reads = (1, 2), [], 0

        async def get_pools(self) -> Membership:
            (p, d), state = self.targets, WorkerLifecycle.SERVING
            workers = [WorkerInfo(f"prefill-{i}", WorkerRole.PREFILL, state) for i in range(p)]
            workers += [WorkerInfo(f"decode-{i}", WorkerRole.DECODE, state) for i in range(d)]
            self.num_reads += 1
            if operator_lands == "after the re-read" and self.num_reads == 2:
                await self.scale(PoolTargets(prefill=3, decode=3))  # the operator
            return Membership(1, workers, PoolTargets(prefill=p, decode=d), {}, "owner")

        async def scale(
            self, targets: PoolTargets, if_targets: PoolTargets | None = None
        ) -> Membership:
            if if_targets is not None and (if_targets.prefill, if_targets.decode) != self.targets:
                raise TargetsChanged(f"targets: {self.targets} now")
            self.scales.append((targets.prefill, targets.decode))
            self.targets = (targets.prefill, targets.decode)
            return await self.get_pools()

    pools = Pools()
    gauges = types.SimpleNamespace(planner=PlannerGauges(CollectorRegistry()))
    router = types.SimpleNamespace(admin_backend=pools, metrics=gauges)
    config = PlannerConfig(mode=PlannerMode.AUTO, interval_s=10, max_workers=3,
                           min_change_interval_s=0, confirmations=1)  # fmt: skip
    planner = LivePlanner(config, router, limits=None)  # type: ignore[arg-type]
    planner.budget = 3
    reads = iter(range(100, 10_000, 100))

    async def counters() -> Counters:
        n = next(reads)
        return Counters(first_tokens=n, prompt_tokens=n * 1800, generation_tokens=n * 2,
                        finished=n, goodput=n)  # fmt: skip

    async def plan(load, split) -> LivePlanResult:
        if operator_lands == "while planning":
            await pools.scale(PoolTargets(prefill=3, decode=3))  # the operator
        return LivePlanResult((2, 1), "2P+1D", {(1, 2): 1.0, (2, 1): 2.0}, 2.0)

    planner._read_counters = counters  # type: ignore[method-assign]
    planner._plan = plan  # type: ignore[method-assign]
    planner._inputs = InputWindow(3, 0.0, Counters())
    asyncio.run(planner.run_once())
    assert pools.scales == [(3, 3)], pools.scales
    assert "resized while planning" in planner.last_action


def test_the_predicted_goodput_falls_to_zero_once_the_traffic_stops():
    """The prediction is for the observed load: once the planner waits for traffic, the
    last plan's figure no longer stands (it stayed for as long as no request came)."""
    import asyncio
    import types

    from prometheus_client import CollectorRegistry

    from tandem.planner.live import LivePlanner
    from tandem.planner.live_config import PlannerConfig, PlannerMode
    from tandem.planner.live_inputs import InputWindow
    from tandem.planner.live_plan import LivePlanResult
    from tandem.router.membership import Membership, PoolTargets
    from tandem.router.pool_gauges import PlannerGauges

    class Pools:
        async def get_pools(self) -> Membership:
            return Membership(1, [], PoolTargets(prefill=1, decode=2), {}, "owner")

    gauges = PlannerGauges(CollectorRegistry())
    router = types.SimpleNamespace(admin_backend=Pools(),
                                   metrics=types.SimpleNamespace(planner=gauges))  # fmt: skip
    config = PlannerConfig(mode=PlannerMode.OBSERVE, interval_s=10, max_workers=3)
    planner = LivePlanner(config, router, limits=None)  # type: ignore[arg-type]
    planner.budget = 3
    reads = iter([100, 200, 200, 200, 200, 200])  # traffic, then none

    async def counters() -> Counters:
        n = next(reads)
        return Counters(first_tokens=n, prompt_tokens=n * 100, generation_tokens=n * 20,
                        finished=n, goodput=n)  # fmt: skip

    async def plan(load, split) -> LivePlanResult:
        return LivePlanResult((2, 1), "2P+1D", {(1, 2): 1.0, (2, 1): 2.0}, 2.0)

    planner._read_counters = counters  # type: ignore[method-assign]
    planner._plan = plan  # type: ignore[method-assign]
    planner._inputs = InputWindow(3, 0.0, Counters())
    asyncio.run(planner.run_once())
    assert (gauges.recommended, gauges.predicted_rps) == ((2, 1), 2.0)
    for _ in range(4):
        asyncio.run(planner.run_once())
    assert planner.last_action.startswith("waiting for traffic"), planner.last_action
    assert (gauges.recommended, gauges.predicted_rps) == ((2, 1), 0.0)


@pytest.mark.parametrize(("max_workers", "planned_budget"), [(None, 4), (2, 2)])
def test_an_implicit_budget_follows_an_operators_scale(max_workers, planned_budget):
    """Without --max-workers the budget is the pools' size at start (2 here). An
    operator's `tandem scale` to 2P+2D under `--planner auto` was taken back to 1P+1D
    within a minute, a worker at a time: the planner kept planning for 2 workers. It now
    plans for the pools' new total; a --max-workers budget stays a cap."""
    import asyncio
    import types

    from prometheus_client import CollectorRegistry

    from tandem.planner.live import LivePlanner
    from tandem.planner.live_config import PlannerConfig, PlannerMode
    from tandem.planner.live_inputs import InputWindow
    from tandem.planner.live_plan import LivePlanResult
    from tandem.router.membership import Membership, PoolTargets, WorkerInfo, WorkerLifecycle
    from tandem.router.pool_gauges import PlannerGauges
    from tandem.worker.config import WorkerRole

    class Pools:
        """Scaled by an operator to 2P+2D, every worker serving."""

        async def get_pools(self) -> Membership:
            roles = (WorkerRole.PREFILL, WorkerRole.DECODE)
            workers = [WorkerInfo(f"{role.value}-{i}", role, WorkerLifecycle.SERVING)
                       for role in roles for i in range(2)]  # fmt: skip
            return Membership(3, workers, PoolTargets(prefill=2, decode=2), {}, "owner")

    gauges = types.SimpleNamespace(planner=PlannerGauges(CollectorRegistry()))
    router = types.SimpleNamespace(admin_backend=Pools(), metrics=gauges)
    config = PlannerConfig(mode=PlannerMode.OBSERVE, interval_s=10, max_workers=max_workers)
    planner = LivePlanner(config, router, limits=None)  # type: ignore[arg-type]
    planner.budget = 2  # what start() set: --max-workers, or the pools' 1P+1D then
    budgets = []

    async def counters() -> Counters:
        return Counters(first_tokens=100, prompt_tokens=10_000, generation_tokens=2_000,
                        finished=100, goodput=100)  # fmt: skip

    async def plan(load, split) -> LivePlanResult:
        budgets.append(planner.budget)
        return LivePlanResult((1, 1), "1P+1D", {(1, 1): 1.0}, 1.0)

    planner._read_counters = counters  # type: ignore[method-assign]
    planner._plan = plan  # type: ignore[method-assign]
    planner._inputs = InputWindow(3, 0.0, Counters())
    asyncio.run(planner.run_once())
    assert budgets == [planned_budget]
    assert planner.view()["budget"] == planned_budget
