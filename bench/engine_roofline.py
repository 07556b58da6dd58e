"""Roofline arithmetic for the engine benchmark: bytes and FLOPs of one model step.

Pure functions of the model's shape and the measured hardware numbers, so the
benchmark's floors can be checked in unit tests without timing anything. Embeddings
are a row lookup, not a matmul: they count toward neither bytes nor FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.config import ModelConfig


@dataclass(frozen=True)
class ModelShape:
    """The sizes that decide a Llama step's matmul FLOPs and memory traffic."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def from_model_config(cls, cfg: ModelConfig) -> ModelShape:
        return cls(
            num_layers=cfg.num_layers,
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            intermediate_size=cfg.intermediate_size,
            vocab_size=cfg.vocab_size,
        )

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one decoder layer's fused qkv, o, gate_up and down projections."""
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        qkv = self.hidden_size * (q_size + 2 * kv_size)
        o = q_size * self.hidden_size
        gate_up = self.hidden_size * 2 * self.intermediate_size
        down = self.intermediate_size * self.hidden_size
        return qkv + o + gate_up + down

    @property
    def lm_head_params(self) -> int:
        return self.hidden_size * self.vocab_size

    @property
    def matmul_params(self) -> int:
        """Every weight a step multiplies by: all layers plus the LM head (no embeddings)."""
        return self.num_layers * self.layer_matmul_params + self.lm_head_params

    @property
    def kv_elements_per_token(self) -> int:
        """K and V elements one token keeps in the cache, across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def matmul_flops(self, num_rows: int, num_logit_rows: int) -> float:
        """FLOPs of the weight matmuls for `num_rows` tokens, `num_logit_rows` of them to logits."""
        layers = 2.0 * self.num_layers * self.layer_matmul_params * num_rows
        return layers + 2.0 * self.lm_head_params * num_logit_rows

    def attention_flops(self, query_len: int, context_len: int, causal: bool) -> float:
        """QK^T plus PV FLOPs of one sequence over all layers.

        `context_len` tokens sit in the cache before the `query_len` new ones; a causal
        prefill from position 0 sees on average half of its own chunk.
        """
        if causal:
            num_pairs = query_len * context_len + query_len * (query_len + 1) / 2
        else:
            num_pairs = query_len * (context_len + query_len)
        return 4.0 * self.num_layers * self.num_heads * self.head_dim * num_pairs


@dataclass(frozen=True)
class Roofline:
    """Lower bound on one step's time: the slower of moving its bytes and doing its FLOPs."""

    num_bytes: float
    flops: float
    memory_s: float
    compute_s: float

    @property
    def time_s(self) -> float:
        return max(self.memory_s, self.compute_s)

    @property
    def bound(self) -> str:
        return "memory" if self.memory_s >= self.compute_s else "compute"


def roofline(num_bytes: float, flops: float, bandwidth: float, peak_flops: float) -> Roofline:
    """`bandwidth` in bytes/s, `peak_flops` in FLOP/s (both measured, both > 0)."""
    if bandwidth <= 0 or peak_flops <= 0:
        raise ValueError(f"bandwidth and peak must be > 0, got {bandwidth}, {peak_flops}")
    return Roofline(num_bytes, flops, num_bytes / bandwidth, flops / peak_flops)


def prefill_roofline(
    shape: ModelShape, num_tokens: int, elem_size: int, bandwidth: float, peak_flops: float
) -> Roofline:
    """One prompt of `num_tokens` from position 0; logits for its last token only."""
    kv = shape.kv_elements_per_token * num_tokens * elem_size
    num_bytes = shape.matmul_params * elem_size + kv
    flops = shape.matmul_flops(num_tokens, 1) + shape.attention_flops(num_tokens, 0, causal=True)
    return roofline(num_bytes, flops, bandwidth, peak_flops)


def decode_roofline(
    shape: ModelShape,
    batch_size: int,
    context_len: int,
    elem_size: int,
    bandwidth: float,
    peak_flops: float,
) -> Roofline:
    """One decode step of `batch_size` sequences, each attending to `context_len` cached tokens.

    Bytes are the weights (read once per step, whatever the batch) plus every
    sequence's cached K/V.
    """
    weights = shape.matmul_params * elem_size
    kv = batch_size * context_len * shape.kv_elements_per_token * elem_size
    flops = shape.matmul_flops(batch_size, batch_size)
    flops += batch_size * shape.attention_flops(1, context_len, causal=False)
    return roofline(weights + kv, flops, bandwidth, peak_flops)
