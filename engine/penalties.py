"""Logit bias and repetition-style penalties over a batch of logits, vectorised.

The `Sampler` calls these before choosing tokens. Each step builds a few small batch
tensors from the rows that ask for the feature (token ids padded to the longest row) and
changes the logits with one scatter / index_put each, so the cost grows with the tokens
seen, never with a Python loop over the vocabulary.

Semantics (what clients of OpenAI and vLLM expect):

* `logit_bias`: the value is added to the token's logit (OpenAI).
* `allowed_token_ids`: every other token's logit is -inf (vLLM).
* `bad_words` (vLLM, as token sequences): a sequence's last token gets -inf when the
  generated tokens (resumed ones included) end with the rest of the sequence; a
  one-token sequence always.
* `repetition_penalty` (vLLM, after CTRL): for every token in prompt or output, a
  positive logit is divided by the penalty and a negative one multiplied by it.
* `frequency_penalty` / `presence_penalty` (OpenAI): over the *generated* tokens only,
  `logit -= count * frequency_penalty + (count > 0) * presence_penalty`.

Applied in vLLM's order: logit bias, then repetition, then frequency and presence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from tandem.engine.sampling_params import SamplingParams


class TokenHistory(Protocol):
    """The tokens one sequence has seen, split as the penalties need them."""

    @property
    def penalty_prompt_token_ids(self) -> Sequence[int]:
        """The client's prompt (without tokens an earlier attempt generated)."""
        ...

    @property
    def generated_token_ids(self) -> Sequence[int]:
        """Every token generated for the request so far, resumed ones included."""
        ...


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """`logits` plus each row's bias (a new tensor when any row has one; else `logits`)."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for row, p in enumerate(params):
        if p.logit_bias:
            rows += [row] * len(p.logit_bias)
            cols += p.logit_bias.keys()
            values += p.logit_bias.values()
    if not rows:
        return logits
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    bias = torch.tensor(values, dtype=logits.dtype, device=device)
    return logits.index_put(index, bias, accumulate=True)


def apply_banned_tokens(logits: torch.Tensor, banned: Sequence[list[int]]) -> torch.Tensor:
    """`logits` with each row's `banned` tokens at -inf (a new tensor), except in a row
    the ban would leave with no token (its grammar, or `allowed_token_ids`, allow only
    banned ones): that row keeps its logits, since what the constraint allows wins."""
    rows = [row for row, tokens in enumerate(banned) for _ in tokens]
    cols = [token for tokens in banned for token in tokens]
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    result = logits.index_put(index, torch.tensor(float("-inf"), dtype=logits.dtype, device=device))
    emptied = torch.isneginf(result).all(dim=-1)
    if bool(emptied.any()):
        result[emptied] = logits[emptied]
    return result


def apply_allowed_tokens(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """`logits` with every token outside each row's allowed_token_ids at -inf (a new
    tensor when any row restricts its tokens; else `logits`)."""
    rows: list[int] = []
    cols: list[int] = []
    for row, p in enumerate(params):
        if p.allowed_token_ids:
            rows += [row] * len(p.allowed_token_ids)
            cols += p.allowed_token_ids
    if not rows:
        return logits
    device = logits.device
    allowed = torch.zeros_like(logits, dtype=torch.bool)
    allowed[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = True
    free = torch.tensor([not p.allowed_token_ids for p in params], device=device)
    return logits.masked_fill(~(allowed | free.unsqueeze(1)), float("-inf"))


def apply_bad_words(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory]
) -> torch.Tensor:
    """`logits` with each row's banned bad-word tokens at -inf (a new tensor when any row
    bans one; else `logits`)."""
    rows: list[int] = []
    cols: list[int] = []
    for row, p in enumerate(params):
        if not p.bad_words_token_ids:
            continue
        generated = histories[row].generated_token_ids
        for sequence in p.bad_words_token_ids:
            *before, last = sequence
            if not before or _ends_with(generated, before):
                rows.append(row)
                cols.append(last)
    if not rows:
        return logits
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    return logits.index_put(index, torch.tensor(float("-inf"), dtype=logits.dtype, device=device))


def _ends_with(tokens: Sequence[int], suffix: list[int]) -> bool:
    return len(tokens) >= len(suffix) and list(tokens[len(tokens) - len(suffix) :]) == suffix


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory],
    rows: list[int],
) -> torch.Tensor:
    """`logits` with the penalties of `rows` applied (a new tensor; the others untouched)."""
    device = logits.device
    vocab_size = logits.shape[1]
    row_index = torch.tensor(rows, device=device)
    picked = [params[i] for i in rows]
    generated = _padded([histories[i].generated_token_ids for i in rows], vocab_size, device)
    # Column `vocab_size` catches the padding and is dropped.
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=logits.dtype, device=device)
    counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=logits.dtype))
    counts = counts[:, :vocab_size]
    sub = logits.index_select(0, row_index)

    repetition = _column(picked, "repetition_penalty", logits.dtype, device)
    if any(p.repetition_penalty != 1.0 for p in picked):
        prompt = _padded([histories[i].penalty_prompt_token_ids for i in rows], vocab_size, device)
        seen = torch.zeros(len(rows), vocab_size + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, prompt, True)
        seen = seen[:, :vocab_size] | (counts > 0)
        scaled = torch.where(sub > 0, sub / repetition, sub * repetition)
        sub = torch.where(seen, scaled, sub)

    frequency = _column(picked, "frequency_penalty", logits.dtype, device)
    presence = _column(picked, "presence_penalty", logits.dtype, device)
    sub = sub - counts * frequency - (counts > 0).to(logits.dtype) * presence
    return logits.index_copy(0, row_index, sub)


def _padded(seqs: list[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """[len(seqs), longest] int64 token ids, padded with `pad` (at least one column)."""
    width = max(1, max(len(s) for s in seqs))
    out = torch.full((len(seqs), width), pad, dtype=torch.int64)
    for i, seq in enumerate(seqs):
        if seq:
            out[i, : len(seq)] = torch.as_tensor(seq, dtype=torch.int64)
    return out.to(device)


def _column(
    params: list[SamplingParams], name: str, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """One setting of every row as a [rows, 1] tensor (broadcasts over the vocabulary)."""
    return torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=device)[:, None]
