"""The Triton kernels against the torch reference backend, on CPU through Triton's
interpreter (in a child process started with TRITON_INTERPRET=1): K/V writes by slot
mapping, split-K decode and chunked prefill over cached prefix blocks, for ragged
batches, several block sizes, GQA ratios and head dims, prefix hits, long contexts."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from tandem.engine.attention.torch_backend import TorchAttentionBackend
from tests.helpers.paged_batch import PagedBatch, make_paged_batch
from tests.helpers.triton_interpreter import interpreter_process

pytestmark = pytest.mark.timeout(300)
CALL_TIMEOUT_S = 120.0

# (query lens, seq lens, q heads, kv heads, head dim, block size): decodes first.
CASES = {
    "decodes-gqa2-bs16": ([1, 1, 1, 1], [1, 17, 70, 33], 4, 2, 64, 16),
    "decodes-mqa8-bs8": ([1, 1, 1], [9, 40, 64], 8, 1, 32, 8),
    "decodes-mha-bs32": ([1, 1], [31, 100], 2, 2, 64, 32),
    "prefill-fresh-gqa3-bs4": ([20, 7], [20, 7], 6, 2, 32, 4),
    # Prefix hits / earlier chunks: contexts of 63, 16 and 0 tokens before the chunk.
    "mixed-prefix-hits-bs16": ([1, 1, 37, 5, 16], [45, 3, 100, 21, 16], 4, 2, 64, 16),
    "mixed-headdim48-bs2": ([1, 19], [12, 30], 4, 1, 48, 2),
    # A 40-token chunk over 1,200 cached tokens (a long prefix hit), next to a decode.
    "long-prefix-chunk-bs32": ([1, 40], [900, 1240], 8, 2, 64, 32),
    # 1,500 tokens in splits of 256: the short decode leaves most splits empty.
    "long-decodes-split-k": ([1, 1, 1], [1500, 40, 700], 4, 2, 64, 16),
}
SPLIT_TOKENS = 256


@pytest.fixture(scope="module")
def interpreter() -> Iterator[ProcessPoolExecutor]:
    with interpreter_process() as pool:
        yield pool


def on_device(case: PagedBatch, device: str, dtype: torch.dtype) -> PagedBatch:
    for name in ("query", "key", "value", "kv_cache"):
        setattr(case, name, getattr(case, name).to(device, dtype))
    case.batch.slot_mapping = case.batch.slot_mapping.to(device)
    case.batch.device = torch.device(device)
    return case


def triton_forward(case: PagedBatch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """In the interpreter process: the Triton output, the cache after it, the splits."""
    from tandem.engine.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend(case.query.shape[-1] ** -0.5, split_tokens=SPLIT_TOKENS)
    cache = case.kv_cache.clone()
    meta = backend.build_metadata(case.batch)
    out = backend.forward(case.query, case.key, case.value, cache, meta)
    return out, cache, meta.num_splits


def torch_forward(case: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    backend = TorchAttentionBackend(case.query.shape[-1] ** -0.5)
    cache = case.kv_cache.clone()
    meta = backend.build_metadata(case.batch)
    return backend.forward(case.query, case.key, case.value, cache, meta), cache


@pytest.mark.parametrize("case_id", CASES)
def test_kernels_match_torch_reference(interpreter, case_id: str) -> None:
    query_lens, seq_lens, heads, kv_heads, head_dim, block_size = CASES[case_id]
    case = make_paged_batch(query_lens, seq_lens, heads, kv_heads, head_dim, block_size)
    out, cache, num_splits = interpreter.submit(triton_forward, case).result(CALL_TIMEOUT_S)
    ref, ref_cache = torch_forward(case)
    # The write kernel puts every new K/V row where index_copy_ does, and nowhere else.
    assert torch.equal(cache, ref_cache)
    assert not torch.equal(cache, case.kv_cache)
    num_decodes = case.batch.num_decodes
    max_decode_len = max(seq_lens[:num_decodes], default=0)
    assert num_splits == max(1, -(-max_decode_len // SPLIT_TOKENS))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-5)


def test_float16_matches_torch_reference(interpreter) -> None:
    """Half-precision K/V and queries (float32 accumulation); the interpreter's bfloat16
    `tl.dot` is wrong on CPU (a Triton limitation), so float16 stands in for it here."""
    case = make_paged_batch([1, 1, 24], [40, 600, 70], 4, 2, 64, 16, seed=4)
    on_device(case, "cpu", torch.float16)
    out, cache, num_splits = interpreter.submit(triton_forward, case).result(CALL_TIMEOUT_S)
    ref, ref_cache = torch_forward(case)
    assert num_splits == 3 and out.dtype == torch.float16
    assert torch.equal(cache, ref_cache)
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)


def test_attention_reads_the_cached_prefix(interpreter) -> None:
    """Changing one cached prefix key changes the chunk's output."""
    case = make_paged_batch([8], [40], 2, 1, 32, 16, seed=3)
    first, _, _ = interpreter.submit(triton_forward, case).result(CALL_TIMEOUT_S)
    case.kv_cache[0, case.batch.block_tables[0][0], 0] += 5.0  # position 0's key
    second, _, _ = interpreter.submit(triton_forward, case).result(CALL_TIMEOUT_S)
    assert not torch.allclose(first, second)
    torch.testing.assert_close(second, torch_forward(case)[0], rtol=1e-5, atol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case_id", CASES)
def test_compiled_kernels_match_torch_reference_on_cuda(case_id: str, dtype) -> None:
    """The same cases compiled for a GPU (this process imported triton uninterpreted)."""
    query_lens, seq_lens, heads, kv_heads, head_dim, block_size = CASES[case_id]
    case = make_paged_batch(query_lens, seq_lens, heads, kv_heads, head_dim, block_size)
    case = on_device(case, "cuda", dtype)
    out, cache, _ = triton_forward(case)
    ref, ref_cache = torch_forward(case)
    assert torch.equal(cache, ref_cache)
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, rtol=tolerance, atol=tolerance)
