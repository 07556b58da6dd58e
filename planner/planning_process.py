"""The separate process the live planner's searches run in, one search at a time, each
under a deadline. A search that overruns it costs its process (killed; a process pool
cannot stop one call, and the next search would queue behind it for as long as it ran),
as does a process that died (its pool stays broken for every later call); either way the
next search starts a fresh process."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing as mp
import os
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import TypeVar

from tandem.planner.live_plan import init_planning_process, warm_up

logger = logging.getLogger(__name__)

T = TypeVar("T")
A = TypeVar("A")


class PlanningProcess:
    """Owns the planner's process and the pool it runs in."""

    def __init__(self) -> None:
        self._executor: concurrent.futures.ProcessPoolExecutor | None = None
        # The process's pid, as it reports it from its warm-up (the pool has one process).
        self._pid: concurrent.futures.Future[int] | None = None

    def start(self) -> None:
        """Start the process and its imports (a no-op while one runs)."""
        if self._executor is not None:
            return
        self._executor = concurrent.futures.ProcessPoolExecutor(
            max_workers=1,
            mp_context=mp.get_context("spawn"),
            initializer=init_planning_process,
            initargs=(os.getpid(),),
        )
        self._pid = self._executor.submit(warm_up)

    async def run(self, fn: Callable[[A], T], arg: A, timeout_s: float) -> T:
        """fn(arg) in the process, within timeout_s (TimeoutError past it: the process is
        killed). fn and arg must pickle; fn must be importable by name."""
        self.start()
        assert self._executor is not None
        try:
            future = asyncio.get_running_loop().run_in_executor(self._executor, fn, arg)
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            logger.warning("planner: a search ran past %g s; its process is replaced", timeout_s)
            self.stop()
            raise
        except BrokenProcessPool:
            logger.warning("planner: its process died; the next search starts another")
            self.stop()
            raise

    def stop(self) -> None:
        """End the process, killed if it still runs (it may be mid-search)."""
        executor, pid, self._executor, self._pid = self._executor, self._pid, None, None
        if executor is None:
            return
        if pid is not None and pid.done() and pid.exception() is None:
            # Only a live child of ours: a pid that exited may be reaped and reused.
            for child in mp.active_children():
                if child.pid == pid.result():
                    child.kill()
        executor.shutdown(wait=False, cancel_futures=True)
