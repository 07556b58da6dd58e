"""The model's lean CPU ops give the bits transformers computes."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.model.llama import RMSNorm
from tandem.engine.model.rotary import RotaryEmbedding, inverse_frequencies


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm.forward as transformers writes it."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden_size", [64, 768, 896, 4096])
@pytest.mark.parametrize("num_tokens", [1, 7, 129])
def test_rms_norm_equals_transformers(
    dtype: torch.dtype, hidden_size: int, num_tokens: int
) -> None:
    generator = torch.Generator().manual_seed(hidden_size + num_tokens)
    eps = 1e-5 if hidden_size == 768 else 1e-6
    norm = RMSNorm(hidden_size, eps).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden_size, generator=generator))
    scale = torch.rand(num_tokens, 1, generator=generator) * 50
    x = (torch.randn(num_tokens, hidden_size, generator=generator) * scale).to(dtype)
    with torch.inference_mode():
        assert torch.equal(norm(x), hf_rms_norm(x, norm.weight, eps))


def test_rms_norm_built_on_the_meta_device_runs_on_the_host() -> None:
    with torch.device("meta"):
        norm = RMSNorm(64, 1e-6)
    norm.to_empty(device="cpu")
    with torch.no_grad():
        norm.weight.fill_(1.5)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        assert torch.equal(norm(x), hf_rms_norm(x, norm.weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_lookup_equals_transformers(dtype: torch.dtype) -> None:
    """The table is stored in the model's dtype; its rows are transformers' float32 cos and
    sin cast to the activations' dtype (sin signed: its first half negated)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=256, num_attention_heads=4, max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    head_dim = config.hidden_size // config.num_attention_heads
    inv_freq, scaling = inverse_frequencies(head_dim, config.rope_parameters, config)
    rotary = RotaryEmbedding(inv_freq, scaling, config.max_position_embeddings, dtype)
    positions = torch.tensor([0, 1, 7, 130, 1000, 2047])
    cos, sin = rotary.lookup(positions)
    x = torch.zeros(1, len(positions), head_dim, dtype=dtype)
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(x, positions.unsqueeze(0))
    half = head_dim // 2
    assert cos.dtype == sin.dtype == dtype and cos.shape == (len(positions), 1, head_dim)
    assert torch.equal(cos[:, 0], hf_cos[0])
    assert torch.equal(sin[:, 0, half:], hf_sin[0, :, half:])
    assert torch.equal(sin[:, 0, :half], -hf_sin[0, :, :half])
