"""The model's linear layer: `nn.Linear`, except that a CPU float32 model's weights, and a
bfloat16 model's on CPUs with AMX or AVX512-BF16, can be packed once for the packed kernel
(engine/cpu_ops/packed_linear.cpp), which then computes every call.

torch's `F.linear` repacks the weight on every call (MKL's sgemm in float32, oneDNN's
kernels in bfloat16); at the few rows of a decode step that costs about as much as the
multiply. Over the small preset's decoder layers (12 x qkv, o, gate_up, down; one process,
interleaved, AVX-512 Xeon), float32 (302 MB): the packed kernel took 16.0 ms against
F.linear's 35.6 at 8 rows (reading the weights at 19 GB/s), 16.3 against 29.0 at 4, 23.4
against 35.9 at 16, 32.8 against 48.8 at 32, 56.4 against 72.4 at 64, level at 1-3 rows
(15.1 against 14.9 at 1: MKL's matrix-vector path reads at the same speed) and at 128, and
444 against 428 at 512 (a prefill chunk). bfloat16 (151 MB, AMX): 5.8 against 10.4 ms at 1
and at 8 rows, 8.0 against 10.9 at 32, level at 512 (the default step budget), 184 against
122 at 2048. bfloat16 without AMX (AMD EPYC with AVX512-BF16, VDPBF16PS kernel): 4.96
against 10.0 ms at 1 row (the weights at 30 GB/s, the machine's memory bandwidth), 5.82
against 12.2 at 8, 13.5 against 19.8 at 32, 47.0 against 52.2 at 128, level at 512 and
2048; float32 packed there took 2.0-2.4x as long at every row count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.cpu_ops.loader import pack_linear_weight, packed_linear


class Linear(nn.Linear):
    # The weight in packed_linear's panels, which replace `weight` (`pack_weight`).
    packed_weight: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.register_buffer("packed_weight", None, persistent=False)

    def pack_weight(self) -> None:
        """Packs the (loaded, CPU float32, or bfloat16 where `packs_bfloat16`) weight for
        the packed kernel and drops the unpacked one: from now on every call goes through
        the kernel."""
        self.packed_weight = pack_linear_weight(self.weight.detach())
        del self.weight

    def packed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows `ids`, read from its packed panels, as a new [len(ids),
        in_features] tensor: the embedding lookup of a packed head tied to the table."""
        packed = self.packed_weight
        if packed is None:
            raise ValueError("packed_rows: the weight is not packed")
        # float32 [panels, k, width]; bfloat16 [panels, k / 2, width, 2], k's pairs last.
        width = packed.shape[2]
        return packed[ids // width, :, ids % width].reshape(len(ids), self.in_features)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight.T (+ bias), plus `residual` where given: added to the rounded product
        (by the packed kernel as it writes its output)."""
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, self.out_features, self.bias, residual)
        out = F.linear(x, self.weight, self.bias)
        return out if residual is None else out.add_(residual)
