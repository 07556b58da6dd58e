"""Worker processes (killable with -9) behind an in-process router whose membership the
test drives, as the pool controller would: `set_state`, `add`, `kill`.

The router runs on an asyncio loop in a background thread (as `InprocCluster`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tandem.router.config import RouterConfig
from tandem.router.membership import Membership, WorkerInfo, WorkerLifecycle
from tandem.router.server import Router
from tandem.router.worker_pool import WorkerEndpoint
from tandem.worker.config import WorkerRole
from tests.helpers.grpc_calls import assert_workers_idle
from tests.helpers.router_metrics import migration_counts
from tests.helpers.worker_process import WorkerProcess


class ProcessCluster:
    def __init__(
        self, model_dir: str, roles: dict[str, WorkerRole], **router_overrides: Any
    ) -> None:
        self.model_dir = model_dir
        self.router_overrides = {"warmup_profile": False, **router_overrides}
        self.procs = {wid: WorkerProcess(role, wid, model_dir) for wid, role in roles.items()}
        self.states: dict[str, WorkerLifecycle] = {}
        self.version = 0
        self.router: Router | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def migrations(self) -> dict[str, float]:
        """The router's `tandem:request_migrations_total` by reason."""
        assert self.router is not None, "start() first"
        return migration_counts(self.router)

    def run(self, coro: Coroutine, timeout_s: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def start(self) -> ProcessCluster:
        self._thread.start()
        self._start_procs(list(self.procs.values()))
        workers = [WorkerEndpoint(p.worker_id, p.role, p.endpoint) for p in self.procs.values()]
        config = RouterConfig(
            model_dir=self.model_dir, grpc_port=0, http_port=0, **self.router_overrides
        )
        self.run(self._start_router(config, workers))
        for worker_id in self.procs:
            self.states[worker_id] = WorkerLifecycle.SERVING
        self.publish()
        return self

    async def _start_router(self, config: RouterConfig, workers: list[WorkerEndpoint]) -> None:
        # Built on the loop it serves from (its channels bind to that loop).
        self.router = Router(config, workers)
        await self.router.start()

    @staticmethod
    def _start_procs(procs: list[WorkerProcess]) -> None:
        for proc in procs:
            proc.start()
        with ThreadPoolExecutor(len(procs)) as pool:
            list(pool.map(lambda p: p.wait_ready(), procs))

    def membership(self) -> Membership:
        self.version += 1
        workers = [
            WorkerInfo(
                worker_id=wid,
                role=self.procs[wid].role,
                state=state,
                endpoint=self.procs[wid].endpoint if state is not WorkerLifecycle.DEAD else "",
                pid=self.procs[wid].pid,
            )
            for wid, state in self.states.items()
        ]
        return Membership(version=self.version, workers=workers)

    def publish(self) -> None:
        """Hand the router the current states (what the controller's watcher does)."""
        self.run(self.router.update_membership(self.membership()))

    def set_state(self, worker_id: str, state: WorkerLifecycle) -> None:
        self.states[worker_id] = state
        self.publish()

    def add(self, worker_id: str, role: WorkerRole) -> None:
        """Start a new worker process and publish it as serving."""
        self.prepare(worker_id, role)
        self.set_state(worker_id, WorkerLifecycle.SERVING)

    def prepare(self, worker_id: str, role: WorkerRole) -> None:
        """Start a new worker process, serving but not yet published (a replacement the
        controller has up before it tells the routers: `set_state` publishes it)."""
        proc = self.procs[worker_id] = WorkerProcess(role, worker_id, self.model_dir)
        self._start_procs([proc])

    def kill(self, worker_id: str) -> None:
        """kill -9 (the router is told nothing: it finds out as the controller would)."""
        self.procs[worker_id].kill()

    @property
    def grpc_endpoint(self) -> str:
        return self.router.grpc_endpoint

    @property
    def http_endpoint(self) -> str:
        return self.router.http_endpoint

    def live_workers(self) -> list[tuple[str, str]]:
        return [
            (self.procs[wid].endpoint, self.procs[wid].role.value)
            for wid, state in self.states.items()
            if state is not WorkerLifecycle.DEAD
        ]

    def assert_idle(self, timeout_s: float = 10.0) -> None:
        """Every live worker idle (blocks free, nothing held) and the policy charges
        nothing (a dead worker's requests must have been released too)."""
        self.run(assert_workers_idle(self.live_workers(), max_channels=4, timeout_s=timeout_s))
        policy = self.router.policy_runtime.policy
        assert policy.is_idle(), f"router policy still charges {policy.num_in_flight} requests"

    def stop(self) -> None:
        try:
            if self.router is not None:
                self.run(self.router.stop(), timeout_s=60)
        finally:
            for proc in self.procs.values():
                proc.stop()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()
