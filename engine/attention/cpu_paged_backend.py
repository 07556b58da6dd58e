"""The CPU backend: attention reads the paged cache in place through C++ ops.

Per layer, one call of `torch.ops.tandem_cpu.paged_decode` (engine/cpu_ops) covers all
decodes: each (sequence, KV head) task walks its block table, scoring the KV head's query
heads against each key and summing values, over exactly its own length; no per-layer
gather into a padded buffer, no mask. Float32, bfloat16 and float16 caches; sums in
float32. Each float32 or bfloat16 prefill chunk (head dims a multiple of 16) is one call
of `paged_prefill`: causal over its cached prefix and its own tokens with an online
softmax (no mask tensor), by register-blocked float32 score and value kernels (bfloat16
K/V made floats as they are copied into tiles), or in bfloat16 on CPUs with AMX or
AVX512-BF16 by bfloat16 GEMMs (oneDNN's AMX kernels, or the op's dot-product tiles);
other chunks are the torch backend's (SDPA). The K/V writes are `cache_kv`'s row copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from tandem.engine.attention.metadata import BatchLayout
from tandem.engine.attention.torch_backend import (
    PrefillSpan,
    TorchAttentionBackend,
    TorchAttentionMetadata,
    prefill_spans,
)
from tandem.engine.cpu_ops.loader import (
    PREFILL_HEAD_DIM_MULTIPLE,
    cache_kv,
    cpu_ops_error,
    paged_decode,
    paged_prefill,
)

# The cache dtypes whose prefill chunks `paged_prefill` attends.
PREFILL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class CpuPagedAttentionMetadata(TorchAttentionMetadata):
    # [num_decodes, max_num_blocks] int32, padded with block 0 (never read past a length).
    decode_block_tables: torch.Tensor
    # [num_decodes] int32: context length of each decode, this step's token included.
    decode_seq_lens: torch.Tensor


class CpuPagedAttentionBackend(TorchAttentionBackend):
    """Decodes, and float32 and bfloat16 prefill chunks, through the paged C++ ops."""

    name: ClassVar[str] = "cpu"
    loads_cpu_ops: ClassVar[bool] = True

    def __init__(self, scale: float) -> None:
        super().__init__(scale)
        # Loads the op (building it first where this machine has no cached build).
        error = cpu_ops_error()
        if error is not None:
            raise RuntimeError(f"the cpu attention backend's op does not build here: {error}")

    def build_metadata(self, batch: BatchLayout) -> CpuPagedAttentionMetadata:
        num_decodes = batch.num_decodes
        # The decode rows' int32 table, built as the op takes it.
        return CpuPagedAttentionMetadata(
            slot_mapping=batch.slot_mapping,
            num_decodes=num_decodes,
            # The torch backend's gather plan for decodes: the op needs none.
            decode_groups=[],
            prefills=prefill_spans(batch),
            decode_block_tables=batch.padded_block_tables(torch.int32, num_rows=num_decodes),
            decode_seq_lens=torch.tensor(batch.seq_lens[:num_decodes], dtype=torch.int32),
        )

    def forward(  # type: ignore[override]
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: CpuPagedAttentionMetadata,
    ) -> torch.Tensor:
        # Writes K/V and attends the prefill chunks; decode rows are left to the op.
        out = super().forward(query, key, value, kv_cache, meta)
        num_decodes = meta.num_decodes
        if num_decodes:
            rows = out.view(query.shape)[:num_decodes]
            paged_decode(
                query[:num_decodes],
                kv_cache,
                meta.decode_block_tables,
                meta.decode_seq_lens,
                self.scale,
                rows,
            )
        return out

    def _write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        cache_kv(key, value, kv_cache, slots)

    def attends_in_place(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether prefill chunks of this cache dtype and head dim go through
        `paged_prefill` (the others through the torch backend's SDPA)."""
        return dtype in PREFILL_DTYPES and head_dim % PREFILL_HEAD_DIM_MULTIPLE == 0

    def _prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        span: PrefillSpan,
        out: torch.Tensor,
    ) -> None:
        if not self.attends_in_place(kv_cache.dtype, query.shape[-1]):
            super()._prefill(query, key, value, kv_cache, span, out)
            return
        rows = slice(span.query_start, span.query_start + span.query_len)
        paged_prefill(
            query[rows], kv_cache, span.block_table, span.context_len, self.scale, out[rows]
        )
