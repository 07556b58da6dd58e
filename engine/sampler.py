"""Turns the last-position logits of a batch into one next token per sequence.

The engine runs the model, gathers logits [num_seqs, vocab] for the sequences that produce
a token this step, and calls `Sampler.sample` with each sequence's `SamplingParams` and
the seed of its draw (`token_draw_seed`: the request's seed and the token's index). First
`logit_bias`, `allowed_token_ids`, `bad_words` and the penalties change the logits of the
rows that ask for them (penalties.py: batched tensors, no Python loop over the vocabulary).
Greedy rows are then a plain argmax so outputs match Hugging Face greedy generation;
sampled rows go through temperature, min-p, top-k and top-p (vLLM's order), then an
exponential race; a seeded row's noise comes from a generator seeded for that row and that
token alone, so its draws do not depend on the batch, on the worker that samples the
token, or on how many draws came before.

Each step pays only for what its rows ask for: an all-greedy batch takes one max
reduction over the logits as the model gave them (no float32 copy; no argmax over rows
that sample anyway), and the chosen token's logprob (a logsumexp over the vocabulary) is
computed only for rows whose params ask for logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.engine.cpu_ops.loader import greedy_argmax
from tandem.engine.penalties import (
    TokenHistory,
    apply_allowed_tokens,
    apply_bad_words,
    apply_banned_tokens,
    apply_logit_bias,
    apply_penalties,
)
from tandem.engine.sampling_params import SamplingParams

# The logprob reported for a row whose params do not ask for logprobs.
NOT_COMPUTED = float("nan")


@dataclass(frozen=True)
class TopLogprobs:
    """The most likely tokens at one position, most likely first, and their logprobs
    (log_softmax of the raw logits, as the chosen token's)."""

    token_ids: list[int]
    logprobs: list[float]


@dataclass
class SamplerOutput:
    """One entry per input row, in row order."""

    # The chosen next token of each sequence.
    token_ids: list[int]
    # log_softmax of the logits as given at the chosen token (before logit_bias,
    # penalties, temperature, min-p, top-k and top-p), as vLLM reports by default; NaN for rows
    # whose params do not ask for logprobs (not computed).
    logprobs: list[float]
    # The params.top_logprobs most likely tokens of that distribution; None for rows
    # that ask for none.
    top_logprobs: list[TopLogprobs | None]


_MASK_64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """A 64-bit bijection that scatters nearby inputs (SplitMix64's output function)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK_64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return x ^ (x >> 31)


def token_draw_seed(seed: int, index: int) -> int:
    """The generator seed of a seeded request's draw for its `index`-th generated token.

    Hashed, not `seed + index`: forked sequences take seeds `seed + i`, and their draws
    must not be each other's shifted by a token."""
    return _splitmix64(_splitmix64(seed) ^ index)


class Sampler:
    """One instance serves every step of one engine (one thread): it keeps a scratch
    generator per device, re-seeded for each seeded row's draw.

    `cpu_argmax`: greedy rows of CPU logits take the C++ op (engine/cpu_ops, built by the
    `cpu` attention backend): torch's indexed max over a 32,000-token row costs ~9x its
    plain max."""

    def __init__(self, cpu_argmax: bool = False) -> None:
        self._generators: dict[torch.device, torch.Generator] = {}
        self._cpu_argmax = cpu_argmax

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        draw_seeds: list[int | None],
        histories: Sequence[TokenHistory] | None = None,
        banned: Sequence[list[int]] | None = None,
    ) -> SamplerOutput:
        """Choose one token per row of `logits` ([num_seqs, vocab], any float dtype).

        `draw_seeds`: per row, the seed of its draw (`token_draw_seed`), or None to draw
        from torch's global RNG. `histories` (the tokens each row's sequence has seen) is
        needed only when a row has penalties. `banned`: per row, tokens it may not draw
        now (EOS and stop tokens below `min_tokens`); like the logit bias and the
        penalties they do not change the logprobs, which are the model's own (vLLM)."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [num_seqs, vocab], got shape {tuple(logits.shape)}")
        num_seqs = logits.shape[0]
        if len(params) != num_seqs or len(draw_seeds) != num_seqs:
            raise ValueError(
                f"got {num_seqs} logit rows, {len(params)} params, {len(draw_seeds)} draw seeds"
            )
        # Rows that only take the argmax need no float32 copy: a bfloat16 model's logits
        # convert to floats exactly, so the first maximum is the same.
        plain_greedy = all(p.is_greedy and not p.logprobs and not p.logit_bias
                           and not p.allowed_token_ids and not p.bad_words_token_ids
                           and not p.has_penalties for p in params)  # fmt: skip
        raw = logits if plain_greedy else logits.float()
        logits = apply_allowed_tokens(apply_logit_bias(raw, params), params)
        if banned is not None and any(banned):
            logits = apply_banned_tokens(logits, banned)
        penalised = [i for i, p in enumerate(params) if p.has_penalties]
        if penalised or any(p.bad_words_token_ids for p in params):
            if histories is None or len(histories) != num_seqs:
                raise ValueError("rows with penalties or bad words need one token history per row")
            logits = apply_bad_words(logits, params, histories)
            if penalised:
                logits = apply_penalties(logits, params, histories, penalised)
        sample_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if not sample_rows:
            token_ids = self._greedy(logits)
        elif len(sample_rows) == num_seqs:
            token_ids = self._sample_rows(logits, params, draw_seeds)
        else:
            rows = torch.tensor(sample_rows, device=logits.device)
            sampled = self._sample_rows(
                logits[rows], [params[i] for i in sample_rows], [draw_seeds[i] for i in sample_rows]
            )
            token_ids = self._greedy(logits)
            token_ids[rows] = sampled
        logprobs, top_logprobs = _logprobs(raw, token_ids, params)
        return SamplerOutput(
            token_ids=token_ids.tolist(), logprobs=logprobs, top_logprobs=top_logprobs
        )

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """The first index of each row's maximum."""
        if (
            self._cpu_argmax
            and logits.device.type == "cpu"
            and logits.dtype in (torch.float32, torch.bfloat16)
        ):
            return greedy_argmax(logits)
        # `max` picks the first maximum as `argmax` does, in one cheaper pass.
        return logits.max(dim=-1).indices

    def _sample_rows(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        draw_seeds: list[int | None],
    ) -> torch.Tensor:
        """Sample one token per row; every row here has temperature > 0."""
        temperatures = torch.tensor(
            [p.temperature for p in params], dtype=torch.float32, device=logits.device
        )
        logits = logits / temperatures.unsqueeze(1)
        if any(p.min_p > 0.0 for p in params):
            logits = _apply_min_p(logits, params)
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            logits = _apply_top_k_top_p(logits, params)
        probs = torch.softmax(logits, dim=-1)
        return probs.div_(self._exponential_noise(probs, draw_seeds)).argmax(dim=-1)

    def _exponential_noise(self, probs: torch.Tensor, draw_seeds: list[int | None]) -> torch.Tensor:
        """q ~ Exp(1) per element; argmax(probs / q) is then a draw from probs.

        Seeded rows draw from the scratch generator seeded with their own seed; the
        unseeded rows share torch's global RNG in a single call.
        """
        noise = torch.empty_like(probs)
        unseeded = [i for i, seed in enumerate(draw_seeds) if seed is None]
        if unseeded:
            rows = torch.tensor(unseeded, device=probs.device)
            noise[rows] = torch.empty(
                (len(unseeded), probs.shape[1]), device=probs.device
            ).exponential_()
        for i, seed in enumerate(draw_seeds):
            if seed is not None:
                noise[i].exponential_(generator=self._generator(probs.device).manual_seed(seed))
        # A zero draw would turn 0/0 into NaN, which argmax treats as the maximum.
        return noise.clamp_(min=torch.finfo(noise.dtype).tiny)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]


def _logprobs(
    raw: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]
) -> tuple[list[float], list[TopLogprobs | None]]:
    """log_softmax(raw) at each row's chosen token for the rows that ask for logprobs
    (NaN for the others), and at the row's params.top_logprobs largest logits (ties in
    index order) for the rows that ask for those (None for the others)."""
    logprobs = [NOT_COMPUTED] * len(params)
    top_logprobs: list[TopLogprobs | None] = [None] * len(params)
    wanted = [i for i, p in enumerate(params) if p.logprobs]
    if not wanted:
        return logprobs, top_logprobs
    if len(wanted) != len(params):
        rows = torch.tensor(wanted, device=raw.device)
        raw, token_ids = raw[rows], token_ids[rows]
    log_totals = torch.logsumexp(raw, dim=-1, keepdim=True)
    chosen = raw.gather(1, token_ids.unsqueeze(1)) - log_totals
    for row, value in zip(wanted, chosen.squeeze(1).tolist(), strict=True):
        logprobs[row] = value
    for j, row in enumerate(wanted):
        if k := params[row].top_logprobs:  # only rows that ask are ranked
            top_logprobs[row] = _rank_row(raw[j], log_totals[j], k)
    return logprobs, top_logprobs


def rank_logprobs(logits: torch.Tensor, log_totals: torch.Tensor, k: int) -> list[TopLogprobs]:
    """Each row's k largest logits (ties in index order) as logprobs: minus the row's
    log_totals ([rows, 1], the logsumexp).

    topk finds each row's k-th largest value but orders equal values as it likes (and
    bfloat16 logits tie often); so a row's ranking is its values above the k-th, then the
    lowest-index ones equal to it, sorted stably. A full sort of a 32,000-token row took
    ~2.9 ms, topk ~0.08 ms."""
    return [_rank_row(row, total, k) for row, total in zip(logits, log_totals, strict=True)]


def _rank_row(row: torch.Tensor, log_total: torch.Tensor, k: int) -> TopLogprobs:
    """rank_logprobs of one row [vocab] (log_total: its logsumexp, [1])."""
    kth = row.topk(min(k, row.shape[0])).values[-1]
    above = (row > kth).nonzero().squeeze(1)
    tied = (row == kth).nonzero().squeeze(1)[: k - above.numel()]
    ids = torch.cat([above, tied])  # ascending index order within each part
    ids = ids[row[ids].sort(descending=True, stable=True).indices]
    return TopLogprobs(ids.tolist(), (row[ids] - log_total).tolist())


def _apply_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Set the logits of tokens less than min_p times as likely as each row's most likely
    token to -inf (a probability ratio is a logit difference: log(min_p)). The most likely
    token always survives."""
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=logits.device)
    floor = logits.max(dim=-1, keepdim=True).values + min_p.log().unsqueeze(1)
    return logits.masked_fill(logits < floor, float("-inf"))


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
