"""The Triton backend: paged attention that reads block tables and lengths directly.

Per layer: one kernel writes the step's K/V into their cache slots; one launch covers
all decodes (split-K over the context when it is long, then a reduction kernel); one
launch covers all prefill chunks (each chunk's queries over its cached prefix and its
own tokens, causally). No gather, no padding to the longest sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import triton

from tandem.engine.attention import triton_kernels as kernels
from tandem.engine.attention.backend import AttentionBackend
from tandem.engine.attention.metadata import AttentionMetadata, BatchLayout

# Keys per inner-loop tile, and query tokens per prefill program.
TILE_N = 64
BLOCK_Q = 16
# A decode's context is split when longer than this (tokens), into at most MAX_SPLITS.
SPLIT_TOKENS = 512
MAX_SPLITS = 16
# tl.dot wants at least 16 rows: a decode's GQA group is padded up to it.
MIN_DOT_ROWS = 16


@dataclass
class TritonAttentionMetadata(AttentionMetadata):
    # [num_seqs + 1] int32 on the device.
    query_start_loc: torch.Tensor
    # [num_seqs] int32 on the device.
    seq_lens: torch.Tensor
    # [num_seqs, max_num_blocks] int32 on the device, padded with 0.
    block_tables: torch.Tensor
    num_prefills: int
    # Longest prefill chunk (sizes the prefill grid).
    max_prefill_query_len: int
    # Context splits per decode and tokens per split (a multiple of the tile).
    num_splits: int
    split_len: int


class TritonAttentionBackend(AttentionBackend[TritonAttentionMetadata]):
    name: ClassVar[str] = "triton"

    def __init__(
        self, scale: float, split_tokens: int = SPLIT_TOKENS, max_splits: int = MAX_SPLITS
    ) -> None:
        self.scale = scale
        self.split_tokens = split_tokens
        self.max_splits = max_splits

    def build_metadata(self, batch: BatchLayout) -> TritonAttentionMetadata:
        num_decodes = batch.num_decodes
        device = batch.device
        max_decode_len = max(batch.seq_lens[:num_decodes], default=0)
        num_splits = max(1, min(self.max_splits, -(-max_decode_len // self.split_tokens)))
        per_split = -(-max_decode_len // num_splits)
        split_len = max(TILE_N, -(-per_split // TILE_N) * TILE_N)
        prefill_lens = [batch.query_len(i) for i in range(num_decodes, batch.num_seqs)]
        return TritonAttentionMetadata(
            slot_mapping=batch.slot_mapping,
            num_decodes=num_decodes,
            query_start_loc=torch.tensor(batch.query_start_loc, dtype=torch.int32).to(device),
            seq_lens=torch.tensor(batch.seq_lens, dtype=torch.int32).to(device),
            block_tables=batch.padded_block_tables(torch.int32).to(device),
            num_prefills=len(prefill_lens),
            max_prefill_query_len=max(prefill_lens, default=0),
            num_splits=num_splits,
            split_len=split_len,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: TritonAttentionMetadata,
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = query.shape
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
        if meta.num_decodes:
            self._decode(query, k_cache, v_cache, meta, out)
        if meta.num_prefills:
            self._prefill(query, k_cache, v_cache, meta, out)
        return out.view(num_tokens, num_heads * head_dim)

    def _decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: TritonAttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        num_decodes, splits = meta.num_decodes, meta.num_splits
        _, num_heads, head_dim = query.shape
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        if splits > 1:
            part_acc = torch.empty(
                num_decodes, num_heads, splits, head_dim, dtype=torch.float32, device=out.device
            )
            part_ml = torch.empty(
                num_decodes, num_heads, splits, 2, dtype=torch.float32, device=out.device
            )
        else:  # unused: the kernel writes `out` directly
            part_acc = part_ml = out
        d_pad = triton.next_power_of_2(head_dim)
        kernels.decode_kernel[(num_decodes, num_kv_heads, splits)](
            query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
            out, part_acc, part_ml,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            *k_cache.stride()[:3], meta.block_tables.stride(0),
            k_cache.shape[1], meta.split_len, self.scale * kernels.LOG2E,
            GROUP=group, G_PAD=max(MIN_DOT_ROWS, triton.next_power_of_2(group)),
            HEAD_DIM=head_dim, D_PAD=d_pad, TILE_N=TILE_N, NUM_SPLITS=splits,
        )  # fmt: skip
        if splits > 1:
            kernels.reduce_splits_kernel[(num_decodes, num_heads)](
                out, part_acc, part_ml, out.stride(0), out.stride(1),
                HEAD_DIM=head_dim, D_PAD=d_pad,
                NUM_SPLITS=splits, S_PAD=triton.next_power_of_2(splits),
            )  # fmt: skip

    def _prefill(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: TritonAttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        _, num_heads, head_dim = query.shape
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        first = meta.num_decodes
        grid = (meta.num_prefills, num_kv_heads, triton.cdiv(meta.max_prefill_query_len, BLOCK_Q))
        kernels.prefill_kernel[grid](
            query, k_cache, v_cache, meta.block_tables[first:], meta.seq_lens[first:],
            meta.query_start_loc[first:], out,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            *k_cache.stride()[:3], meta.block_tables.stride(0),
            k_cache.shape[1], self.scale * kernels.LOG2E,
            GROUP=group, G_PAD=triton.next_power_of_2(group),
            HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim),
            BLOCK_Q=BLOCK_Q, TILE_N=TILE_N,
        )  # fmt: skip


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value [T, Hkv, D] into k/v_cache [blocks, block_size, Hkv, D] at `slot_mapping`."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if key.stride(2) != 1 or value.stride(2) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("write_kv needs unit-stride head dims and alike K/V caches")
    if num_tokens == 0:
        return
    kernels.write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *k_cache.stride()[:3],
        k_cache.shape[1], num_kv_heads,
        HEAD_DIM=head_dim, H_PAD=triton.next_power_of_2(num_kv_heads),
        D_PAD=triton.next_power_of_2(head_dim),
    )  # fmt: skip
