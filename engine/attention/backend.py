"""The attention backend interface.

A backend builds its own per-step metadata from the model runner's `BatchLayout`
(once per step, shared by all layers, as vLLM v1's metadata builders do), writes the
step's new K/V into the paged cache and computes attention of the step's queries
against each sequence's whole context.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Generic, TypeVar

import torch

from tandem.engine.attention.metadata import AttentionMetadata, BatchLayout

M = TypeVar("M", bound=AttentionMetadata)


class AttentionBackend(ABC, Generic[M]):
    # The name `--attention-backend` selects it by.
    name: ClassVar[str]
    # Whether starting this backend loaded Tandem's C++ CPU ops, so the model's fused
    # kernels, its one-call decoder stack and the greedy sampler may use them too.
    loads_cpu_ops: ClassVar[bool] = False

    @abstractmethod
    def build_metadata(self, batch: BatchLayout) -> M:
        """This backend's metadata for one step (tensors on `batch.device`)."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: M,
    ) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D], kv_cache [2, blocks, block_size, Hkv, D].

        Writes key/value at `meta.slot_mapping` and returns the attention output [T, Hq * D].
        """
