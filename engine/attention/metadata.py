"""The flattened, unpadded batch layout that every attention backend reads.

Tokens of all scheduled sequences are concatenated: sequence `i` owns tokens
`query_start_loc[i]:query_start_loc[i + 1]`. Decodes (exactly one query token) come
first, prefill chunks after, so backends can batch the decodes in one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillSpan:
    """One prefill chunk inside the flattened batch (derived from the fields below)."""

    query_start: int
    query_len: int
    # Tokens already in the cache before this chunk (prefix hits + earlier chunks).
    context_len: int
    # Block ids covering `context_len + query_len` positions.
    block_table: torch.Tensor
    # [query_len, context_len + query_len] bool, True = may attend; None when causal
    # from position 0 (context_len == 0).
    mask: torch.Tensor | None

    @property
    def seq_len(self) -> int:
        return self.context_len + self.query_len


@dataclass
class AttentionMetadata:
    """Per-step batch description, built once by the model runner, shared by all layers."""

    # [num_seqs + 1] int32: start offset of each sequence's query tokens.
    query_start_loc: torch.Tensor
    # [num_seqs] int32: context + query length of each sequence after this step.
    seq_lens: torch.Tensor
    # [num_seqs, max_num_blocks] int64: block ids per sequence, padded with 0.
    block_tables: torch.Tensor
    # [num_tokens] int64: cache slot (block_id * block_size + offset) of each new token.
    slot_mapping: torch.Tensor
    # The first `num_decodes` sequences have exactly one query token.
    num_decodes: int
    # [num_decodes, 1, 1, max_decode_len] bool key mask, or None when num_decodes <= 1.
    decode_mask: torch.Tensor | None
    # Longest decode context (keys gathered per decode sequence).
    max_decode_len: int
    prefills: list[PrefillSpan]
