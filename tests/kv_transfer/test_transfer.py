"""Blocks arrive bit for bit over tcp and local, and a channel is reused across pulls."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tandem.kv_transfer import (
    CacheBlocks,
    KvHandle,
    KvLayout,
    KvPullError,
    KvTransferClient,
    LocalRegistry,
)
from tandem.kv_transfer.blocks import block_iovecs
from tests.helpers.kv_transfer_harness import (
    SMALL,
    TINY,
    FakeEngine,
    bits,
    prefill_server,
    random_cache,
)

pytestmark = pytest.mark.timeout(120)


def layout_of(dtype: str, base: KvLayout = TINY) -> KvLayout:
    return KvLayout(
        base.model, dtype, base.block_size, base.num_layers, base.num_kv_heads, base.head_dim
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("zero_copy", [True, False])
def test_tcp_pulls_are_bit_exact_and_reuse_one_channel(dtype: str, zero_copy: bool) -> None:
    layout = layout_of(dtype)
    engine = FakeEngine(random_cache(layout, 300), {}, zero_copy=zero_copy)
    # Sizes: one block, a scattered handful, most of the cache in shuffled order.
    engine.held = {
        "one": [5],
        "few": [9, 2, 250, 7],
        "many": torch.randperm(300, generator=torch.Generator().manual_seed(1))[:257].tolist(),
    }

    async def run() -> None:
        async with prefill_server(layout, engine.read_blocks) as prefill:
            client = KvTransferClient(layout, "decode-0")
            try:
                for _ in range(3):
                    for request_id, ids in engine.held.items():
                        got = await client.pull(prefill.handle(layout, request_id, ids))
                        want = engine.expected(request_id)
                        assert got.dtype == want.dtype and got.shape == want.shape
                        assert torch.equal(bits(got), bits(want))
                assert client.stats().num_open_channels == 1
                assert prefill.service.stats().num_open_channels == 1
            finally:
                await client.close()

    asyncio.run(run())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tcp_pull_over_64_mib_is_bit_exact(dtype: str) -> None:
    layout = layout_of(dtype, SMALL)
    num_blocks = 200 if dtype == "float32" else 400  # 75 MiB either way
    cache = random_cache(layout, num_blocks + 8)
    ids = list(range(num_blocks + 8))[::-1][:num_blocks]
    engine = FakeEngine(cache, {"big": ids})

    async def run() -> None:
        async with prefill_server(layout, engine.read_blocks) as prefill:
            client = KvTransferClient(layout, "decode-0")
            try:
                handle = prefill.handle(layout, "big", ids)
                got = await client.pull(handle)
                assert got.nbytes > 64 << 20
                assert torch.equal(bits(got), bits(engine.expected("big")))
                # Into a caller's buffer: the same bytes, no new allocation.
                out = torch.empty_like(got)
                assert (await client.pull(handle, out=out)) is out
                assert torch.equal(bits(out), bits(got))
            finally:
                await client.close()

    asyncio.run(run())


def test_concurrent_pulls_share_the_channel() -> None:
    engine = FakeEngine(random_cache(TINY, 64), {f"r{i}": [i, 63 - i, 2 * i] for i in range(16)})

    async def run() -> None:
        async with prefill_server(TINY, engine.read_blocks) as prefill:
            client = KvTransferClient(TINY, "decode-0")
            try:
                handles = [prefill.handle(TINY, r, ids) for r, ids in engine.held.items()]
                results = await asyncio.gather(*(client.pull(h) for h in handles))
                for handle, got in zip(handles, results, strict=True):
                    assert torch.equal(got, engine.expected(handle.request_id))
                assert client.stats().num_open_channels == 1
            finally:
                await client.close()

    asyncio.run(run())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("zero_copy", [True, False])
def test_local_pulls_are_bit_exact_copies(dtype: str, zero_copy: bool) -> None:
    layout = layout_of(dtype)
    engine = FakeEngine(random_cache(layout, 40), {"a": [3, 1, 4, 15], "b": [0]}, zero_copy)
    pristine = engine.cache.clone()
    registry = LocalRegistry()
    registry.register("prefill-local", layout, engine.read_blocks)

    async def run() -> None:
        client = KvTransferClient(layout, "decode-0", backend="local", local_registry=registry)
        try:
            for request_id, ids in engine.held.items():
                handle = KvHandle(
                    "prefill-local", "", request_id, ids, 4 * len(ids), layout.fingerprint()
                )
                got = await client.pull(handle)
                assert torch.equal(bits(got), bits(engine.expected(request_id)))
                got.zero_()  # a copy: the prefill side's cache is untouched
                assert torch.equal(bits(engine.cache), bits(pristine))
            assert client.stats().num_open_channels == 1
        finally:
            await client.close()
        assert client.stats().num_open_channels == 0

    asyncio.run(run())


def test_held_blocks_out_of_range_is_an_error_not_a_crash() -> None:
    cache = random_cache(TINY, 8)

    def read_blocks(request_id: str) -> CacheBlocks:
        return CacheBlocks(cache, [1, 99])

    async def run() -> None:
        async with prefill_server(TINY, read_blocks) as prefill:
            client = KvTransferClient(TINY, "decode-0")
            try:
                with pytest.raises(KvPullError, match="outside the cache"):
                    await client.pull(prefill.handle(TINY, "r", [1, 99]))
                assert client.stats().num_open_channels == 1
            finally:
                await client.close()

    asyncio.run(run())


@pytest.mark.parametrize("backend", ["tcp", "local"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pull_into_reserved_cache_blocks_writes_only_those(backend: str, dtype: str) -> None:
    layout = layout_of(dtype)
    engine = FakeEngine(random_cache(layout, 64), {"r": [5, 6, 7, 40, 2, 3, 63]})
    decode_cache = random_cache(layout, 50, seed=9)
    before = decode_cache.clone()
    reserved = [10, 11, 12, 0, 49, 30, 31]  # runs and singletons, in position order
    registry = LocalRegistry()
    registry.register("prefill-0", layout, engine.read_blocks)

    async def run() -> None:
        async with prefill_server(layout, engine.read_blocks) as prefill:
            client = KvTransferClient(layout, "decode-0", backend, local_registry=registry)
            try:
                handle = prefill.handle(layout, "r", engine.held["r"])
                got = await client.pull(handle, out=CacheBlocks(decode_cache, reserved))
                assert got is decode_cache
            finally:
                await client.close()

    asyncio.run(run())
    assert torch.equal(bits(decode_cache[:, :, reserved]), bits(engine.expected("r")))
    others = [b for b in range(50) if b not in reserved]
    assert torch.equal(bits(decode_cache[:, :, others]), bits(before[:, :, others]))


def test_block_iovecs_merge_runs_of_adjacent_blocks() -> None:
    layout = layout_of("float32")
    cache = random_cache(layout, 50)
    blocks = CacheBlocks(cache, [10, 11, 12, 0, 49, 30, 31])  # 4 runs
    iovecs = block_iovecs(blocks)
    assert len(iovecs) == 4 * 2 * layout.num_layers
    assert iovecs.nbytes == layout.block_nbytes(7)
    assert len(block_iovecs(CacheBlocks(cache, []))) == 0


def test_strided_source_cache_is_gathered_slab_by_slab() -> None:
    wide = random_cache(layout_of("float32", KvLayout("m", "float32", 4, 2, 2, 16)), 30)
    cache = wide[..., :8]  # [2, 2, 30, 4, 2, 8], not contiguous
    assert not cache.is_contiguous()
    engine = FakeEngine(cache, {"a": [3, 4, 5, 29], "b": list(range(30))[::-1], "c": [7]})

    async def run() -> None:
        async with prefill_server(TINY, engine.read_blocks) as prefill:
            client = KvTransferClient(TINY, "decode-0")
            try:
                for request_id in ("a", "b", "c", "a"):  # the staging buffer grows, is reused
                    handle = prefill.handle(TINY, request_id, engine.held[request_id])
                    assert torch.equal(await client.pull(handle), engine.expected(request_id))
            finally:
                await client.close()

    asyncio.run(run())


def test_kept_results_survive_later_pulls_on_recycled_memory() -> None:
    engine = FakeEngine(random_cache(TINY, 16), {"a": [1, 2, 3], "b": [4, 5, 6]})

    async def run() -> None:
        async with prefill_server(TINY, engine.read_blocks) as prefill:
            client = KvTransferClient(TINY, "decode-0")
            try:
                kept = await client.pull(prefill.handle(TINY, "a", [1, 2, 3]))
                kept_view = kept[1]
                for _ in range(4):  # dropped at once: their memory is recycled
                    await client.pull(prefill.handle(TINY, "b", [4, 5, 6]))
                assert torch.equal(kept, engine.expected("a"))
                del kept
                for _ in range(4):
                    await client.pull(prefill.handle(TINY, "b", [4, 5, 6]))
                assert torch.equal(kept_view, engine.expected("a")[1])
            finally:
                await client.close()

    asyncio.run(run())
