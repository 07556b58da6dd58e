"""The `cpu` backend (decodes through the paged decode op; float32 and bfloat16 prefill
chunks through the paged prefill op, float16 ones through SDPA) against attention written out per
sequence in float64: ragged decodes, block sizes 1 to 64, GQA ratios 1 to 8, head dims
16 to 128 (64 and 128 take the decode op's float32 fast path), long contexts, mixed
batches with prefix hits, prefill chunks past the prefill op's query block and key tile,
bfloat16 and float16 caches; and how the selector offers it. The op is built (or loaded
from the machine's cache) once per test session, by the first test that needs it."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.attention import (
    AttentionBackendName,
    cpu_paged_backend,
    resolve_attention_backend,
    selector,
)
from tandem.engine.attention.cpu_paged_backend import CpuPagedAttentionBackend
from tandem.engine.cpu_ops.loader import cpu_ops_error, paged_decode, paged_prefill
from tests.helpers.paged_batch import make_paged_batch, reference_attention

# (query lens, seq lens, q heads, kv heads, head dim, block size): decodes first.
CASES = {
    "decodes-ragged-gqa3-bs16": ([1] * 6, [150, 131, 140, 17, 16, 1], 12, 4, 64, 16),
    "decodes-long-gqa2-bs32": ([1, 1, 1], [3000, 1025, 2], 4, 2, 32, 32),
    "decodes-mqa-bs8": ([1, 1, 1, 1], [9, 400, 64, 390], 8, 1, 32, 8),
    "decodes-mha-bs64": ([1, 1], [31, 100], 2, 2, 64, 64),
    "decodes-hd128-gqa4-bs16": ([1, 1, 1], [200, 33, 1], 8, 2, 128, 16),
    "decodes-gqa8-bs1": ([1, 1, 1], [5, 1, 33], 16, 2, 16, 1),
    # Enough rows for whole-row tasks, but the first context is most of the batch's keys:
    # with several threads its KV heads are split over tasks.
    "decodes-long-among-short-gqa3-bs16": ([1] * 8, [1200, 40, 33, 17, 16, 9, 2, 1], 12, 4, 64, 16),
    # The vector path's keys 16 at a time (two runs per 32-key block, none in 8-key
    # blocks) and its query heads' value sums 4 (head dim 64) or 2 (128) at a time.
    "decodes-hd64-gqa5-bs32": ([1] * 4, [100, 33, 64, 17], 10, 2, 64, 32),
    "decodes-hd64-gqa8-bs16": ([1, 1], [300, 47], 16, 2, 64, 16),
    "decodes-hd128-gqa3-bs8": ([1, 1, 1], [50, 9, 130], 6, 2, 128, 8),
    "mixed-prefix-hits": ([1, 1, 37, 5, 16], [45, 3, 100, 21, 16], 4, 2, 64, 16),
    "prefill-only": ([20, 7], [20, 7], 6, 2, 32, 4),
    # 200 query tokens: 4 query blocks; a 1,300-token prefix: past the 512-key tile.
    "prefill-long-prefix-tiles": ([1, 200, 130], [900, 1500, 130], 8, 2, 64, 16),
    "prefill-mqa-hd128-bs8": ([70], [70], 4, 1, 128, 8),
    # Head dims of 3 and 5 vectors (value sums in slabs of 4), GQA 5, MHA.
    "prefill-hd80-gqa5-bs16": ([33], [90], 10, 2, 80, 16),
    "prefill-hd48-mha": ([1, 17], [40, 17], 3, 3, 48, 16),
    # bfloat16's GEMM walk (chunks that see over 128 keys) at head dims of 5 vectors and of
    # two 64-column panels, the last key tile partial.
    "prefill-hd80-long": ([150], [301], 10, 2, 80, 16),
    "prefill-mqa-hd128-long": ([1, 77], [20, 333], 4, 1, 128, 8),
    # Not a whole number of vectors: the chunk takes SDPA.
    "prefill-hd24-sdpa": ([9, 4], [9, 30], 2, 1, 24, 4),
}


@pytest.fixture(scope="module", autouse=True)
def built_op() -> None:
    error = cpu_ops_error()
    assert error is None, f"the cpu ops must build on CPU test machines: {error}"


def run_backend(case_id: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    case = make_paged_batch(*CASES[case_id])
    query, key, value = (t.to(dtype) for t in (case.query, case.key, case.value))
    cache = case.kv_cache.to(dtype)
    backend = CpuPagedAttentionBackend(case.query.shape[-1] ** -0.5)
    out = backend.forward(query, key, value, cache, backend.build_metadata(case.batch))
    slots = case.batch.slot_mapping
    heads, dim = case.key.shape[1:]
    assert torch.equal(cache[0].view(-1, heads, dim)[slots], key)
    assert torch.equal(cache[1].view(-1, heads, dim)[slots], value)
    case.query = query.float()
    return out, reference_attention(case, cache.float())


@pytest.mark.parametrize("case_id", CASES)
def test_backend_matches_attention_written_out(case_id: str) -> None:
    out, expected = run_backend(case_id, torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("dtype", "case_id"),
    [
        # bfloat16 with head dims 64 and 128 takes the vector path, float16 the generic one.
        (torch.bfloat16, "decodes-ragged-gqa3-bs16"),
        (torch.bfloat16, "decodes-long-among-short-gqa3-bs16"),
        (torch.bfloat16, "decodes-hd128-gqa4-bs16"),
        (torch.bfloat16, "decodes-hd64-gqa5-bs32"),
        (torch.bfloat16, "decodes-hd64-gqa8-bs16"),
        (torch.bfloat16, "decodes-hd128-gqa3-bs8"),
        # bfloat16 prefill chunks: the prefill op (bfloat16 GEMMs, short chunks without AMX
        # and CPUs without AVX512-BF16 the float32 walk).
        (torch.bfloat16, "prefill-only"),
        (torch.bfloat16, "prefill-long-prefix-tiles"),
        (torch.bfloat16, "prefill-mqa-hd128-bs8"),
        (torch.bfloat16, "prefill-hd80-gqa5-bs16"),
        (torch.bfloat16, "prefill-hd48-mha"),
        (torch.bfloat16, "prefill-hd80-long"),
        (torch.bfloat16, "prefill-mqa-hd128-long"),
        (torch.bfloat16, "mixed-prefix-hits"),
        (torch.float16, "decodes-ragged-gqa3-bs16"),
    ],
)
def test_half_precision_caches(dtype: torch.dtype, case_id: str) -> None:
    out, expected = run_backend(case_id, dtype)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_contexts_decode_does_not_depend_on_its_batch_or_threads(dtype: torch.dtype) -> None:
    # Contexts over 512 keys are split into partitions whose results are merged; the split
    # depends on the context's length only, so the row's output is the same bits alone, in
    # a batch, on one thread or several.
    gen = torch.Generator().manual_seed(11)
    lens = [1300, 600, 40, 7]
    block_size, kv_heads, group, head_dim = 16, 4, 3, 64
    widths = [-(-n // block_size) for n in lens]
    cache = torch.randn(2, sum(widths) + 1, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    blocks = (torch.randperm(sum(widths), generator=gen) + 1).tolist()
    tables = torch.zeros(len(lens), max(widths), dtype=torch.int32)
    for row, width in enumerate(widths):
        tables[row, :width] = torch.tensor(blocks[:width])
        blocks = blocks[width:]
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    query = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen).to(dtype)

    def decode(rows: slice) -> torch.Tensor:
        out = torch.empty_like(query[rows])
        paged_decode(query[rows], cache, tables[rows].contiguous(), seq_lens[rows].contiguous(),
                     head_dim**-0.5, out)  # fmt: skip
        return out

    threads = torch.get_num_threads()
    try:
        batch = decode(slice(0, 4))
        for num_threads in (1, 2, 3):
            torch.set_num_threads(num_threads)
            assert torch.equal(decode(slice(0, 4)), batch)
            assert torch.equal(decode(slice(0, 1)), batch[:1])
            assert torch.equal(decode(slice(1, 3)), batch[1:3])
    finally:
        torch.set_num_threads(threads)


def test_op_refuses_wrong_index_dtype() -> None:
    query = torch.randn(1, 2, 8)
    cache = torch.randn(2, 2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="int32"):
        paged_decode(query, cache, torch.zeros(1, 1, dtype=torch.int64),
                     torch.ones(1, dtype=torch.int32), 1.0, torch.empty_like(query))  # fmt: skip


@pytest.mark.parametrize("length", [0, 9])
def test_decode_op_refuses_lengths_its_block_table_does_not_cover(length: int) -> None:
    query = torch.randn(1, 2, 64)
    cache = torch.randn(2, 3, 4, 1, 64)  # block size 4: a 2-block table covers 8 positions
    table = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=f"seq_lens\\[0\\] = {length} is outside 1..8"):
        paged_decode(query, cache, table, torch.tensor([length], dtype=torch.int32), 1.0,
                     torch.empty_like(query))  # fmt: skip


@pytest.mark.parametrize(
    ("table", "cache_dtype", "head_dim", "message"),
    [
        (torch.zeros(2, dtype=torch.int32), torch.float32, 16, "int64 block table"),
        (torch.zeros(1, dtype=torch.int64), torch.float32, 16, "covering 6 positions"),
        (torch.zeros(2, dtype=torch.int64), torch.bfloat16, 16, "of one dtype"),
        (torch.zeros(2, dtype=torch.int64), torch.float16, 16, "float32 or bfloat16"),
        (torch.zeros(2, dtype=torch.int64), torch.float32, 8, "multiples of 16 only, got 8"),
    ],
)
def test_prefill_op_refuses_bad_input(table, cache_dtype, head_dim: int, message: str) -> None:
    query = torch.randn(3, 2, head_dim)
    cache = torch.randn(2, 2, 4, 1, head_dim).to(cache_dtype)
    with pytest.raises(RuntimeError, match=message):
        paged_prefill(query, cache, table, 3, 1.0, torch.empty_like(query))


def test_auto_picks_cpu_on_cpu_and_cpu_refuses_other_devices() -> None:
    assert resolve_attention_backend("auto", "cpu") is AttentionBackendName.CPU
    assert resolve_attention_backend("cpu", "cpu") is AttentionBackendName.CPU
    with pytest.raises(ValueError, match="device cpu only, not cuda"):
        resolve_attention_backend("cpu", "cuda")


def test_op_that_does_not_build_is_an_error_and_auto_says_so(monkeypatch, caplog) -> None:
    monkeypatch.setattr(selector, "cpu_ops_error", lambda: "RuntimeError: no g++")
    with pytest.raises(ValueError, match=r"cpu: its C\+\+ op does not build here .*no g\+\+"):
        resolve_attention_backend("cpu", "cpu")
    assert resolve_attention_backend("auto", "cpu") is AttentionBackendName.TORCH
    assert "no g++" in caplog.text
    monkeypatch.setattr(cpu_paged_backend, "cpu_ops_error", lambda: "RuntimeError: no g++")
    with pytest.raises(RuntimeError, match="op does not build here: RuntimeError: no g\\+\\+"):
        CpuPagedAttentionBackend(1.0)
