"""The small-batch matmul kernel (engine/cpu_ops/small_batch_linear.cpp) against float64
matmuls: every row count up to past the row tile, sizes that leave vector and output
tails, a bias, strided rows; bad input is a clear error; the model's `Linear` uses it
only where it is turned on and only for SMALL_BATCH_MIN_ROWS..SMALL_BATCH_MAX_ROWS rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.engine.cpu_ops.loader import cpu_ops_error, small_batch_linear
from tandem.engine.model import linear as linear_module
from tandem.engine.model.cpu_kernels import use_cpu_kernels
from tandem.engine.model.linear import SMALL_BATCH_MAX_ROWS, SMALL_BATCH_MIN_ROWS, Linear


@pytest.fixture(scope="module", autouse=True)
def built_ops() -> None:
    error = cpu_ops_error()
    assert error is None, f"the cpu ops must build on CPU test machines: {error}"


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double()).float()


@pytest.mark.parametrize("k, n", [(768, 1280), (100, 37), (16, 5), (2048, 9), (7, 1)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16, 33])
def test_matches_float64_matmul(rows: int, k: int, n: int) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k, generator=generator)
    w = torch.randn(n, k, generator=generator)
    out = small_batch_linear(x, w, None)
    assert out.shape == (rows, n) and out.is_contiguous()
    torch.testing.assert_close(out, reference(x, w, None), rtol=1e-4, atol=1e-4 * k**0.5)


def test_bias_and_strided_rows() -> None:
    generator = torch.Generator().manual_seed(0)
    wide = torch.randn(6, 300, generator=generator)
    x = wide[:, 20:120]  # rows 300 floats apart
    w = torch.randn(70, 100, generator=generator)
    bias = torch.randn(70, generator=generator)
    torch.testing.assert_close(
        small_batch_linear(x, w, bias), reference(x, w, bias), rtol=1e-4, atol=1e-3
    )


def test_bad_input_is_a_clear_error() -> None:
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="float32 only"):
        small_batch_linear(x.double(), w.double(), None)
    with pytest.raises(RuntimeError, match=r"x \[rows, k\] and weight \[n, k\]"):
        small_batch_linear(x, torch.randn(3, 9), None)
    with pytest.raises(RuntimeError, match="k must be contiguous"):
        small_batch_linear(x.t(), torch.randn(3, 4), None)
    with pytest.raises(RuntimeError, match=r"bias \[n\] float32"):
        small_batch_linear(x, w, torch.randn(4))


def test_linear_uses_the_kernel_only_when_on_and_for_few_rows(monkeypatch) -> None:
    layer = Linear(8, 3)
    calls: list[int] = []

    def counting(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return small_batch_linear(x, w, b)

    monkeypatch.setattr(linear_module, "small_batch_linear", counting)
    bounds = (1, SMALL_BATCH_MIN_ROWS - 1, SMALL_BATCH_MIN_ROWS, SMALL_BATCH_MAX_ROWS,
              SMALL_BATCH_MAX_ROWS + 1)  # fmt: skip
    for rows in bounds:
        layer(torch.randn(rows, 8))
    assert calls == []
    assert use_cpu_kernels(torch.nn.Sequential(layer, torch.nn.ReLU())) == 1
    with torch.no_grad():
        for rows in bounds:
            x = torch.randn(rows, 8)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    assert calls == [SMALL_BATCH_MIN_ROWS, SMALL_BATCH_MAX_ROWS]
    # The kernel is float32 only: a bfloat16 model's layers keep F.linear.
    bf16 = Linear(8, 3).to(torch.bfloat16)
    assert use_cpu_kernels(bf16) == 0 and not bf16.cpu_kernel
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        use_cpu_kernels(Linear(8, 3).to(torch.float16))
