"""Bounded waits on a condition (never a fixed sleep standing in for "long enough")."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0, what: str = "") -> None:
    """Poll `condition` on the running loop until true; AssertionError after `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what or condition}")
        await asyncio.sleep(0.001)
