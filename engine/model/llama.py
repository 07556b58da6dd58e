"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a flattened, paged batch.

Q/K/V and gate/up projections are fused into one matmul each (fewer, larger GEMMs);
the loader concatenates the checkpoint's separate weights. Numerics follow Hugging
Face's implementation (RMSNorm in float32, RoPE tables in float32) so greedy output
matches `transformers` token for token. Elementwise work runs in place where the values
stay the same (RoPE into the fused QKV output, residual adds, SiLU-and-multiply): on CPU a
decode step's cost beyond its matmuls is mostly the number of ops and fresh buffers. On
CPU in float32 or bfloat16 with the `cpu` backend, RMSNorm, RoPE and SiLU-and-multiply
(and in float32, or bfloat16 on CPUs with AMX or AVX512-BF16, the matmuls, over weights
packed at load)
run as C++ ops instead (engine/model/cpu_kernels.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.attention import AttentionBackend, AttentionMetadata
from tandem.engine.config import ModelConfig
from tandem.engine.cpu_ops.loader import rms_norm, rotary_embedding_, silu_and_mul
from tandem.engine.model.cpu_stack import CpuDecoderStack
from tandem.engine.model.linear import Linear
from tandem.engine.model.rotary import RotaryEmbedding, apply_rotary_


class RMSNorm(nn.Module):
    # The fused C++ op instead of the torch ops (CPU float32/bfloat16; on by `use_cpu_kernels`).
    cpu_kernel = False

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        # The CPU path's divisor and eps as float32 0-dim tensors on the host (plain
        # attributes: `.to()` neither moves nor casts them). A Python number costs each
        # op a conversion to a tensor: four more dispatches, a copy among them.
        self._cpu_size = torch.tensor(float(hidden_size), device="cpu")
        self._cpu_eps = torch.tensor(eps, dtype=torch.float32, device="cpu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernel:
            return rms_norm(x, self.weight, self.eps)
        h = x if x.dtype == torch.float32 else x.float()
        if h.device.type == "cpu":
            # mean(-1) as torch computes it (a sum, then a division), the same bits.
            variance = h.pow(2).sum(-1, keepdim=True).div_(self._cpu_size)
            variance = variance.add_(self._cpu_eps)
        else:
            variance = h.pow(2).mean(-1, keepdim=True).add_(self.eps)
        h = h * variance.rsqrt_()
        # weight * h as transformers writes it (the product commutes exactly).
        return (h if x.dtype == torch.float32 else h.to(x.dtype)).mul_(self.weight)


class Attention(nn.Module):
    # RoPE by the C++ op instead of the torch ops (CPU float32/bfloat16; on by `use_cpu_kernels`).
    cpu_kernel = False

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend[Any]):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=False)
        self.backend = backend

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The attention sublayer's output (plus `residual`, added by the output projection)."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q_size, kv_size, _ = self.split_sizes
        # Queries and keys are adjacent in the fused output: rotate them in one pass, in place.
        qk = qkv[:, : q_size + kv_size].view(num_tokens, -1, self.head_dim)
        if self.cpu_kernel:
            rotary_embedding_(qkv, *rope, self.num_heads + self.num_kv_heads, self.head_dim)
        else:
            apply_rotary_(qk, *rope)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = qkv[:, q_size + kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.backend.forward(q, k, v, kv_cache, meta), residual)


class MLP(nn.Module):
    # SiLU-and-multiply by the C++ op (CPU float32/bfloat16; on by `use_cpu_kernels`).
    cpu_kernel = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP's output (plus `residual`, added by the down projection)."""
        if self.cpu_kernel:
            return self.down_proj(silu_and_mul(self.gate_up_proj(x)), residual)
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up), residual)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend[Any]):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # residual + sublayer as transformers adds them (the sublayer's output rounded, then
        # the sum), by each sublayer's last projection: the packed kernel adds it as it
        # writes its output.
        hidden = self.self_attn(rope, self.input_layernorm(hidden), kv_cache, meta, hidden)
        return self.mlp(self.post_attention_layernorm(hidden), hidden)


class LlamaForCausalLM(nn.Module):
    """`forward` returns final hidden states; `compute_logits` projects selected rows."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend[Any]):
        super().__init__()
        self.config = cfg
        # Uninitialized (the checkpoint's weights are copied in): nn.Embedding's own init
        # draws normal_, whose first call on the meta device the loader builds on imports
        # torch's Python decompositions (~2 s of a worker's start).
        # None once a tied lm_head holds the table alone (`pack_tied_head`).
        self.embed_tokens: nn.Embedding | None = nn.Embedding.from_pretrained(
            torch.empty(cfg.vocab_size, cfg.hidden_size), freeze=True
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = rotary
        # Shared by every layer; the model runner asks it for each step's metadata.
        self.attention_backend = backend
        # What `forward` computes, in one C++ call (cpu_stack.py), where the loader turns it
        # on; the model runner calls it for the steps it covers.
        self.cpu_stack: CpuDecoderStack | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids/positions [T]; kv_caches [layers, 2, blocks, block_size, Hkv, D]."""
        hidden = self.embed(input_ids)
        rope = self.rotary.lookup(positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(rope, hidden, kv_cache, meta)
        return self.norm(hidden)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of input_ids: from the table, or from a tied head's panels
        once `pack_tied_head` packed it."""
        if self.embed_tokens is None:
            return self.lm_head.packed_rows(input_ids)
        # The module's forward without the module call, which a decode step pays with cold
        # caches (the lookup 89-106 -> 78-85 us in a batch-1 step, AMD EPYC).
        return torch.embedding(self.embed_tokens.weight, input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def pack_tied_head(self) -> None:
        """Packs a tied lm_head for the packed kernel (CPU, cpu_kernels.py). Its
        weight is the embedding table: lookups then read the packed rows, and the unpacked
        table is dropped, so packing adds no memory."""
        if not self.config.tie_word_embeddings or self.embed_tokens is None:
            raise ValueError("pack_tied_head: the model's lm_head is not tied, or already packed")
        self.embed_tokens = None
        self.lm_head.pack_weight()
