"""Triton kernels over the paged KV cache: K/V write, split-K decode, chunked prefill.

Imported only by the Triton backend, after the start-up checks: `triton.jit` picks the
compiled or the interpreted (`TRITON_INTERPRET=1`, CPU tensors) form at import time.

Cache of one layer: k/v [num_blocks, block_size, kv_heads, head_dim]. Keys are found
token by token through the block table (`position // block_size`), so any power-of-two
block size works with any tile size. GQA: a program computes every query head of one
KV head at once (rows = query tokens x the group), so each K/V tile is loaded once per
group. Softmax is online (running max and sum, base 2) and accumulates in float32.

One attention kernel serves decodes (one query token per program, context split-K)
and prefill chunks (BLOCK_Q query tokens per program, causal, one split).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    num_tokens, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_co, stride_ch,
    block_size, num_kv_heads,
    HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """Grid (token blocks,): BLOCK_T tokens' K and V rows (all KV heads) go to their slots."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = tokens < num_tokens
    slot = tl.load(slot_ptr + tokens, mask=t_mask, other=0).to(tl.int64)
    # A negative slot is a padding row (CUDA graphs' padded batches): nothing to write.
    t_mask = t_mask & (slot >= 0)
    heads = tl.arange(0, H_PAD)
    dims = tl.arange(0, D_PAD)
    hd_mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < HEAD_DIM)
    mask = t_mask[:, None, None] & hd_mask[None, :, :]
    k_offsets = tokens[:, None, None] * stride_kt + (heads[:, None] * stride_kh)[None, :, :]
    k = tl.load(key_ptr + k_offsets + dims[None, None, :], mask=mask)
    v_offsets = tokens[:, None, None] * stride_vt + (heads[:, None] * stride_vh)[None, :, :]
    v = tl.load(value_ptr + v_offsets + dims[None, None, :], mask=mask)
    row = (slot // block_size) * stride_cb + (slot % block_size) * stride_co
    dest = row[:, None, None] + (heads[:, None] * stride_ch + dims[None, :])[None, :, :]
    tl.store(k_cache_ptr + dest, k, mask=mask)
    tl.store(v_cache_ptr + dest, v, mask=mask)


@triton.jit
def attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, seq_lens_ptr, query_start_ptr,
    out_ptr, part_acc_ptr, part_ml_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_co, stride_ch, stride_bt,
    block_size, split_len, qk_scale,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """Grid (seqs, kv_heads, query tiles x splits): BLOCK_Q query tokens x the GQA group
    over one split of their causally visible keys.

    A sequence's queries sit at positions context_len .. seq_len - 1; its keys (cached
    prefix blocks and the step's own tokens, already written) are read from the cache.
    With one split the normalised output goes to `out`; otherwise the unnormalised
    accumulator, running max and sum go to part_acc [tokens, q_heads, splits, D] and
    part_ml [tokens, q_heads, splits, 2] for `reduce_splits_kernel`. Query tiles past a
    sequence's length do nothing.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len
    rows = tl.arange(0, BLOCK_Q * G_PAD)
    token = q_tile * BLOCK_Q + rows // G_PAD
    g = rows % G_PAD
    heads = kv_head * GROUP + g
    dims = tl.arange(0, D_PAD)
    dim_mask = dims[None, :] < HEAD_DIM
    row_mask = ((token < q_len) & (g < GROUP))[:, None]
    q_offsets = (q_start + token)[:, None] * stride_qt + heads[:, None] * stride_qh
    q = tl.load(q_ptr + q_offsets + dims[None, :], mask=row_mask & dim_mask, other=0.0)
    q_pos = context_len + token
    # Keys past the tile's last query are never seen; an empty tile reads none.
    kv_end = tl.minimum(context_len + (q_tile + 1) * BLOCK_Q, seq_len)
    kv_end = tl.where(q_tile * BLOCK_Q < q_len, kv_end, 0)
    start = split * split_len
    end = tl.minimum(start + split_len, kv_end)
    table_ptr += seq * stride_bt
    m_i = tl.full([BLOCK_Q * G_PAD], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_Q * G_PAD], 0.0, tl.float32)
    acc = tl.full([BLOCK_Q * G_PAD, D_PAD], 0.0, tl.float32)
    for tile_start in range(start, end, TILE_N):
        pos = tile_start + tl.arange(0, TILE_N)
        valid = pos < end
        # int64: block * block stride overflows int32 in caches past 2**31 elements.
        block = tl.load(table_ptr + pos // block_size, mask=valid, other=0).to(tl.int64)
        kv_row = block * stride_cb + (pos % block_size) * stride_co + kv_head * stride_ch
        kv_mask = valid[:, None] & dim_mask
        k = tl.load(k_cache_ptr + kv_row[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_row[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows that see no key in this tile keep m_new = -inf: guard the exponents.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    mask = row_mask & dim_mask
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_offsets = (q_start + token)[:, None] * stride_ot + heads[:, None] * stride_oh
        tl.store(out_ptr + o_offsets + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        num_heads = tl.num_programs(1) * GROUP
        part = ((q_start + token) * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=mask)
        row_valid = (token < q_len) & (g < GROUP)
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_valid)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_valid)


@triton.jit
def reduce_splits_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr,
):  # fmt: skip
    """Grid (tokens, q_heads): combine the splits' partial softmax results."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, S_PAD)
    dims = tl.arange(0, D_PAD)
    s_mask = splits < NUM_SPLITS
    part = (token * tl.num_programs(1) + head) * NUM_SPLITS + splits
    m = tl.load(part_ml_ptr + part * 2, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=s_mask, other=0.0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :],
        mask=s_mask[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )
    m_max = tl.max(m, 0)
    # Splits past a sequence's end hold m = -inf and contribute nothing.
    weight = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(l_s * weight, 0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )
