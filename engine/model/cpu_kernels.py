"""Turns on the C++ CPU kernels (engine/cpu_ops) for a float32 CPU model.

The `cpu` attention backend is Tandem's C++ CPU path (the `torch` backend stays the
pure-torch reference). With it, in float32, the model's modules call fused ops instead of
chains of torch ops: `Linear` the small-batch matmul for a few rows, `RMSNorm` one pass per
row instead of seven ops, `Attention` RoPE in one loop instead of a flip, two multiplies and
an add, `MLP` SiLU-and-multiply in one pass; and decode-only steps run the whole stack in
one call (cpu_decode.py), through the same functions, so either path gives the same bits.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.engine.model.linear import Linear
from tandem.engine.model.llama import MLP, Attention, RMSNorm

_KERNEL_MODULES = (Linear, RMSNorm, Attention, MLP)


def use_cpu_kernels(model: nn.Module) -> int:
    """Turns the kernels on for every module of a float32 CPU model with contiguous weights
    (call once the weights are loaded); returns how many modules they cover."""
    for name, param in model.named_parameters():
        if param.device.type != "cpu" or param.dtype != torch.float32:
            raise ValueError(
                f"the cpu kernels are CPU float32 only, not {param.dtype} on {param.device} "
                f"({name})"
            )
        if not param.is_contiguous():
            raise ValueError(f"the cpu kernels need contiguous weights ({name} is not)")
    modules = [m for m in model.modules() if isinstance(m, _KERNEL_MODULES)]
    for module in modules:
        module.cpu_kernel = True
    return len(modules)
