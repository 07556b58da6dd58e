"""Turns on the C++ CPU kernels (engine/cpu_ops) for a float32 or bfloat16 CPU model.

The `cpu` attention backend is Tandem's C++ CPU path (the `torch` backend stays the
pure-torch reference). With it, the model's modules call fused ops instead of chains of
torch ops: `RMSNorm` one pass per row instead of seven ops, `Attention` RoPE in one loop
instead of a flip, two multiplies and an add, `MLP` SiLU-and-multiply in one pass, and in
float32 `Linear` the small-batch matmul for a few rows; decode-only steps run the whole
stack in one call (cpu_decode.py), through the same functions, so either path gives the
same bits. In bfloat16 the fused ops round where the torch ops do.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.engine.model.linear import Linear
from tandem.engine.model.llama import MLP, Attention, RMSNorm

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
    with_linear = dtypes == {torch.float32}  # the small-batch matmul is float32 only
    modules = [
        m
        for m in model.modules()
        if isinstance(m, (RMSNorm, Attention, MLP)) or (with_linear and isinstance(m, Linear))
    ]
    for module in modules:
        module.cpu_kernel = True
    return len(modules)
