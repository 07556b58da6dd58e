"""The fused CPU ops (engine/cpu_ops/elementwise.cpp, greedy_argmax.cpp, cache_kv) against torch:
RMSNorm and SiLU-and-multiply within float32 rounding of a float64 reference and, in
bfloat16, within one rounding of the torch modules; RoPE bit for bit with `apply_rotary_`
in both dtypes; the greedy argmax index for index with `max(dim=-1)` (ties,
NaN, -inf, strided rows); the K/V writes bit for bit with `index_copy_`; bad input is a
clear error; the model's modules use them only
once `use_cpu_kernels` turns them on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.engine.cpu_ops.loader import (
    cache_kv,
    cpu_ops_error,
    greedy_argmax,
    rms_norm,
    rotary_embedding_,
    silu_and_mul,
)
from tandem.engine.model.cpu_kernels import use_cpu_kernels
from tandem.engine.model.llama import RMSNorm
from tandem.engine.model.rotary import RotaryEmbedding, apply_rotary_, inverse_frequencies
from tandem.engine.sampler import Sampler
from tandem.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module", autouse=True)
def built_ops() -> None:
    error = cpu_ops_error()
    assert error is None, f"the cpu ops must build on CPU test machines: {error}"


@pytest.mark.parametrize(("rows", "size"), [(1, 768), (7, 100), (300, 256)])
def test_rms_norm_matches_float64(rows: int, size: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, size + 5, generator=gen)[:, :size]  # strided rows
    weight = torch.randn(size, generator=gen)
    x64 = x.double()
    expected = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), expected.float(), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize(("rows", "size"), [(1, 2048), (5, 37), (200, 640)])
def test_silu_and_mul_matches_float64(rows: int, size: int) -> None:
    gate_up = torch.randn(rows, 2 * size, generator=torch.Generator().manual_seed(size)) * 4
    gate, up = gate_up.double().chunk(2, dim=-1)
    torch.testing.assert_close(
        silu_and_mul(gate_up), (F.silu(gate) * up).float(), rtol=2e-6, atol=2e-6
    )


@pytest.mark.parametrize(("rows", "size"), [(1, 2048), (5, 37), (200, 640)])
def test_bfloat16_ops_round_where_the_torch_modules_round(rows: int, size: int) -> None:
    """In bfloat16 the fused ops give the torch ops' results (transformers' rounding points:
    after the norm, after SiLU, after the product) within one bfloat16 rounding."""
    gen = torch.Generator().manual_seed(size)
    x = torch.randn(rows, size, generator=gen).to(torch.bfloat16)
    norm = RMSNorm(size, 1e-6).to(torch.bfloat16)
    torch.nn.init.normal_(norm.weight, generator=gen)
    with torch.no_grad():
        fused, torch_ops = rms_norm(x, norm.weight, 1e-6), norm(x)
    torch.testing.assert_close(fused, torch_ops)
    # Away from rounding ties the bits agree (the sums of squares differ in order only).
    assert (fused == torch_ops).float().mean() > 0.99
    gate_up = (torch.randn(rows, 2 * size, generator=gen) * 4).to(torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    fused = silu_and_mul(gate_up)
    torch.testing.assert_close(fused, F.silu(gate).mul_(up))
    # Away from rounding ties the bits agree: one bfloat16 rounding of SiLU in float32.
    assert (fused == F.silu(gate).mul_(up)).float().mean() > 0.99


def test_silu_and_mul_over_the_whole_float_range() -> None:
    # The op's vector exp clamps its argument to [-87, 88]: past both ends, and at the
    # edges between, SiLU stays finite and within float32's rounding of the true value.
    edges = torch.tensor([-88.5, -87.0, 87.5, 88.5])
    gate = torch.cat([torch.linspace(-200.0, 200.0, 4001), edges])
    out = silu_and_mul(torch.cat([gate, torch.ones_like(gate)])[None])[0]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, F.silu(gate.double()).float(), rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "heads", "head_dim"), [(1, 20, 64), (3, 6, 128), (130, 5, 32)])
def test_rotary_is_apply_rotary_bit_for_bit(
    tokens: int, heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    inv_freq, scaling = inverse_frequencies(head_dim, {"rope_theta": 10000.0})
    rotary = RotaryEmbedding(inv_freq, scaling, 4096, dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(1))
    cos, sin = rotary.lookup(positions)
    # Rows wider than the rotated heads (values follow them, as in the fused QKV output).
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(tokens, (heads + 2) * head_dim, generator=gen).to(dtype)
    expected = qkv.clone()
    apply_rotary_(expected[:, : heads * head_dim].view(tokens, heads, head_dim), cos, sin)
    rotary_embedding_(qkv, cos, sin, heads, head_dim)
    assert torch.equal(qkv, expected)


def test_greedy_argmax_is_torch_max_index_for_index() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randint(-3, 3, (40, 32001), generator=gen).float()  # many ties
    logits[1] = float("-inf")
    logits[2, 17] = float("nan")
    logits[3, 5], logits[3, 900] = float("nan"), float("nan")
    logits[4] = 0.0
    logits[4, 31999] = -0.0
    logits[5, 32000] = 1e30  # in the row's tail past the vectors
    logits[6, 0] = float("inf")
    # Widths past and short of one pass's 64 lanes too.
    widths = (logits[:, :1000], logits[:, 7:], logits[:, :63], logits[:, :65])
    for rows in (logits, logits[:1], *widths):
        assert torch.equal(greedy_argmax(rows), rows.max(dim=-1).indices)
        # bfloat16 holds these values exactly, NaNs and infinities too.
        rows = rows.bfloat16()
        assert torch.equal(greedy_argmax(rows), rows.max(dim=-1).indices)


def test_greedy_argmax_of_bfloat16_logits_is_that_of_their_floats() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(33, 32000, generator=gen) * 8).bfloat16()  # ties after rounding
    expected = logits.float().max(dim=-1).indices
    assert torch.equal(greedy_argmax(logits), expected)
    params = [SamplingParams(temperature=0.0)] * 33
    for sampler in (Sampler(cpu_argmax=True), Sampler()):
        assert sampler.sample(logits, params, [None] * 33).token_ids == expected.tolist()


def test_sampler_takes_the_op_only_when_asked() -> None:
    logits = torch.randn(8, 500, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=0.0)] * 8
    expected = logits.argmax(dim=-1).tolist()
    assert Sampler(cpu_argmax=True).sample(logits, params, [None] * 8).token_ids == expected
    assert Sampler().sample(logits, params, [None] * 8).token_ids == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_kv_writes_what_index_copy_writes(dtype: torch.dtype) -> None:
    """Keys and values as the model hands them over (views into the fused qkv rows, so
    strided tokens) into scattered slots, the other slots untouched."""
    gen = torch.Generator().manual_seed(3)
    tokens, kv_heads, head_dim, num_blocks, block_size = 37, 2, 32, 9, 8
    qkv = torch.randn(tokens, (4 + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    key = qkv[:, 4 * head_dim : (4 + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    value = qkv[:, (4 + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    expected = cache.clone()
    expected[0].view(-1, kv_heads, head_dim).index_copy_(0, slots, key)
    expected[1].view(-1, kv_heads, head_dim).index_copy_(0, slots, value)
    cache_kv(key, value, cache, slots)
    assert torch.equal(cache, expected)


CACHE = torch.zeros(2, 3, 4, 2, 8)
KV = torch.ones(5, 2, 8)
ROPE = torch.ones(2, 1, 4)
BF16_ROWS = torch.ones(2, 4, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: rms_norm(torch.ones(2, 4), torch.ones(3), 1e-6), "4 elements"),
        (lambda: rms_norm(torch.ones(4, dtype=torch.float64), torch.ones(4), 1e-6), "2-d float32"),
        (lambda: rms_norm(torch.ones(4, 2).t(), torch.ones(4), 1e-6), "rows must be contiguous"),
        (lambda: silu_and_mul(torch.ones(2, 3)), "even number"),
        (lambda: rms_norm(BF16_ROWS, torch.ones(4), 1e-6), "weight must be BFloat16 like x"),
        (lambda: greedy_argmax(torch.ones(2, 3, dtype=torch.float16)), "float32 or bfloat16 CPU"),
        (lambda: rotary_embedding_(torch.ones(2, 8), ROPE, ROPE, 3, 4), "3 heads"),
        (lambda: rotary_embedding_(torch.ones(2, 8), ROPE[:1], ROPE, 2, 4), "cos and sin"),
        (lambda: cache_kv(KV, KV, CACHE, torch.tensor([0, 1, 2, 3, 12])), "slot 12 outside"),
        (lambda: cache_kv(KV, KV, CACHE, torch.tensor([0, 1, 2, 3, -1])), "slot -1 outside"),
        (lambda: cache_kv(KV, KV, CACHE, torch.arange(5, dtype=torch.int32)), "int64 slot_mapping"),
        (lambda: cache_kv(KV, KV[:4], CACHE, torch.arange(5)), "key and value"),
        (lambda: cache_kv(KV, KV.bfloat16(), CACHE, torch.arange(5)), "share a dtype"),
        (
            lambda: cache_kv(
                KV.transpose(1, 2).contiguous().transpose(1, 2), KV, CACHE, torch.arange(5)
            ),
            "heads must be contiguous",
        ),
    ],
)
def test_bad_input_is_a_clear_error(call, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        call()


def test_modules_use_the_kernels_once_turned_on(monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.engine.model import llama

    calls = []

    def counting(x, weight, eps):
        calls.append(x.shape)
        return rms_norm(x, weight, eps)

    monkeypatch.setattr(llama, "rms_norm", counting)
    norm = RMSNorm(64, 1e-5)
    x = torch.randn(3, 64)
    with torch.no_grad():
        torch_ops = norm(x)
        assert calls == []
        assert use_cpu_kernels(torch.nn.Sequential(norm)) == 1
        torch.testing.assert_close(norm(x), torch_ops, rtol=2e-6, atol=2e-6)
    assert calls == [x.shape]
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        use_cpu_kernels(RMSNorm(8, 1e-5).to(torch.float16))
