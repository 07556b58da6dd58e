"""Resource counters of a KV transfer endpoint (what leak checks and worker stats read)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class TransferStats:
    # Channels currently open (decode side: to prefill workers; prefill side: from decode).
    num_open_channels: int
    # Live threads owned by this endpoint (socket I/O, gathers, NCCL init).
    num_transfer_threads: int


def count_threads(name_prefix: str) -> int:
    """Live threads whose name starts with `name_prefix` (executor threads of one owner)."""
    return sum(t.name.startswith(name_prefix) for t in threading.enumerate())


async def wait_threads_gone(name_prefix: str, timeout_s: float) -> int:
    """Wait (polling, bounded) until no thread named `name_prefix*` is alive; the count
    still alive when the time is up."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (alive := count_threads(name_prefix)) and loop.time() < deadline:
        await asyncio.sleep(0.005)
    return alive
