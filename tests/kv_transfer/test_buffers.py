"""Recycled receive buffers: reused only once nothing references them, bounded."""

from __future__ import annotations

import gc

import pytest
import torch

from tandem.kv_transfer.buffers import BufferPool

pytestmark = pytest.mark.timeout(30)

SHAPE = (2, 2, 8, 4, 2, 8)  # 8 KiB of float32


def test_memory_is_reused_only_after_the_last_reference_dies() -> None:
    pool = BufferPool(1 << 20)
    first = pool.empty(SHAPE, torch.float32)
    assert first.shape == SHAPE and first.dtype == torch.float32 and first.is_contiguous()
    address = first.data_ptr()
    view = first[:, :, 3:5]  # a view keeps the memory in use
    del first
    gc.collect()
    second = pool.empty(SHAPE, torch.float32)
    assert second.data_ptr() != address and pool.pooled_bytes == 0
    view.fill_(1.0)
    del view
    gc.collect()
    assert pool.pooled_bytes == 8192
    third = pool.empty(SHAPE, torch.bfloat16)  # 4 KiB: fits the 8 KiB buffer
    assert third.data_ptr() == address and pool.pooled_bytes == 0
    assert second.data_ptr() != third.data_ptr()


def test_pool_is_bounded_and_close_drops_it() -> None:
    pool = BufferPool(12000)
    tensors = [pool.empty(SHAPE, torch.float32) for _ in range(3)]
    del tensors
    gc.collect()
    assert pool.pooled_bytes == 8192  # room for one 8 KiB buffer only
    big = pool.empty((1 << 20,), torch.uint8)  # over the cap: a plain allocation
    del big
    gc.collect()
    assert pool.pooled_bytes == 8192
    kept = pool.empty(SHAPE, torch.float32)
    pool.close()
    assert pool.pooled_bytes == 0
    del kept
    gc.collect()
    assert pool.pooled_bytes == 0
    assert BufferPool(0).empty(SHAPE, torch.float32).shape == SHAPE
