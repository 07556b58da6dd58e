"""The model's linear layer: `nn.Linear`, except that on CPU float32 a batch of a few rows
can go to the small-batch kernel (engine/cpu_ops/small_batch_linear.cpp).

A decode step multiplies a handful of rows (one per running sequence) by every weight, so
it is bound by reading the weights. torch's `F.linear` reads them at full speed for one
row (a matrix-vector product) but at about half that speed for 4-16 rows (MKL's GEMM
repacks the weight on every call); the kernel streams each weight once for all rows.
Measured with `tandem-bench engine` (the matmul floor of each path); past
`SMALL_BATCH_MAX_ROWS` rows the GEMM is compute-bound and MKL's blocking wins.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.cpu_ops.loader import small_batch_linear

# Rows from MIN to MAX go to the kernel when it is on. Over the small preset's weights on
# an AVX-512 Xeon it took 1.05-1.2x F.linear's time at 1-3 rows (MKL's matrix-vector
# path), 0.7x at 4, 0.6x at 8, 0.85x at 16 and 1.25x at 32 (compute-bound: MKL's blocking).
SMALL_BATCH_MIN_ROWS = 4
SMALL_BATCH_MAX_ROWS = 16


class Linear(nn.Linear):
    # Off by default (the kernel is CPU float32 only, and must be built); on for the whole
    # model by `use_cpu_kernels` (cpu_kernels.py).
    cpu_kernel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernel and SMALL_BATCH_MIN_ROWS <= x.shape[0] <= SMALL_BATCH_MAX_ROWS:
            return small_batch_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
