"""The model's fused float32 CPU ops equal the expressions transformers computes, bit for bit."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.model.llama import RMSNorm


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm.forward as transformers writes it."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("hidden_size", [64, 768, 896, 4096])
@pytest.mark.parametrize("num_tokens", [1, 7, 32, 129])
def test_rms_norm_float32_equals_transformers(hidden_size: int, num_tokens: int) -> None:
    generator = torch.Generator().manual_seed(hidden_size + num_tokens)
    norm = RMSNorm(hidden_size, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden_size, generator=generator))
    scale = torch.rand(num_tokens, 1, generator=generator) * 50
    x = torch.randn(num_tokens, hidden_size, generator=generator) * scale
    with torch.inference_mode():
        assert torch.equal(norm(x), hf_rms_norm(x, norm.weight, 1e-6))


def test_rms_norm_bfloat16_keeps_the_transformers_rounding() -> None:
    generator = torch.Generator().manual_seed(0)
    norm = RMSNorm(768, 1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(768, generator=generator))
    x = (torch.randn(9, 768, generator=generator) * 4).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(norm(x), hf_rms_norm(x, norm.weight, 1e-5))
