"""Turns the last-position logits of a batch into one next token per sequence.

The engine runs the model, gathers logits [num_seqs, vocab] for the sequences that produce
a token this step, and calls `Sampler.sample` with each sequence's `SamplingParams` and
its own `torch.Generator`. First `logit_bias` and the penalties change the logits of the
rows that ask for them (penalties.py: batched tensors, no Python loop over the
vocabulary), in vLLM's order. Greedy rows are then a plain argmax so outputs match
Hugging Face greedy generation; sampled rows go through temperature, top-k and top-p,
then an exponential race drawn from the row's generator, so a seeded request gets the
same token whatever else shares the batch.

Each step pays only for what its rows ask for: an all-greedy batch takes one max
reduction (no argmax over rows that sample anyway), and the chosen token's logprob (a
logsumexp over the vocabulary) is computed only for rows whose params ask for logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.engine.penalties import TokenHistory, apply_logit_bias, apply_penalties
from tandem.engine.sampling_params import SamplingParams

# The logprob reported for a row whose params do not ask for logprobs.
NOT_COMPUTED = float("nan")


@dataclass
class SamplerOutput:
    """One entry per input row, in row order."""

    # The chosen next token of each sequence.
    token_ids: list[int]
    # log_softmax of the logits as given at the chosen token (before logit_bias,
    # penalties, temperature, top-k and top-p), as vLLM reports by default; NaN for rows
    # whose params do not ask for logprobs (not computed).
    logprobs: list[float]


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded for one request, or None to use torch's global RNG.

    `device` must be the device the logits live on (a CUDA generator for CUDA logits).
    """
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class Sampler:
    """Stateless; one instance serves every step."""

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        histories: Sequence[TokenHistory] | None = None,
    ) -> SamplerOutput:
        """Choose one token per row of `logits` ([num_seqs, vocab], any float dtype).

        `histories` (the tokens each row's sequence has seen) is needed only when a row
        has penalties."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [num_seqs, vocab], got shape {tuple(logits.shape)}")
        num_seqs = logits.shape[0]
        if len(params) != num_seqs or len(generators) != num_seqs:
            raise ValueError(
                f"got {num_seqs} logit rows, {len(params)} params, {len(generators)} generators"
            )
        raw = logits.float()
        logits = apply_logit_bias(raw, params)
        penalised = [i for i, p in enumerate(params) if p.has_penalties]
        if penalised:
            if histories is None or len(histories) != num_seqs:
                raise ValueError("rows with penalties need one token history per row")
            logits = apply_penalties(logits, params, histories, penalised)
        sample_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if not sample_rows:
            # `max` picks the first maximum as `argmax` does, in one cheaper pass.
            token_ids = logits.max(dim=-1).indices
        elif len(sample_rows) == num_seqs:
            token_ids = self._sample_rows(logits, params, generators)
        else:
            rows = torch.tensor(sample_rows, device=logits.device)
            sampled = self._sample_rows(
                logits[rows], [params[i] for i in sample_rows], [generators[i] for i in sample_rows]
            )
            token_ids = logits.argmax(dim=-1)
            token_ids[rows] = sampled
        return SamplerOutput(
            token_ids=token_ids.tolist(), logprobs=_chosen_logprobs(raw, token_ids, params)
        )

    def _sample_rows(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        """Sample one token per row; every row here has temperature > 0."""
        temperatures = torch.tensor(
            [p.temperature for p in params], dtype=torch.float32, device=logits.device
        )
        logits = logits / temperatures.unsqueeze(1)
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            logits = _apply_top_k_top_p(logits, params)
        probs = torch.softmax(logits, dim=-1)
        return probs.div_(_exponential_noise(probs, generators)).argmax(dim=-1)


def _chosen_logprobs(
    raw: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]
) -> list[float]:
    """log_softmax(raw) at each row's chosen token for the rows that ask for logprobs;
    NaN for the others."""
    wanted = [i for i, p in enumerate(params) if p.logprobs]
    if not wanted:
        return [NOT_COMPUTED] * len(params)
    if len(wanted) != len(params):
        rows = torch.tensor(wanted, device=raw.device)
        raw, token_ids = raw[rows], token_ids[rows]
    chosen = raw.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    values = (chosen - torch.logsumexp(raw, dim=-1)).tolist()
    if len(wanted) == len(params):
        return values
    logprobs = [NOT_COMPUTED] * len(params)
    for row, value in zip(wanted, values, strict=True):
        logprobs[row] = value
    return logprobs


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Set logits outside each row's top-k, then outside its top-p nucleus, to -inf.

    Top-p is applied to the distribution left after top-k (as vLLM and HF do). The most
    likely token always survives, so no row ends up empty.
    """
    vocab_size = logits.shape[1]
    top_k = torch.tensor(
        [p.top_k if p.top_k > 0 else vocab_size for p in params], device=logits.device
    ).clamp_(max=vocab_size)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=logits.device)

    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True, stable=True)
    positions = torch.arange(vocab_size, device=logits.device).unsqueeze(0)
    sorted_logits.masked_fill_(positions >= top_k.unsqueeze(1), float("-inf"))

    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Mass of the strictly more likely tokens: a token is kept while that is below top_p,
    # so the first (most likely) token, with zero mass before it, is always kept.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_logits.masked_fill_(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def _exponential_noise(
    probs: torch.Tensor, generators: list[torch.Generator | None]
) -> torch.Tensor:
    """q ~ Exp(1) per element; argmax(probs / q) is then a draw from probs.

    Rows with a generator draw from it alone, so their draw does not depend on the batch;
    rows without one share torch's global RNG in a single call.
    """
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        rows = torch.tensor(unseeded, device=probs.device)
        noise[rows] = torch.empty(
            (len(unseeded), probs.shape[1]), device=probs.device
        ).exponential_()
    for i, generator in enumerate(generators):
        if generator is not None:
            noise[i].exponential_(generator=generator)
    # A zero draw would turn 0/0 into NaN, which argmax treats as the maximum.
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)
