"""The packed matmul kernel (engine/cpu_ops/packed_linear.cpp) against float64 matmuls:
row counts from none to past its row tile and row block, sizes that leave a partial last
panel, a bias, strided rows; a row's result does not depend on its batch; bad input is a
clear error; the model's `Linear` packs its weight when the cpu kernels are turned on
(float32, and bfloat16 where the CPU has AMX or AVX512-BF16; a weight another module shares
only where it is a Llama model's tied `lm_head`, whose embedding lookups then read the
packed rows). The bfloat16 kernel's tests run on CPUs with either (AMX's GEMM where there
is AMX, else the op's VDPBF16PS kernel); elsewhere packing bfloat16 is refused. With AMX,
the MLP's gate/up product fused with SiLU-and-multiply gives the two ops' bits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from tandem.engine.config import EngineConfig
from tandem.engine.cpu_ops.loader import (
    cpu_ops_error,
    fuses_silu_and_mul,
    pack_linear_weight,
    packed_linear,
    packed_silu_and_mul,
    packs_bfloat16,
    silu_and_mul,
)
from tandem.engine.llm_engine import Engine
from tandem.engine.model.cpu_kernels import use_cpu_kernels
from tandem.engine.model.linear import Linear
from tests.helpers.kv_budget import with_test_kv


@pytest.fixture(scope="module", autouse=True)
def built_ops() -> None:
    error = cpu_ops_error()
    assert error is None, f"the cpu ops must build on CPU test machines: {error}"


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double()).float()


def packed_times(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return packed_linear(x, pack_linear_weight(w), w.shape[0], b)


@pytest.mark.parametrize("k, n", [(768, 1280), (100, 37), (16, 5), (2048, 9), (7, 1), (5, 97)])
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 6, 7, 8, 9, 16, 33, 300])
def test_matches_float64_matmul(rows: int, k: int, n: int) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k, generator=generator)
    w = torch.randn(n, k, generator=generator)
    out = packed_times(x, w)
    assert out.shape == (rows, n) and out.is_contiguous()
    torch.testing.assert_close(out, reference(x, w, None), rtol=1e-4, atol=1e-4 * k**0.5)


def test_packing_keeps_every_weight_and_pads_with_zeros() -> None:
    w = torch.randn(37, 10)
    packed = pack_linear_weight(w)
    panels, k, width = packed.shape
    assert k == 10 and width % 8 == 0 and panels == -(-37 // width)
    # packed[p, k, j] = w[p * width + j, k]; rows past w's last are zero.
    unpacked = packed.permute(0, 2, 1).reshape(panels * width, k)
    assert torch.equal(unpacked[:37], w) and not unpacked[37:].any()


def test_bias_and_strided_rows() -> None:
    generator = torch.Generator().manual_seed(0)
    wide = torch.randn(6, 300, generator=generator)
    x = wide[:, 20:120]  # rows 300 floats apart
    w = torch.randn(70, 100, generator=generator)
    bias = torch.randn(70, generator=generator)
    expected = reference(x, w, bias)
    torch.testing.assert_close(packed_times(x, w, bias), expected, rtol=1e-4, atol=1e-3)


def test_a_rows_result_does_not_depend_on_its_batch() -> None:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(40, 256, generator=generator)
    packed = pack_linear_weight(torch.randn(200, 256, generator=generator))
    whole = packed_linear(x, packed, 200, None)
    for rows in (1, 3, 8, 11):
        assert torch.equal(packed_linear(x[5 : 5 + rows], packed, 200, None), whole[5 : 5 + rows])


def test_bad_input_is_a_clear_error() -> None:
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    packed = pack_linear_weight(w)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 CPU weight"):
        pack_linear_weight(w.double())
    with pytest.raises(RuntimeError, match="float32 or bfloat16 CPU tensors of one dtype"):
        packed_linear(x.double(), packed, 3, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 CPU tensors of one dtype"):
        packed_linear(x.bfloat16(), packed, 3, None)
    with pytest.raises(RuntimeError, match="from pack_linear_weight with n rows"):
        packed_linear(x, w, 3, None)  # not packed
    with pytest.raises(RuntimeError, match="from pack_linear_weight with n rows"):
        packed_linear(x, packed, 300, None)  # more rows than it holds
    with pytest.raises(RuntimeError, match=r"x \[rows, k\] with k contiguous"):
        packed_linear(torch.randn(4, 9), packed, 3, None)
    with pytest.raises(RuntimeError, match=r"x \[rows, k\] with k contiguous"):
        packed_linear(torch.randn(8, 4).t(), packed, 3, None)
    with pytest.raises(RuntimeError, match=r"bias \[n\] float32"):
        packed_linear(x, packed, 3, torch.randn(4))
    with pytest.raises(RuntimeError, match=r"a contiguous residual \[rows, n\] of x's dtype"):
        packed_linear(x, packed, 3, None, torch.randn(4, 4))
    with pytest.raises(RuntimeError, match=r"a contiguous residual \[rows, n\] of x's dtype"):
        packed_linear(x, packed, 3, None, torch.randn(4, 3).double())


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 9, 300])
def test_a_residual_gives_the_bits_of_adding_it_after(rows: int, with_bias: bool) -> None:
    """The layer's residual add in the kernel: the same bits as `.add_(residual)` on its
    output (after the bias, where there is one), partial last panel included."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=generator)
    packed = pack_linear_weight(torch.randn(100, 64, generator=generator))
    bias = torch.randn(100, generator=generator) if with_bias else None
    residual = torch.randn(rows, 100, generator=generator)
    expected = packed_linear(x, packed, 100, bias).add_(residual)
    assert torch.equal(packed_linear(x, packed, 100, bias, residual), expected)


def test_linear_packs_its_weight_when_the_kernels_are_turned_on() -> None:
    layer = Linear(8, 3)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    assert layer.packed_weight is None
    assert use_cpu_kernels(torch.nn.Sequential(layer, torch.nn.ReLU())) == 1
    assert layer.packed_weight is not None and "weight" not in dict(layer.named_parameters())
    with torch.no_grad():
        for rows in (1, 4, 17):
            x = torch.randn(rows, 8)
            torch.testing.assert_close(layer(x), F.linear(x, weight, bias))
    # bfloat16 layers are packed where the CPU has AMX or AVX512-BF16, else keep F.linear.
    bf16 = Linear(8, 3).to(torch.bfloat16)
    assert use_cpu_kernels(bf16) == int(packs_bfloat16())
    assert (bf16.packed_weight is not None) == packs_bfloat16()
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        use_cpu_kernels(Linear(8, 3).to(torch.float16))


def test_a_shared_weight_stays_unpacked() -> None:
    embedding, head, other = torch.nn.Embedding(11, 8), Linear(8, 11, bias=False), Linear(8, 4)
    head.weight = embedding.weight  # tied, as a tie_word_embeddings lm_head
    assert use_cpu_kernels(torch.nn.ModuleList([embedding, head, other])) == 1
    assert head.packed_weight is None and head.weight is embedding.weight
    assert other.packed_weight is not None


def test_packed_rows_are_the_weights_rows() -> None:
    layer = Linear(8, 101, bias=False)
    weight = layer.weight.detach().clone()
    ids = torch.tensor([0, 47, 48, 100, 3, 3])
    with pytest.raises(ValueError, match="not packed"):
        layer.packed_rows(ids)
    layer.pack_weight()
    assert torch.equal(layer.packed_rows(ids), weight[ids])


def test_a_tied_llama_head_is_packed_and_embeds_from_its_panels(tiny_model_dir: Path) -> None:
    overrides = {"attention_backend": "cpu", "dtype": "float32"}
    config = EngineConfig(model=str(tiny_model_dir), max_model_len=256, **with_test_kv(overrides))
    model = Engine(config).runner.model
    assert model.config.tie_word_embeddings
    # One copy of the table, packed: no embedding module, no unpacked head weight.
    assert model.embed_tokens is None and model.lm_head.packed_weight is not None
    assert not any(name.startswith(("lm_head", "embed")) for name, _ in model.named_parameters())
    (checkpoint,) = tiny_model_dir.glob("*.safetensors")
    with safe_open(str(checkpoint), framework="pt") as f:
        table = f.get_tensor("model.embed_tokens.weight")
    ids = torch.tensor([0, 5, 47, 48, table.shape[0] - 1])
    assert torch.equal(model.embed(ids), table[ids])


packs_bf16_only = pytest.mark.skipif(
    not packs_bfloat16(), reason="packs bfloat16 on CPUs with AMX or AVX512-BF16 only"
)


def bf16_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The float64 product of the bfloat16 operands, rounded to bfloat16 as the kernel's is."""
    return reference(x.float(), w.float(), None if b is None else b.float()).bfloat16()


@pytest.mark.skipif(packs_bfloat16(), reason="CPUs without AMX or AVX512-BF16 only")
def test_bfloat16_packing_without_bf16_units_is_refused() -> None:
    with pytest.raises(RuntimeError, match="no bfloat16 GEMM kernel"):
        pack_linear_weight(torch.randn(3, 8).bfloat16())


@packs_bf16_only
@pytest.mark.parametrize("k, n", [(768, 1280), (100, 37), (32, 64), (2048, 9), (6, 65)])
@pytest.mark.parametrize("rows", [0, 1, 2, 15, 16, 17, 33, 255, 256, 300])
def test_bfloat16_matches_float64_matmul(rows: int, k: int, n: int) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k, generator=generator).bfloat16()
    w = torch.randn(n, k, generator=generator).bfloat16()
    out = packed_times(x, w)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16 and out.is_contiguous()
    # One bfloat16 rounding of the output (2^-8 relative) plus float32 sums' error.
    expected = bf16_reference(x, w, None).float()
    torch.testing.assert_close(out.float(), expected, rtol=8e-3, atol=1e-3 * k**0.5)


@packs_bf16_only
def test_bfloat16_packing_keeps_every_weight_and_pads_with_zeros() -> None:
    w = torch.randn(70, 10).bfloat16()
    packed = pack_linear_weight(w)
    panels, pairs, width, two = packed.shape
    assert (pairs, two) == (5, 2) and panels == -(-70 // width)
    # packed[p, k // 2, j, k % 2] = w[p * width + j, k]; rows past w's last are zero.
    unpacked = packed.permute(0, 2, 1, 3).reshape(panels * width, 10)
    assert torch.equal(unpacked[:70], w) and not unpacked[70:].any()
    with pytest.raises(RuntimeError, match="even k"):
        pack_linear_weight(torch.randn(4, 7).bfloat16())


@packs_bf16_only
def test_bfloat16_bias_strided_rows_and_batch_invariance() -> None:
    generator = torch.Generator().manual_seed(2)
    wide = torch.randn(300, 300, generator=generator).bfloat16()
    x = wide[:, 20:120]  # rows 300 elements apart
    w = torch.randn(70, 100, generator=generator).bfloat16()
    bias = torch.randn(70, generator=generator).bfloat16()
    packed = pack_linear_weight(w)
    whole = packed_linear(x, packed, 70, bias)
    expected = bf16_reference(x, w, bias).float()
    torch.testing.assert_close(whole.float(), expected, rtol=8e-3, atol=1e-2)
    for start, rows in ((0, 1), (5, 3), (17, 40), (255, 45)):
        part = packed_linear(x[start : start + rows], packed, 70, bias)
        assert torch.equal(part, whole[start : start + rows])


@packs_bf16_only
def test_bfloat16_linear_and_its_packed_rows() -> None:
    layer = Linear(8, 101, bias=False).to(torch.bfloat16)
    weight = layer.weight.detach().clone()
    layer.pack_weight()
    ids = torch.tensor([0, 63, 64, 100, 3, 3])
    assert torch.equal(layer.packed_rows(ids), weight[ids])
    x = torch.randn(5, 8).bfloat16()
    with torch.no_grad():
        torch.testing.assert_close(layer(x).float(), bf16_reference(x, weight, None).float())


@packs_bf16_only
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [1, 17, 300])
def test_bfloat16_residual_gives_the_bits_of_adding_it_after(rows: int, with_bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=generator).bfloat16()
    packed = pack_linear_weight(torch.randn(100, 64, generator=generator).bfloat16())
    bias = torch.randn(100, generator=generator).bfloat16() if with_bias else None
    residual = torch.randn(rows, 100, generator=generator).bfloat16()
    expected = packed_linear(x, packed, 100, bias).add_(residual)
    assert torch.equal(packed_linear(x, packed, 100, bias, residual), expected)


def fuses_here() -> bool:
    """Whether this CPU fuses the gate/up product with SiLU (bfloat16 with AMX)."""
    weight = torch.zeros(128, 2).bfloat16()
    return packs_bfloat16() and fuses_silu_and_mul(pack_linear_weight(weight), 64)


@pytest.mark.skipif(not fuses_here(), reason="fused on CPUs with AMX only")
@pytest.mark.parametrize("rows", [1, 7, 256, 300])
def test_the_fused_gate_up_and_silu_gives_the_bits_of_the_two_ops(rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=generator).bfloat16()
    packed = pack_linear_weight(torch.randn(2 * 192, 96, generator=generator).bfloat16())
    assert fuses_silu_and_mul(packed, 192)
    expected = silu_and_mul(packed_linear(x, packed, 2 * 192, None))
    assert torch.equal(packed_silu_and_mul(x, packed, 192), expected)


def test_the_fused_gate_up_and_silu_takes_only_its_weights() -> None:
    # float32, and an intermediate size that is not a whole number of 64-column panels.
    assert not fuses_silu_and_mul(pack_linear_weight(torch.randn(128, 16)), 64)
    if packs_bfloat16():
        assert not fuses_silu_and_mul(pack_linear_weight(torch.randn(2 * 96, 16).bfloat16()), 96)
    with pytest.raises(RuntimeError, match="packed_silu_and_mul"):
        packed_silu_and_mul(torch.randn(3, 16), pack_linear_weight(torch.randn(128, 16)), 64)
