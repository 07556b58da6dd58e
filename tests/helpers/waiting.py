"""Bounded waits on a condition (never a fixed sleep standing in for "long enough")."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


async def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0, what: str = "") -> None:
    """Poll `condition` on the running loop until true; AssertionError after `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what or condition}")
        await asyncio.sleep(0.001)


def run_bounded(scenario: Coroutine[Any, Any, T], timeout_s: float) -> T:
    """`asyncio.run(scenario)`, failed after `timeout_s` with where every task of the loop
    was waiting (a hang then shows its awaits, not pytest-timeout's idle event loop)."""

    async def bounded() -> T:
        task = asyncio.ensure_future(scenario)
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
        if task in done:
            return task.result()
        where = "\n".join(
            f"{other.get_name()}:\n{await_chain(other.get_coro())}"
            for other in asyncio.all_tasks()
            if other is not asyncio.current_task()
        )
        # Shown now as well: should the clean-up below hang too, pytest-timeout ends it.
        print(f"still running after {timeout_s:g} s; its tasks:\n{where}", file=sys.stderr)
        task.cancel()  # its own clean-up runs (30 s at most here)
        await asyncio.wait({task}, timeout=30.0)
        cleanup = ""
        if task.done() and not task.cancelled() and task.exception() is not None:
            cleanup = f"\n(its clean-up then failed: {task.exception()!r})"
        raise AssertionError(f"still running after {timeout_s:g} s; its tasks:\n{where}{cleanup}")

    return asyncio.run(bounded())


def await_chain(coro: Any) -> str:
    """Where a coroutine waits: each frame down its chain of awaits, then what it awaits."""
    lines = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:  # not a coroutine: the future (or other awaitable) at the end
            lines.append(f"  waits on {coro!r}"[:300])
            break
        lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return "\n".join(lines)
