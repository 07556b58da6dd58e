"""Turns on the C++ CPU kernels (engine/cpu_ops) for a float32 or bfloat16 CPU model.

The `cpu` attention backend is Tandem's C++ CPU path (the `torch` backend stays the
pure-torch reference). With it, the model's modules call fused ops instead of chains of
torch ops: `RMSNorm` one pass per row instead of seven ops, `Attention` RoPE in one loop
instead of a flip, two multiplies and an add, `MLP` SiLU-and-multiply in one pass, and in
float32 (and bfloat16 on CPUs with AMX or AVX512-BF16) `Linear` the packed matmul (its
weight packed here, once); steps run the whole stack in one call (cpu_stack.py) where it
covers them, through the same functions, so either
path gives the same bits. In bfloat16 the fused ops round where the torch ops do.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from tandem.engine.cpu_ops.loader import packs_bfloat16
from tandem.engine.model.linear import Linear
from tandem.engine.model.llama import MLP, Attention, LlamaForCausalLM, RMSNorm

# The dtypes the fused ops take.
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def use_cpu_kernels(model: nn.Module) -> int:
    """Turns the kernels on for every module of a float32 or bfloat16 CPU model with
    contiguous weights of one dtype (call once the weights are loaded); returns how many
    modules they cover."""
    dtypes = {param.dtype for param in model.parameters()}
    for name, param in model.named_parameters():
        if param.device.type != "cpu" or param.dtype not in KERNEL_DTYPES or len(dtypes) > 1:
            raise ValueError(
                "the cpu kernels take CPU float32 or bfloat16 models of one dtype, not "
                f"{param.dtype} on {param.device} ({name})"
            )
        if not param.is_contiguous():
            raise ValueError(f"the cpu kernels need contiguous weights ({name} is not)")
    modules = [m for m in model.modules() if isinstance(m, (RMSNorm, Attention, MLP))]
    for module in modules:
        module.cpu_kernel = True
    packs = dtypes == {torch.float32} or (dtypes == {torch.bfloat16} and packs_bfloat16())
    packed = _pack_linear_weights(model) if packs else []
    return len(modules) + len(packed)


def _pack_linear_weights(model: nn.Module) -> list[Linear]:
    """Packs the weight of every `Linear` that owns its weight alone, and a Llama model's
    tied `lm_head` (its weight is the embedding table, which then reads the packed rows);
    any other shared weight stays as it is: its other user needs the rows unpacked."""
    if (
        isinstance(model, LlamaForCausalLM)
        and model.config.tie_word_embeddings
        and model.embed_tokens is not None
    ):
        model.pack_tied_head()
    users = Counter(id(param) for _, param in model.named_parameters(remove_duplicate=False))
    packed: list[Linear] = []
    for module in model.modules():
        if not isinstance(module, Linear):
            continue
        if module.packed_weight is None and users[id(module.weight)] == 1:
            module.pack_weight()
        if module.packed_weight is not None:
            packed.append(module)
    return packed
