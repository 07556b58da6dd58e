"""A small pools owner for tests: real in-process workers, an `AdminBackend`, and the
router fed with every membership change (what the Ray pool controller does in
production, without Ray: this exercises the router's side of the interface).

Scale starts workers (STARTING, then SERVING once they answer) and drains the
surplus: DRAINING until the worker's own Stats show nothing running, waiting or held,
then it stops and leaves the membership. A drain of one worker does the same; the
reconcile then starts a replacement so the targets hold. Calls return at once; the
reconcile runs in the background, the last target set wins.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import uuid
from collections.abc import Coroutine
from typing import Any

from tandem.decode_worker.server import DecodeWorker
from tandem.engine.config import EngineConfig
from tandem.prefill_worker.server import PrefillWorker
from tandem.router.config import RouterConfig
from tandem.router.membership import (
    Membership,
    PoolTargets,
    RestartHold,
    TargetsChanged,
    UnknownWorker,
    WorkerInfo,
    WorkerLifecycle,
)
from tandem.router.server import Router
from tandem.router.worker_pool import WorkerEndpoint
from tandem.worker.config import WorkerConfig, WorkerRole
from tests.helpers.grpc_calls import worker_stats
from tests.helpers.kv_budget import TEST_KV_CACHE_BYTES

logger = logging.getLogger(__name__)

# The most workers of one role this owner will run (beyond: ValueError naming the role).
BUDGET_PER_ROLE = 3
DRAIN_TIMEOUT_S = 60.0
DRAIN_MIN_S = 0.5


class InprocPools:
    def __init__(self, model_dir: str, targets: PoolTargets, **router_overrides: Any) -> None:
        self.model_dir = model_dir
        self.targets = targets
        self.router_overrides = {"warmup_profile": False, **router_overrides}
        self.router: Router | None = None
        self.infos: dict[str, WorkerInfo] = {}
        self.servers: dict[str, PrefillWorker | DecodeWorker] = {}
        self.version = 0
        self.owner = uuid.uuid4().hex
        # What a pool controller's restart backoff would put in the snapshots (by role).
        self.restart_holds: dict[str, RestartHold] = {}
        self._ids = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._reconcile: asyncio.Task | None = None
        self._lock: asyncio.Lock | None = None

    # ----- test side ---------------------------------------------------------------

    def run(self, coro: Coroutine, timeout_s: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def start(self) -> InprocPools:
        self._thread.start()
        self.run(self._start(), timeout_s=300)
        return self

    def stop(self) -> None:
        async def _stop() -> None:
            if self._reconcile is not None:
                self._reconcile.cancel()
            if self.router is not None:
                await self.router.stop()
            for server in self.servers.values():
                await server.stop()

        try:
            self.run(_stop(), timeout_s=60)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()

    def serving(self, role: WorkerRole) -> list[str]:
        return [
            i.worker_id
            for i in self.infos.values()
            if i.role is role and i.state is WorkerLifecycle.SERVING
        ]

    def settled(self) -> bool:
        """Serving workers match the targets and nothing is starting or draining."""
        return (
            len(self.serving(WorkerRole.PREFILL)) == self.targets.prefill
            and len(self.serving(WorkerRole.DECODE)) == self.targets.decode
            and all(i.state is WorkerLifecycle.SERVING for i in self.infos.values())
        )

    async def wait_settled(self, timeout_s: float = 120.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self.settled():
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"pools did not settle: {self.snapshot()}")
            await asyncio.sleep(0.05)

    def snapshot(self) -> Membership:
        return Membership(
            self.version,
            list(self.infos.values()),
            self.targets,
            owner=self.owner,
            restart_holds=dict(self.restart_holds),
        )

    # ----- AdminBackend -------------------------------------------------------------

    async def get_pools(self) -> Membership:
        return self.snapshot()

    async def scale(
        self, targets: PoolTargets, if_targets: PoolTargets | None = None
    ) -> Membership:
        if if_targets is not None and self.targets != if_targets:
            raise TargetsChanged(f"targets: {self.targets} now, not {if_targets}")
        for role in ("prefill", "decode"):
            if getattr(targets, role) > BUDGET_PER_ROLE:
                raise ValueError(
                    f"{role}: target {getattr(targets, role)} is beyond the budget of "
                    f"{BUDGET_PER_ROLE} workers"
                )
        self.targets = targets
        await self._publish()
        self._kick()
        return self.snapshot()

    async def drain(self, worker_id: str) -> Membership:
        info = self.infos.get(worker_id)
        if info is None:
            raise UnknownWorker(f"worker_id {worker_id!r} is not in the pools")
        if info.state is not WorkerLifecycle.SERVING:
            raise RuntimeError(f"worker {worker_id} is {info.state.value}, not serving")
        await self._set(worker_id, WorkerLifecycle.DRAINING)
        asyncio.get_running_loop().create_task(self.drain_and_stop(worker_id))
        return self.snapshot()

    # ----- reconcile ------------------------------------------------------------------

    async def _start(self) -> None:
        self._lock = asyncio.Lock()
        endpoints = []
        for role, n in ((WorkerRole.PREFILL, self.targets.prefill),
                        (WorkerRole.DECODE, self.targets.decode)):  # fmt: skip
            for _ in range(n):
                endpoints.append(await self.start_worker(role))
        config = RouterConfig(
            model_dir=self.model_dir, grpc_port=0, http_port=0, **self.router_overrides
        )
        self.router = Router(config, endpoints, admin=self)
        await self.router.start()
        for endpoint in endpoints:
            info = self.infos[endpoint.worker_id]
            self.infos[endpoint.worker_id] = _with(info, WorkerLifecycle.SERVING)
        await self._publish()

    async def start_worker(self, role: WorkerRole) -> WorkerEndpoint:
        worker_id = f"{role.value}-{next(self._ids)}"
        self.infos[worker_id] = WorkerInfo(worker_id, role, WorkerLifecycle.STARTING)
        await self._publish()
        engine = EngineConfig(
            model=self.model_dir,
            mode=role.engine_mode,
            num_threads=1,
            max_model_len=1024,
            kv_cache_memory_bytes=TEST_KV_CACHE_BYTES,
        )
        config = WorkerConfig(worker_id=worker_id, role=role, engine=engine)
        server = PrefillWorker(config) if role is WorkerRole.PREFILL else DecodeWorker(config)
        endpoint = await server.start()
        self.servers[worker_id] = server
        self.infos[worker_id] = WorkerInfo(
            worker_id,
            role,
            WorkerLifecycle.STARTING,
            endpoint=endpoint,
            metrics_url=f"{server.metrics.endpoint}/metrics",
        )
        return WorkerEndpoint(worker_id, role, endpoint)

    def _kick(self) -> None:
        if self._reconcile is None or self._reconcile.done():
            self._reconcile = asyncio.get_running_loop().create_task(self._reconcile_loop())

    async def _reconcile_loop(self) -> None:
        while not self.settled():
            changed = False
            for role, target in ((WorkerRole.PREFILL, self.targets.prefill),
                                 (WorkerRole.DECODE, self.targets.decode)):  # fmt: skip
                serving = self.serving(role)
                if len(serving) < target:
                    endpoint = await self.start_worker(role)
                    await self._set(endpoint.worker_id, WorkerLifecycle.SERVING)
                    changed = True
                elif len(serving) > target:
                    victim = serving[-1]
                    await self._set(victim, WorkerLifecycle.DRAINING)
                    await self.drain_and_stop(victim)
                    changed = True
            if not changed:
                await asyncio.sleep(0.05)

    async def drain_and_stop(self, worker_id: str) -> None:
        """Wait until the worker's own Stats show it idle, then stop it and drop it."""
        info = self.infos[worker_id]
        loop = asyncio.get_running_loop()
        # As the pool controller's `drain_min_s`: a request placed just before the router
        # saw the drain may not have reached the worker yet when its Stats look idle.
        settled_at = loop.time() + DRAIN_MIN_S
        deadline = loop.time() + DRAIN_TIMEOUT_S
        while loop.time() < deadline:
            stats = await worker_stats(info.endpoint, info.role.value)
            # As the pool controller's `WorkerLoad.is_idle`, plus open streams and blocks
            # (a decode worker pulling a request's KV runs nothing yet: importing).
            busy = stats.num_running or stats.num_waiting or stats.num_held
            busy = busy or stats.num_importing or stats.num_open_streams
            busy = busy or stats.num_free_blocks != stats.num_blocks
            if not busy and loop.time() >= settled_at:
                break
            await asyncio.sleep(0.05)
        else:
            logger.warning("drain of %s timed out; its requests migrate", worker_id)
        # Out of the membership first, so the router stops polling it, then stop it.
        del self.infos[worker_id]
        await self._publish()
        await self.servers.pop(worker_id).stop()
        self._kick()

    async def _set(self, worker_id: str, state: WorkerLifecycle) -> None:
        await self.set_states({worker_id: state})

    async def set_restart_holds(self, holds: dict[str, RestartHold]) -> None:
        self.restart_holds = dict(holds)
        await self._publish()

    async def set_states(self, states: dict[str, WorkerLifecycle]) -> None:
        """Change several workers' states in one snapshot to the router."""
        for worker_id, state in states.items():
            self.infos[worker_id] = _with(self.infos[worker_id], state)
        await self._publish()

    async def _publish(self) -> None:
        assert self._lock is not None
        async with self._lock:
            self.version += 1
            if self.router is not None and self.router.flow is not None:
                await self.router.update_membership(self.snapshot())


def _with(info: WorkerInfo, state: WorkerLifecycle) -> WorkerInfo:
    return WorkerInfo(
        info.worker_id, info.role, state, info.endpoint, info.node, info.pid, info.metrics_url
    )
