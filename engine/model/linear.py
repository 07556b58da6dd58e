"""The model's linear layer: `nn.Linear`, except that a CPU float32 model's weights can be
packed once for the packed kernel (engine/cpu_ops/packed_linear.cpp), which then computes
every call.

torch's `F.linear` (MKL's sgemm) repacks the weight on every call; at the few rows of a
decode step that costs about as much as the multiply. Over the small preset's decoder
layers (12 x qkv, o, gate_up, down; one process, medians of 9 passes, AVX-512 Xeon) the
packed kernel took 20.4 ms against F.linear's 36.6 ms at 8 rows, 37.9 against 49.4 ms at
32, 65 against 74 ms at 64, 381-417 against 387-489 ms at 512 (a prefill chunk) and
matched it at 1 row (a memory-bound matrix-vector product either way).
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
        """Packs the (loaded, CPU float32) weight for the packed kernel and drops the
        unpacked one: from now on every call goes through the kernel."""
        self.packed_weight = pack_linear_weight(self.weight.detach())
        del self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, self.out_features, self.bias)
        return F.linear(x, self.weight, self.bias)
