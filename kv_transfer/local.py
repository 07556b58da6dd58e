"""The `local` backend: prefill and decode engines in one process (tests, colocated).

A `LocalRegistry` (owned by whoever builds both sides, never a module global) maps a
prefill worker id to its layout and `read_blocks`; a pull calls it directly and
returns a copy, so the decode side never aliases the prefill side's memory.
"""

from __future__ import annotations

import threading

import torch

from tandem.kv_transfer.blocks import CacheBlocks, ReadBlocks, check_shape, finished_with
from tandem.kv_transfer.errors import KvPullError
from tandem.kv_transfer.layout import KvLayout


class LocalRegistry:
    """worker_id -> (layout, read_blocks) of the prefill workers in this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._workers: dict[str, tuple[KvLayout, ReadBlocks]] = {}

    def register(self, worker_id: str, layout: KvLayout, read_blocks: ReadBlocks) -> None:
        with self._lock:
            if worker_id in self._workers:
                raise ValueError(f"worker {worker_id!r} is already registered")
            self._workers[worker_id] = (layout, read_blocks)

    def unregister(self, worker_id: str) -> bool:
        with self._lock:
            return self._workers.pop(worker_id, None) is not None

    def lookup(self, worker_id: str) -> tuple[KvLayout, ReadBlocks] | None:
        with self._lock:
            return self._workers.get(worker_id)


class LocalChannel:
    """Decode side of a local channel; blocking (the copy runs in a transfer thread)."""

    def __init__(self, registry: LocalRegistry, worker_id: str, layout: KvLayout) -> None:
        self.registry = registry
        self.worker_id = worker_id
        self.layout = layout
        self.channel_id = f"local:{worker_id}"

    @classmethod
    def open(cls, registry: LocalRegistry, worker_id: str, layout: KvLayout) -> LocalChannel:
        """Check the worker is there and shares our layout (LayoutMismatchError if not)."""
        entry = registry.lookup(worker_id)
        if entry is None:
            raise KvPullError(f"no local prefill worker {worker_id!r}")
        layout.check_matches(entry[0].fingerprint(), self_role="decode", other_role="prefill")
        return cls(registry, worker_id, layout)

    @property
    def is_open(self) -> bool:
        return self.registry.lookup(self.worker_id) is not None

    def pull(
        self, request_id: str, num_blocks: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        entry = self.registry.lookup(self.worker_id)
        if entry is None:
            raise KvPullError(f"local prefill worker {self.worker_id!r} is gone")
        try:
            result = entry[1](request_id)
        except KeyError:
            raise KvPullError(
                f"no KV held for request {request_id!r} (expired, released or unknown)"
            ) from None
        try:
            if isinstance(result, CacheBlocks):
                result.check(self.layout)
                blocks = result.gather()  # already a copy
                fresh = True
            else:
                check_shape(result, self.layout, "read_blocks result")
                blocks, fresh = result.detach(), False
        finally:
            finished_with(result)
        if blocks.shape[2] != num_blocks:
            raise KvPullError(
                f"pull of {request_id!r} returned {blocks.shape[2]} blocks, handle names "
                f"{num_blocks}"
            )
        if out is not None and out.shape == blocks.shape:
            return out.copy_(blocks)
        if fresh:
            return blocks
        # Copy: the result must not alias the prefill side's memory.
        return torch.empty(blocks.shape, dtype=blocks.dtype, device=blocks.device).copy_(blocks)

    def abort(self) -> None:
        """Nothing to wake: a local pull is a plain function call."""

    def close(self, wait_s: float = 1.0) -> None:
        """Nothing to free: the registry entry belongs to the prefill side."""
