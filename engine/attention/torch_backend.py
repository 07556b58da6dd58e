"""The torch reference backend (CPU and CUDA): gathered blocks + `scaled_dot_product_attention`.

Decodes: the metadata builder splits them, once per step, into groups of similar context
length (runs of rows whose lengths lie within a quarter of each other, or a few blocks),
each with its flat block index and key mask. Per layer and group, one `index_select`
gathers K and V together into a reused buffer, padded only to the group's longest context,
and one SDPA call covers the group with the query heads of each KV head as the query rows
(GQA without repeating K/V). Each prefill chunk is one SDPA call (causal from position 0,
or masked over its cached prefix plus its own tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

from tandem.engine.attention.backend import AttentionBackend
from tandem.engine.attention.metadata import AttentionMetadata, BatchLayout

# A decode group keeps a sequence whose context is within this many tokens of the group's
# longest, or within a quarter of it (so padding wastes at most ~25% of a group's keys).
GROUP_SLACK_TOKENS = 64


@dataclass
class PrefillSpan:
    """One prefill chunk inside the flattened batch."""

    query_start: int
    query_len: int
    # Tokens already in the cache before this chunk (prefix hits + earlier chunks).
    context_len: int
    # Block ids covering `context_len + query_len` positions.
    block_table: torch.Tensor
    # causal_mask()'s, once built (only the SDPA path over a cached prefix asks for it).
    _mask: torch.Tensor | None = field(default=None, repr=False)

    @property
    def seq_len(self) -> int:
        return self.context_len + self.query_len

    def causal_mask(self) -> torch.Tensor:
        """[query_len, seq_len] bool, True where query i (at position context_len + i) may
        attend key j: built on first use, on the block table's device, once per step."""
        if self._mask is None:
            device = self.block_table.device
            positions = torch.arange(self.query_len, device=device)[:, None] + self.context_len
            self._mask = torch.arange(self.seq_len, device=device)[None, :] <= positions
        return self._mask


@dataclass
class DecodeGroup:
    """Decode rows `start:end`, attended together over contexts padded to `max_len`."""

    start: int
    end: int
    max_len: int
    # Blocks per row (enough for `max_len` positions).
    num_blocks: int
    # [(end - start) * num_blocks] int64: each row's first `num_blocks` block ids (block 0
    # pads rows that hold fewer; those keys are masked).
    block_index: torch.Tensor
    # [end - start, 1, 1, max_len] bool key mask, or None when every row has `max_len`.
    mask: torch.Tensor | None


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSpan]


class TorchAttentionBackend(AttentionBackend[TorchAttentionMetadata]):
    """Gathers each sequence's blocks and calls `scaled_dot_product_attention`."""

    name: ClassVar[str] = "torch"

    def __init__(self, scale: float) -> None:
        self.scale = scale
        # Reused gather buffer of the decode path: fresh multi-MB allocations cost page
        # faults per layer.
        self._buffer: torch.Tensor | None = None

    def build_metadata(self, batch: BatchLayout) -> TorchAttentionMetadata:
        num_decodes = batch.num_decodes
        block_tables = batch.padded_block_tables().to(batch.device)
        groups = [
            _decode_group(start, end, batch, block_tables)
            for start, end in group_decodes(batch.seq_lens[:num_decodes])
        ]
        return TorchAttentionMetadata(
            slot_mapping=batch.slot_mapping,
            num_decodes=num_decodes,
            decode_groups=groups,
            prefills=prefill_spans(batch),
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
        self._write_kv(key, value, kv_cache, meta.slot_mapping)
        out = torch.empty_like(query)
        for group in meta.decode_groups:
            self._decode(query, kv_cache, group, out)
        for span in meta.prefills:
            self._prefill(query, key, value, kv_cache, span, out)
        return out.view(num_tokens, num_heads * head_dim)

    def _write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Each token's K/V [tokens, kv_heads, head_dim] into its cache slot."""
        num_kv_heads, head_dim = key.shape[1:]
        kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key)
        kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value)

    def _prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        span: PrefillSpan,
        out: torch.Tensor,
    ) -> None:
        """One prefill chunk in one SDPA call: causal over its own K/V from position 0,
        else masked over its gathered cached prefix plus its own tokens."""
        end = span.query_start + span.query_len
        q = query[span.query_start : end].transpose(0, 1).unsqueeze(0)
        from_start = span.context_len == 0
        if from_start:
            k = key[span.query_start : end]
            v = value[span.query_start : end]
        else:
            kv = _gather(kv_cache, span.block_table)[:, : span.seq_len]
            k, v = kv[0], kv[1]
        o = F.scaled_dot_product_attention(
            q,
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=None if from_start else span.causal_mask(),
            is_causal=from_start,
            scale=self.scale,
            enable_gqa=True,
        )
        out[span.query_start : end] = o[0].transpose(0, 1)

    def _decode(
        self, query: torch.Tensor, kv_cache: torch.Tensor, group: DecodeGroup, out: torch.Tensor
    ) -> None:
        """One group's one-token queries in one SDPA call over their gathered contexts."""
        head_dim = query.shape[2]
        num_kv_heads = kv_cache.shape[3]
        num_rows = group.end - group.start
        # Gathered into a reused buffer: fresh multi-MB allocations cost page faults per layer.
        kv = _gather(kv_cache, group.block_index, self._scratch(kv_cache, group.block_index))
        kv = kv.view(2, num_rows, -1, num_kv_heads, head_dim)[:, :, : group.max_len]
        # [rows, kv_heads, group, D]: each KV head's query heads attend as its query rows.
        q = query[group.start : group.end].view(num_rows, num_kv_heads, -1, head_dim)
        o = F.scaled_dot_product_attention(
            q,
            kv[0].transpose(1, 2),
            kv[1].transpose(1, 2),
            attn_mask=group.mask,
            scale=self.scale,
        )
        out[group.start : group.end].view(q.shape).copy_(o)

    def _scratch(self, kv_cache: torch.Tensor, block_index: torch.Tensor) -> torch.Tensor:
        """A [2, len(block_index), block elements] buffer, grown on demand."""
        block_numel = kv_cache[0, 0].numel()
        numel = 2 * block_index.numel() * block_numel
        buf = self._buffer
        if buf is None or buf.numel() < numel or buf.dtype != kv_cache.dtype:
            buf = torch.empty(numel, dtype=kv_cache.dtype, device=kv_cache.device)
            self._buffer = buf
        return buf[:numel].view(2, -1, block_numel)


def prefill_spans(batch: BatchLayout) -> list[PrefillSpan]:
    """One span per prefill chunk of `batch` (none for a decode-only step), each with its
    own int64 block table on the batch's device."""
    spans = []
    for i in range(batch.num_decodes, batch.num_seqs):
        seq_len, query_len = batch.seq_lens[i], batch.query_len(i)
        num_blocks = -(-seq_len // batch.block_size)
        table = torch.tensor(batch.block_tables[i][:num_blocks], dtype=torch.int64,
                             device=batch.device)  # fmt: skip
        spans.append(PrefillSpan(batch.query_start_loc[i], query_len, seq_len - query_len, table))
    return spans


def group_decodes(seq_lens: list[int]) -> list[tuple[int, int]]:
    """Row ranges [start, end) of consecutive decodes attended together: a row joins the
    current group while the group's lengths stay within `GROUP_SLACK_TOKENS` or a quarter
    of its longest. The model runner orders decodes longest first, so groups are few."""
    if not seq_lens:
        return []
    groups: list[tuple[int, int]] = []
    start, low, high = 0, seq_lens[0], seq_lens[0]
    for i in range(1, len(seq_lens)):
        seq_len = seq_lens[i]
        new_low, new_high = min(low, seq_len), max(high, seq_len)
        spread = new_high - new_low
        if spread > GROUP_SLACK_TOKENS and 4 * spread > new_high:
            groups.append((start, i))
            start, new_low, new_high = i, seq_len, seq_len
        low, high = new_low, new_high
    groups.append((start, len(seq_lens)))
    return groups


def _decode_group(
    start: int, end: int, batch: BatchLayout, block_tables: torch.Tensor
) -> DecodeGroup:
    lens = batch.seq_lens[start:end]
    max_len = max(lens)
    num_blocks = -(-max_len // batch.block_size)
    mask = None
    if min(lens) != max_len:
        keep = torch.arange(max_len) < torch.tensor(lens)[:, None]
        mask = keep[:, None, None, :].to(batch.device)
    block_index = block_tables[start:end, :num_blocks].reshape(-1)
    return DecodeGroup(start, end, max_len, num_blocks, block_index, mask)


def _gather(
    kv_cache: torch.Tensor, block_index: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """K and V of `block_index`'s blocks in one gather: [2, len(block_index) * block_size,
    kv_heads, head_dim], in position order."""
    blocks = kv_cache.view(2, kv_cache.shape[1], -1)
    if out is None:
        gathered = blocks.index_select(1, block_index)
    else:
        gathered = torch.index_select(blocks, 1, block_index, out=out)
    return gathered.view(2, -1, *kv_cache.shape[3:])
