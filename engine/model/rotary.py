"""Rotary position embeddings (RoPE) as Hugging Face Llama computes them.

Default RoPE is computed here; scaled variants (`linear`, `llama3`, `yarn`, ...) take
their inverse frequencies from `transformers.modeling_rope_utils`, so they match the
reference implementation exactly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_POSITION_DEPENDENT = ("dynamic",)


def inverse_frequencies(
    head_dim: int, rope_parameters: dict[str, Any], hf_config: Any = None
) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32, attention_scaling) for a model's RoPE."""
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        base = float(rope_parameters["rope_theta"])
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (base**exponents), 1.0
    if rope_type in _POSITION_DEPENDENT:
        raise ValueError(f"rope_type {rope_type!r} depends on sequence length; not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or hf_config is None:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position."""

    # A registered buffer [2, max_len, 1, D] (it follows the module's `.to(device)`): cos,
    # then sin with its first half negated (`apply_rotary_` swaps halves instead of
    # negating one), computed in float32 and stored in the model's dtype (transformers
    # casts its float32 cos and sin to the activations' dtype: the same values). One
    # table, already cast, so that a step looks both up in one op: a step's torch calls
    # outside the model cost ~17-90 us each after the forward has streamed the weights
    # through the caches (5 us back to back), and the lookup took six, then two.
    cos_sin: torch.Tensor

    def __init__(
        self, inv_freq: torch.Tensor, scaling: float, max_len: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        positions = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin() * scaling
        sin[:, : inv_freq.shape[0]].neg_()
        cos_sin = torch.stack((emb.cos() * scaling, sin)).unsqueeze(2).to(dtype)
        self.register_buffer("cos_sin", cos_sin, persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) [T, 1, D] in the model's dtype for a step's positions;
        looked up once, used by every layer."""
        cos, sin = self.cos_sin.index_select(1, positions).unbind(0)
        return cos, sin


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x [T, heads, D] (queries and keys together) in place by the step's (cos,
    signed sin): x * cos + rotate_half(x) * sin as Hugging Face computes it, bit for bit
    (rotate_half(x) = [-x2, x1] times sin equals [x2, x1] times the signed sin)."""
    num_tokens, num_heads, head_dim = x.shape
    swapped = x.view(num_tokens, num_heads, 2, head_dim // 2).flip(2)
    swapped = swapped.view(num_tokens, num_heads, head_dim).mul_(sin)
    x.mul_(cos).add_(swapped)
