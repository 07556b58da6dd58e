"""Pins on the KV blocks that transfer threads touch in place (zero-copy KV transfer).

The engine is single-threaded except for one thing: KV transfer threads read a
prefilled request's blocks (prefill side, sending) or write a reserved request's blocks
(decode side, receiving) straight in the paged cache. `KvPins` is the only engine state
those threads touch, and the contract that keeps it safe:

* The engine `open`s an entry for a request whose blocks may be touched (held after
  prefill; reserved for an import). No engine step reads or writes those blocks then:
  held blocks are complete (never written again), imported ones are not scheduled.
* A transfer thread `acquire`s a pin (KeyError once the entry is retired or unknown)
  and calls the returned `unpin` exactly once when it stops touching the memory.
* The engine `retire`s an entry when it would free the blocks (release, lease expiry,
  abort, failed import). Unpinned, they are freed at once; pinned, the free waits for
  the last `unpin` and runs in `collect()` on the engine thread (every step and idle
  wake-up). So a block is never handed to another request while a thread touches it.

Thread-safe: `acquire`/unpin from any thread; `open`/`retire`/`close`/`collect` from the
engine thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class PinnedBlocks:
    """A request's blocks inside the paged cache, pinned until `unpin()` is called."""

    # The whole cache: [layers, 2, num_blocks_total, block_size, kv_heads, head_dim].
    kv_cache: torch.Tensor
    # The request's blocks in position order.
    block_ids: list[int]
    # Idempotent; the pin holder calls it once it no longer touches the blocks.
    unpin: Callable[[], None] = field(repr=False)


@dataclass
class _Entry:
    block_ids: list[int]
    num_pins: int = 0
    # Set when retired: frees the blocks (engine thread) once no pin is left.
    free: Callable[[], None] | None = None


class KvPins:
    """Request id -> blocks that transfer threads may pin; deferred frees."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        self._lock = threading.Lock()
        self._open: dict[str, _Entry] = {}
        # Retired while pinned: freed by `collect` after the last unpin.
        self._retired: list[_Entry] = []

    def open(self, req_id: str, block_ids: list[int]) -> None:
        """Let transfer threads pin `req_id`'s blocks (engine thread)."""
        with self._lock:
            if req_id in self._open:
                raise ValueError(f"KV of {req_id!r} is already open for transfer")
            self._open[req_id] = _Entry(list(block_ids))

    def acquire(self, req_id: str) -> PinnedBlocks:
        """Pin `req_id`'s blocks (any thread); KeyError when none are open for it."""
        with self._lock:
            entry = self._open.get(req_id)
            if entry is None:
                raise KeyError(f"no KV of request {req_id!r} is open for transfer")
            entry.num_pins += 1
        return PinnedBlocks(self.kv_cache, entry.block_ids, _Unpin(self, entry))

    def is_pinned(self, req_id: str) -> bool:
        with self._lock:
            entry = self._open.get(req_id)
            return entry is not None and entry.num_pins > 0

    def close(self, req_id: str) -> None:
        """Stop accepting pins for an unpinned entry, keeping its blocks (engine thread:
        an import joining the batch). RuntimeError while pinned: a thread still writes."""
        with self._lock:
            entry = self._open.get(req_id)
            if entry is not None and entry.num_pins:
                raise RuntimeError(f"KV of {req_id!r} is still being transferred")
            self._open.pop(req_id, None)

    def retire(self, req_id: str, free: Callable[[], None]) -> bool:
        """No new pins; run `free` now if unpinned (True), else later in `collect`."""
        with self._lock:
            entry = self._open.pop(req_id, None)
            if entry is not None and entry.num_pins:
                entry.free = free
                self._retired.append(entry)
                return False
        free()
        return True

    def collect(self) -> int:
        """Free retired entries whose last pin is gone (engine thread); how many."""
        with self._lock:
            done = [e for e in self._retired if not e.num_pins]
            self._retired = [e for e in self._retired if e.num_pins]
        for entry in done:
            assert entry.free is not None
            entry.free()
        return len(done)

    @property
    def num_pinned(self) -> int:
        """Entries (open or retired) that a transfer thread still touches."""
        with self._lock:
            return sum(e.num_pins > 0 for e in (*self._open.values(), *self._retired))

    def _unpin(self, entry: _Entry) -> None:
        with self._lock:
            if entry.num_pins <= 0:
                raise RuntimeError("KV pin released more often than acquired")
            entry.num_pins -= 1


class _Unpin:
    """The once-only unpin of one pin."""

    def __init__(self, pins: KvPins, entry: _Entry) -> None:
        self._pins = pins
        self._entry = entry
        self._lock = threading.Lock()
        self._done = False

    def __call__(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self._pins._unpin(self._entry)
