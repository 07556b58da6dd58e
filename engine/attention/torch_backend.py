"""The torch reference backend (CPU and CUDA): gathered blocks + `scaled_dot_product_attention`.

Decodes are batched into one SDPA call over their padded, gathered contexts; each
prefill chunk is one SDPA call (causal from position 0, or masked over its cached
prefix plus its own tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from tandem.engine.attention.backend import AttentionBackend
from tandem.engine.attention.metadata import AttentionMetadata, BatchLayout


@dataclass
class PrefillSpan:
    """One prefill chunk inside the flattened batch."""

    query_start: int
    query_len: int
    # Tokens already in the cache before this chunk (prefix hits + earlier chunks).
    context_len: int
    # Block ids covering `context_len + query_len` positions.
    block_table: torch.Tensor
    # [query_len, context_len + query_len] bool, True = may attend; None when causal
    # from position 0 (context_len == 0).
    mask: torch.Tensor | None

    @property
    def seq_len(self) -> int:
        return self.context_len + self.query_len


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    # [num_seqs, max_num_blocks] int64: block ids per sequence, padded with 0.
    block_tables: torch.Tensor
    # [num_decodes, 1, 1, max_decode_len] bool key mask, or None when num_decodes <= 1.
    decode_mask: torch.Tensor | None
    # Longest decode context (keys gathered per decode sequence).
    max_decode_len: int
    prefills: list[PrefillSpan]


class TorchAttentionBackend(AttentionBackend[TorchAttentionMetadata]):
    """Gathers each sequence's blocks and calls `scaled_dot_product_attention`."""

    name: ClassVar[str] = "torch"

    def __init__(self, scale: float) -> None:
        self.scale = scale
        # Reused K and V gather buffers of the decode path (one step at a time).
        self._buffers: list[torch.Tensor | None] = [None, None]

    def build_metadata(self, batch: BatchLayout) -> TorchAttentionMetadata:
        num_decodes = batch.num_decodes
        block_tables = batch.padded_block_tables()
        decode_lens = batch.seq_lens[:num_decodes]
        prefills = []
        for i in range(num_decodes, batch.num_seqs):
            num_blocks = -(-batch.seq_lens[i] // batch.block_size)
            span = _prefill_span(
                batch.query_start_loc[i],
                batch.seq_lens[i],
                batch.query_len(i),
                block_tables[i, :num_blocks].to(batch.device),
            )
            if span.mask is not None:
                span.mask = span.mask.to(batch.device)
            prefills.append(span)
        return TorchAttentionMetadata(
            slot_mapping=batch.slot_mapping,
            num_decodes=num_decodes,
            block_tables=block_tables.to(batch.device),
            decode_mask=_decode_mask(decode_lens, batch.device),
            max_decode_len=max(decode_lens, default=0),
            prefills=prefills,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: TorchAttentionMetadata,
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = query.shape
        num_kv_heads = key.shape[1]
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, value)
        out = torch.empty_like(query)
        num_decodes = meta.num_decodes
        if num_decodes:
            out[:num_decodes] = self._decode(query[:num_decodes], k_cache, v_cache, meta)
        for span in meta.prefills:
            end = span.query_start + span.query_len
            q = query[span.query_start : end].transpose(0, 1).unsqueeze(0)
            if span.mask is None:
                k = key[span.query_start : end]
                v = value[span.query_start : end]
            else:
                k = _gather(k_cache, span.block_table, span.seq_len)
                v = _gather(v_cache, span.block_table, span.seq_len)
            o = F.scaled_dot_product_attention(
                q,
                k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
                attn_mask=span.mask,
                is_causal=span.mask is None,
                scale=self.scale,
                enable_gqa=True,
            )
            out[span.query_start : end] = o[0].transpose(0, 1)
        return out.view(num_tokens, num_heads * head_dim)

    def _decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: TorchAttentionMetadata,
    ) -> torch.Tensor:
        """All one-token queries in one SDPA call over their padded, gathered contexts."""
        num_decodes = query.shape[0]
        length = meta.max_decode_len
        block_size, num_kv_heads, head_dim = k_cache.shape[1:]
        num_blocks = -(-length // block_size)
        index = meta.block_tables[:num_decodes, :num_blocks].reshape(-1)
        # Gathered into reused buffers: fresh multi-MB allocations cost page faults per layer.
        k = torch.index_select(k_cache, 0, index, out=self._scratch(0, k_cache, index.numel()))
        v = torch.index_select(v_cache, 0, index, out=self._scratch(1, v_cache, index.numel()))
        k = k.view(num_decodes, -1, num_kv_heads, head_dim)[:, :length]
        v = v.view(num_decodes, -1, num_kv_heads, head_dim)[:, :length]
        o = F.scaled_dot_product_attention(
            query.unsqueeze(2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=meta.decode_mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return o.squeeze(2)

    def _scratch(self, slot: int, cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """A [num_blocks, *block shape] buffer for gathered blocks, grown on demand."""
        shape = (num_blocks, *cache.shape[1:])
        buf = self._buffers[slot]
        if buf is None or buf.shape[0] < num_blocks or buf.dtype != cache.dtype:
            buf = torch.empty(shape, dtype=cache.dtype, device=cache.device)
            self._buffers[slot] = buf
        return buf[:num_blocks]


def _gather(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, Hkv, D] keys or values of one sequence, in position order."""
    return cache[block_table].flatten(0, 1)[:seq_len]


def _decode_mask(seq_lens: list[int], device: torch.device) -> torch.Tensor | None:
    """Key-padding mask for batched decodes; None when no padding is needed."""
    if len(seq_lens) <= 1 or min(seq_lens) == max(seq_lens):
        return None
    lens = torch.tensor(seq_lens)
    mask = torch.arange(max(seq_lens)) < lens[:, None]
    return mask[:, None, None, :].to(device)


def _prefill_span(
    query_start: int, seq_len: int, query_len: int, block_table: torch.Tensor
) -> PrefillSpan:
    context_len = seq_len - query_len
    mask = None
    if context_len:
        # Query i sits at absolute position context_len + i and sees keys 0..that position.
        rows = torch.arange(query_len)[:, None] + context_len
        mask = torch.arange(seq_len)[None, :] <= rows
    return PrefillSpan(query_start, query_len, context_len, block_table, mask)
