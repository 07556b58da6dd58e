"""The Triton backend: paged attention that reads block tables and lengths directly.

Per layer: one kernel writes the step's K/V into their cache slots; one attention
launch covers all decodes (split-K over the context when it is long, then a reduction
kernel); one covers all prefill chunks (each chunk's queries over its cached prefix
and its own tokens, causally). No gather, no padding to the longest sequence.
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
# The split length of an unsplit launch (longer than any context).
UNSPLIT_LEN = 1 << 30
# Elements (tokens x kv_heads x head_dim) one K/V-write program moves.
WRITE_ELEMENTS = 4096


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
        num_splits, split_len = self.split_plan(max(batch.seq_lens[:num_decodes], default=0))
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

    def split_plan(self, max_decode_len: int) -> tuple[int, int]:
        """(context splits per decode, tokens per split: a multiple of the tile) for
        decodes of up to `max_decode_len` tokens (CUDA graphs fix it per graph)."""
        num_splits = max(1, min(self.max_splits, -(-max_decode_len // self.split_tokens)))
        per_split = -(-max_decode_len // num_splits)
        return num_splits, max(TILE_N, -(-per_split // TILE_N) * TILE_N)

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
        """All decodes in one launch: one query token per program, the context split-K."""
        num_decodes, splits = meta.num_decodes, meta.num_splits
        _, num_heads, head_dim = query.shape
        part_acc = part_ml = out  # unused with one split: the kernel writes `out`
        if splits > 1:
            shape = (num_decodes, num_heads, splits)
            part_acc = torch.empty(*shape, head_dim, dtype=torch.float32, device=out.device)
            part_ml = torch.empty(*shape, 2, dtype=torch.float32, device=out.device)
        group = num_heads // k_cache.shape[2]
        self._launch(
            (num_decodes, k_cache.shape[2], splits),
            query, k_cache, v_cache, meta, 0, out, part_acc, part_ml,
            meta.split_len, splits, block_q=1,
            g_pad=max(MIN_DOT_ROWS, triton.next_power_of_2(group)),
        )  # fmt: skip
        if splits > 1:
            kernels.reduce_splits_kernel[(num_decodes, num_heads)](
                out, part_acc, part_ml, out.stride(0), out.stride(1),
                HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim),
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
        """All prefill chunks in one launch: BLOCK_Q query tokens per program, causal."""
        group = query.shape[1] // k_cache.shape[2]
        q_tiles = triton.cdiv(meta.max_prefill_query_len, BLOCK_Q)
        self._launch(
            (meta.num_prefills, k_cache.shape[2], q_tiles),
            query, k_cache, v_cache, meta, meta.num_decodes, out, out, out,
            UNSPLIT_LEN, 1, block_q=BLOCK_Q,
            g_pad=triton.next_power_of_2(group),
        )  # fmt: skip

    def _launch(
        self,
        grid: tuple[int, int, int],
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: TritonAttentionMetadata,
        first: int,
        out: torch.Tensor,
        part_acc: torch.Tensor,
        part_ml: torch.Tensor,
        split_len: int,
        splits: int,
        block_q: int,
        g_pad: int,
    ) -> None:
        """`attention_kernel` over the sequences from index `first` on."""
        num_heads, head_dim = query.shape[1:]
        kernels.attention_kernel[grid](
            query, k_cache, v_cache, meta.block_tables[first:], meta.seq_lens[first:],
            meta.query_start_loc[first:], out, part_acc, part_ml,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            *k_cache.stride()[:3], meta.block_tables.stride(0),
            k_cache.shape[1], split_len, self.scale * kernels.LOG2E,
            GROUP=num_heads // k_cache.shape[2], G_PAD=g_pad,
            HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim),
            BLOCK_Q=block_q, TILE_N=TILE_N, NUM_SPLITS=splits,
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
    h_pad = triton.next_power_of_2(num_kv_heads)
    d_pad = triton.next_power_of_2(head_dim)
    block_t = max(1, WRITE_ELEMENTS // (h_pad * d_pad))
    kernels.write_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        key, value, k_cache, v_cache, slot_mapping,
        num_tokens, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *k_cache.stride()[:3],
        k_cache.shape[1], num_kv_heads,
        HEAD_DIM=head_dim, H_PAD=h_pad, D_PAD=d_pad, BLOCK_T=block_t,
    )  # fmt: skip
