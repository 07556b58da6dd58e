"""Applies the grammar masks of a batch to its logits, in one vectorised pass.

Each constrained row's matcher writes its allowed-token bitmask (a native call per
request, no Python loop over the vocabulary); one kernel call then sets every forbidden
logit of every constrained row to -inf. Unconstrained rows are untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tandem.engine.structured.matcher import RequestGrammar


def apply_grammar_masks(logits: torch.Tensor, grammars: Sequence[RequestGrammar | None]) -> None:
    """Mask `logits` [num_rows, vocab] in place; `grammars[i]` constrains row i (or None).

    A row left with no finite logit (another mask, e.g. `allowed_token_ids`, removed
    the only tokens the grammar allows) keeps the grammar's tokens, at equal logits: the
    grammar wins, since an output outside it is never acceptable. (The `min_tokens` ban
    comes later, in the sampler, and never empties a row either.)
    """
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return
    import xgrammar as xgr  # only engines serving constrained requests load it

    vocab_size = logits.shape[1]
    bitmask = xgr.allocate_token_bitmask(len(logits), vocab_size)
    for row in rows:
        grammar = grammars[row]
        assert grammar is not None
        grammar.fill_bitmask(bitmask, row)
    on_device = bitmask.to(logits.device) if logits.device.type != "cpu" else bitmask
    xgr.apply_token_bitmask_inplace(logits, on_device, vocab_size=vocab_size, indices=rows)
    index = torch.tensor(rows, device=logits.device)
    masked = logits[index]
    empty = torch.isneginf(masked).all(dim=-1)
    if bool(empty.any()):
        allowed = _allowed(bitmask[rows], vocab_size).to(logits.device)
        fallback = torch.zeros_like(masked).masked_fill_(~allowed, float("-inf"))
        masked[empty] = fallback[empty]
        logits[index] = masked


def _allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [rows, vocab] from an int32 bitmask [rows, ceil(vocab / 32)]."""
    bits = torch.arange(32, dtype=torch.int32)
    unpacked = (bitmask.unsqueeze(-1) >> bits) & 1
    return unpacked.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
