"""Random paged-attention batches for backend tests: ragged sequences, shuffled blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.attention import BatchLayout


@dataclass
class PagedBatch:
    batch: BatchLayout
    query: torch.Tensor  # [T, Hq, D]
    key: torch.Tensor  # [T, Hkv, D]
    value: torch.Tensor  # [T, Hkv, D]
    kv_cache: torch.Tensor  # [2, blocks, block_size, Hkv, D]: random, holding the contexts


def make_paged_batch(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    seed: int = 0,
) -> PagedBatch:
    """Sequence i has seq_lens[i] - query_lens[i] cached tokens (random K/V in the cache)
    and query_lens[i] new ones; one-token queries must come first (the engine's order).
    Blocks are drawn in shuffled order from a pool with spare blocks, block 0 unused."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(counts) + 4
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, starts, slots = [], [0], []
    for count, q_len, s_len in zip(counts, query_lens, seq_lens, strict=True):
        table, order = order[:count], order[count:]
        tables.append(table)
        starts.append(starts[-1] + q_len)
        new_positions = range(s_len - q_len, s_len)
        slots += [table[p // block_size] * block_size + p % block_size for p in new_positions]
    num_tokens = starts[-1]
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    batch = BatchLayout(
        query_start_loc=starts,
        seq_lens=list(seq_lens),
        block_tables=tables,
        slots=slots,
        # Decodes: the leading one-token sequences (as the model runner orders them).
        num_decodes=next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens)),
        block_size=block_size,
        device=torch.device("cpu"),
    )
    # Views of one fused tensor, strided like the model's q/k/v (a fused projection).
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    query, key, value = qkv.split((num_heads, num_kv_heads, num_kv_heads), dim=1)
    return PagedBatch(batch, query, key, value, torch.randn(shape, generator=gen))


def reference_attention(case: PagedBatch, cache: torch.Tensor) -> torch.Tensor:
    """Each sequence's queries over its keys in position order, causal, in float64."""
    batch = case.batch
    num_heads, head_dim = case.query.shape[1:]
    group = num_heads // case.key.shape[1]
    out = torch.empty(case.query.shape, dtype=torch.float64)
    for i, table in enumerate(batch.block_tables):
        start, end = batch.query_start_loc[i], batch.query_start_loc[i + 1]
        seq_len = batch.seq_lens[i]
        k, v = (cache[j][table].flatten(0, 1)[:seq_len].double() for j in (0, 1))
        k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
        q = case.query[start:end].double().transpose(0, 1)
        scores = q @ k.transpose(1, 2) * head_dim**-0.5
        positions = torch.arange(seq_len - (end - start), seq_len)
        scores[:, torch.arange(seq_len)[None, :] > positions[:, None]] = float("-inf")
        out[start:end] = (scores.softmax(-1) @ v).transpose(0, 1)
    return out.view(out.shape[0], -1)
