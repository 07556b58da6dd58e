"""Latency laws fitted to a profile: what one engine step, or one KV pull, costs.

- Prefill of `new` tokens after `cached` ones: `a + b·new + c·new·(cached + new/2)`;
  the last term counts the query-key pairs of causal attention, so one prompt split
  into chunks (each attending to the chunks before it) costs the same attention as the
  whole prompt at once, and a cached prefix still costs its attention.
- Decode step: `a + b·batch + c·context_tokens` (the router's form).
- A mixed step (colocated, or a decode worker prefilling locally) pays the larger
  fixed cost once, plus every part's variable cost.
- KV pull of `n` tokens: `fixed + n / tokens_per_s`.

Fits minimise relative error with non-negative coefficients, so laws never predict
negative or decreasing times. `router_prefill_coefficients` converts to the router's
`a + b·n + c·n²` model, so the simulated router predicts what the profile says.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from tandem.planner.profile_format import Profile

_MIN_SECONDS = 1e-5


def fit_nonnegative(features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Least relative-squared-error coefficients, all >= 0 (drop the most negative one and
    refit until none is negative: exact enough for three features)."""
    weights = 1.0 / np.maximum(seconds, _MIN_SECONDS)
    active = list(range(features.shape[1]))
    coef = np.zeros(features.shape[1])
    while active:
        x = features[:, active] * weights[:, None]
        sol, *_ = np.linalg.lstsq(x, seconds * weights, rcond=None)
        if np.all(sol >= 0):
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


@dataclass(frozen=True)
class LatencyLaws:
    prefill_fixed_s: float
    prefill_per_token_s: float
    # Per query-key pair of attention (see the module docstring).
    prefill_per_pair_s: float
    decode_fixed_s: float
    decode_per_seq_s: float
    decode_per_context_token_s: float
    transfer_fixed_s: float = 0.0
    # 0 means transfers are free (no transfer samples).
    transfer_s_per_token: float = 0.0

    @classmethod
    def fit(cls, profile: Profile) -> LatencyLaws:
        pre = np.array([(1.0, s.prompt_tokens - s.cached_tokens,
                         _pairs(s.prompt_tokens - s.cached_tokens, s.cached_tokens))
                        for s in profile.prefill])  # fmt: skip
        pre_s = np.array([s.seconds for s in profile.prefill])
        dec = np.array([(1.0, s.batch_size, s.context_tokens) for s in profile.decode])
        dec_s = np.array([s.seconds for s in profile.decode])
        pa, pb, pc = fit_nonnegative(pre, pre_s)
        da, db, dc = fit_nonnegative(dec, dec_s)
        ta, tb = 0.0, 0.0
        if profile.transfer:
            tra = np.array([(1.0, s.num_tokens) for s in profile.transfer])
            ta, tb = fit_nonnegative(tra, np.array([s.seconds for s in profile.transfer]))
        return cls(float(pa), float(pb), float(pc), float(da), float(db), float(dc),
                   float(ta), float(tb))  # fmt: skip

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """One step prefilling `new_tokens` of a prompt after `cached_tokens` computed ones."""
        if new_tokens <= 0:
            return 0.0
        return (self.prefill_fixed_s + self.prefill_per_token_s * new_tokens
                + self.prefill_per_pair_s * _pairs(new_tokens, cached_tokens))  # fmt: skip

    def decode_s(self, batch_size: int, context_tokens: int) -> float:
        if batch_size <= 0:
            return 0.0
        return (self.decode_fixed_s + self.decode_per_seq_s * batch_size
                + self.decode_per_context_token_s * context_tokens)  # fmt: skip

    def step_s(
        self, chunks: Iterable[tuple[int, int]], batch_size: int, context_tokens: int
    ) -> float:
        """One engine step: prefill `chunks` (new, already computed) and `batch_size` decodes."""
        fixed, variable = 0.0, 0.0
        for new, done in chunks:
            if new > 0:
                fixed = self.prefill_fixed_s
                variable += self.prefill_s(new, done) - self.prefill_fixed_s
        if batch_size > 0:
            fixed = max(fixed, self.decode_fixed_s)
            variable += self.decode_s(batch_size, context_tokens) - self.decode_fixed_s
        return fixed + variable

    def transfer_s(self, num_tokens: int) -> float:
        if self.transfer_s_per_token <= 0 and self.transfer_fixed_s <= 0:
            return 0.0
        return self.transfer_fixed_s + self.transfer_s_per_token * num_tokens

    def router_prefill_coefficients(self) -> tuple[float, float, float]:
        """`(a, b, c)` of the router's `a + b·n + c·n²` for an uncached prompt of n tokens."""
        return (self.prefill_fixed_s, self.prefill_per_token_s, self.prefill_per_pair_s / 2)

    def router_decode_coefficients(self) -> tuple[float, float, float]:
        return (self.decode_fixed_s, self.decode_per_seq_s, self.decode_per_context_token_s)

    @classmethod
    def from_router_models(
        cls,
        prefill: Sequence[float],
        decode: Sequence[float],
        transfer_s_per_token: float = 0.0,
    ) -> LatencyLaws:
        """Laws from a router's online-corrected models (`coefficients` of each)."""
        a, b, c = prefill
        da, db, dc = decode
        return cls(a, b, 2 * c, da, db, dc, 0.0, transfer_s_per_token)


def _pairs(new_tokens: int, cached_tokens: int) -> float:
    return new_tokens * (cached_tokens + new_tokens / 2)
