"""The flattened, unpadded batch layout that every attention backend starts from.

Tokens of all scheduled sequences are concatenated: sequence `i` owns tokens
`query_start_loc[i]:query_start_loc[i + 1]`. Decodes (exactly one query token) come
first, prefill chunks after, so backends can batch the decodes in one call.

The model runner fills a `BatchLayout` (host-side lists, built once per step); each
backend's `build_metadata` turns it into that backend's own `AttentionMetadata`
subclass (tensors on the device, masks or launch sizes), which all layers share.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class BatchLayout:
    """One step's batch as the scheduler laid it out (Python ints, no device syncs)."""

    # [num_seqs + 1]: start offset of each sequence's query tokens.
    query_start_loc: list[int]
    # [num_seqs]: context + query length of each sequence after this step.
    seq_lens: list[int]
    # Block ids per sequence (unpadded; each covers at least its seq_len positions).
    block_tables: list[list[int]]
    # [num_tokens]: each new token's cache slot (block_id * block_size + offset).
    slots: list[int]
    # The first `num_decodes` sequences have exactly one query token.
    num_decodes: int
    block_size: int
    device: torch.device

    def __post_init__(self) -> None:
        # Backends attend the first num_decodes sequences as one-token decodes: a layout
        # with a longer one among them would be attended wrongly, not refused.
        if (
            len(self.query_start_loc) != self.num_seqs + 1
            or not 0 <= self.num_decodes <= self.num_seqs
        ):
            raise ValueError(
                f"BatchLayout: {self.num_seqs} sequences need {self.num_seqs + 1} query starts "
                f"and 0..{self.num_seqs} decodes, got {len(self.query_start_loc)} and "
                f"{self.num_decodes}"
            )
        longer = [i for i in range(self.num_decodes) if self.query_len(i) != 1]
        if longer:
            raise ValueError(
                f"BatchLayout: decodes come first with one query token each; sequence "
                f"{longer[0]} (of the first {self.num_decodes}) has {self.query_len(longer[0])}"
            )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def query_len(self, i: int) -> int:
        return self.query_start_loc[i + 1] - self.query_start_loc[i]

    @cached_property
    def slot_mapping(self) -> torch.Tensor:
        """`slots` as an int64 tensor on the device (built on first use: the CPU stack op
        takes the list)."""
        return torch.tensor(self.slots, dtype=torch.int64, device=self.device)

    def flat_block_tables(self, num_rows: int | None = None) -> tuple[list[int], int]:
        """(the first `num_rows` sequences' tables, all of them by default, row after row,
        each padded with block 0 to the widest; that width)."""
        tables = self.block_tables[:num_rows]
        width = max((len(t) for t in tables), default=0)
        flat: list[int] = []
        for table in tables:
            flat += table
            flat += [0] * (width - len(table))
        return flat, width

    def padded_block_tables(
        self, dtype: torch.dtype = torch.int64, num_rows: int | None = None
    ) -> torch.Tensor:
        """`flat_block_tables` as a [num_rows, width] tensor on the host."""
        flat, width = self.flat_block_tables(num_rows)
        return torch.tensor(flat, dtype=dtype).reshape(len(self.block_tables[:num_rows]), width)


@dataclass
class AttentionMetadata:
    """What every backend's metadata has; subclasses add their own fields."""

    # [num_tokens] int64: cache slot of each new token (BatchLayout.slot_mapping).
    slot_mapping: torch.Tensor
    num_decodes: int
