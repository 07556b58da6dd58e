"""Per-worker latency models: how long a prefill or a decode step takes, in seconds.

- `PrefillLatencyModel`: `t(n) = a + b·n + c·n²` for `n` uncached prompt tokens (the
  quadratic term is attention over the prompt).
- `DecodeLatencyModel`: `t(batch, ctx) = a + b·batch + c·ctx` for one decode step of
  `batch` sequences holding `ctx` context tokens in total.

Both are linear in their coefficients and fitted by non-negative weighted least
squares over a bounded window of recent observations, minimising relative error.
Weights halve every `half_life` observations, so the model follows a regime shift
(thermal throttling, a noisy neighbour, a different GPU) after a few half-lives.
Observations older than `max_age_s` (60 s) leave the window: only placed requests teach
a worker's model, so a worker once seen slow (a contended minute) and then placed on
by nobody would keep that slow prediction, and with it lose every placement, for good;
its model goes back to its prior instead, the worker is placed on again and learns
what it is now.

The warm-up profile seeds the window and fixes the *prior*: a few low-weight
pseudo-observations drawn from the profile's fit (or from built-in defaults) and
rescaled to the observed level. With few or degenerate observations the model thus
predicts the prior's shape at the data's level. Coefficients are never negative, so
predictions are non-negative and non-decreasing in every input.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Generic, Self, TypeVar

import numpy as np

# Features are divided by these so the normal equations stay well conditioned.
_TOKEN_SCALE = 1024.0
_BATCH_SCALE = 32.0
_CONTEXT_SCALE = 65536.0
# Floor on durations in ratios and weights (timer resolution, empty steps).
_MIN_SECONDS = 1e-4
# How long an observation counts (see the module doc).
MAX_OBSERVATION_AGE_S = 60.0


@dataclass(frozen=True)
class PrefillObservation:
    # Prompt tokens actually computed (prompt minus prefix-cache hits).
    num_tokens: int
    seconds: float


@dataclass(frozen=True)
class DecodeObservation:
    batch_size: int
    # Context tokens of the whole batch (sum of sequence lengths).
    num_context_tokens: int
    # Duration of one decode step (or the inter-token gap the router saw).
    seconds: float


# What a model learns from: PrefillObservation or DecodeObservation.
ObservationT = TypeVar("ObservationT")


def _nnls(gram: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """argmin ||Xβ - y||² s.t. β >= 0, from the normal equations (exact for few features).

    Tries every support set and keeps the feasible solution with the least loss; with
    at most three features that is eight tiny solves.
    """
    dim = len(rhs)
    try:
        full = np.linalg.solve(gram, rhs)
        if np.all(full >= 0) and np.all(np.isfinite(full)):
            return full  # the unconstrained optimum is feasible (the usual case)
    except np.linalg.LinAlgError:
        pass
    best, best_loss = np.zeros(dim), 0.0  # β = 0 has loss ||y||² - 0 (constant dropped)
    for size in range(1, dim + 1):
        for support in itertools.combinations(range(dim), size):
            idx = list(support)
            sub = gram[np.ix_(idx, idx)]
            try:
                sol = np.linalg.solve(sub, rhs[idx])
            except np.linalg.LinAlgError:
                continue
            if np.any(sol < 0) or not np.all(np.isfinite(sol)):
                continue
            beta = np.zeros(dim)
            beta[idx] = sol
            # ||Xβ - y||² = βᵀGβ - 2βᵀr + const
            loss = float(beta @ gram @ beta - 2 * beta @ rhs)
            if loss < best_loss:
                best, best_loss = beta, loss
    return best


class LinearLatencyModel(Generic[ObservationT]):
    """Non-negative, exponentially weighted least squares over scaled features.

    Subclasses define `DEFAULT_COEFFICIENTS`, `_PRIOR_POINTS` (inputs the prior is drawn
    at), `_features(*inputs)` (already scaled), `_scaled` (coefficients to the scaled
    features' units) and `observe_all`. Memory is bounded by `window` observations;
    refits are lazy (on the next predict).
    """

    DEFAULT_COEFFICIENTS: ClassVar[tuple[float, float, float]]
    _PRIOR_POINTS: ClassVar[tuple[tuple[int, ...], ...]]

    def __init__(
        self,
        coefficients: Sequence[float] | None = None,
        *,
        window: int = 256,
        half_life: float = 32.0,
        prior_weight: float = 0.5,
        max_age_s: float = MAX_OBSERVATION_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if half_life <= 0:
            raise ValueError(f"half_life must be > 0, got {half_life}")
        if prior_weight < 0:
            raise ValueError(f"prior_weight must be >= 0, got {prior_weight}")
        self.half_life = half_life
        self.prior_weight = prior_weight
        self.max_age_s = max_age_s
        self._clock = clock
        # When the oldest observation of the last fit leaves the window (a refit then).
        self._fit_expires_at = math.inf
        # Ring buffer of the last `window` observations: features, seconds, sequence no.
        self._window = window
        self._seq = 0
        self._set_prior(
            self._scaled(self.DEFAULT_COEFFICIENTS if coefficients is None else coefficients)
        )
        dim = len(self._coef)
        self._x = np.zeros((window, dim))
        self._y = np.zeros(window)
        self._obs_seq = np.zeros(window)
        self._obs_time = np.zeros(window)

    @classmethod
    def from_profile(
        cls,
        observations: Iterable[ObservationT],
        *,
        window: int = 256,
        half_life: float = 32.0,
        prior_weight: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> Self:
        """A model whose prior is the profile's fit and whose window starts with it."""
        model = cls(window=window, half_life=half_life, prior_weight=prior_weight, clock=clock)
        model.observe_all(observations)
        if model.num_observations:
            model._set_prior(model._coefficients())
        return model

    # ----- subclass hooks --------------------------------------------------------

    def _features(self, *inputs: float) -> tuple[float, ...]:
        raise NotImplementedError

    def _scaled(self, coefficients: Sequence[float]) -> tuple[float, ...]:
        raise NotImplementedError

    def observe_all(self, observations: Iterable[ObservationT]) -> None:
        raise NotImplementedError

    # ----- fitting ---------------------------------------------------------------

    def _set_prior(self, prior: Sequence[float]) -> None:
        self._prior_coef = np.asarray(prior, dtype=float)
        self._prior_x = np.array([self._features(*p) for p in self._PRIOR_POINTS])
        self._prior_y = self._prior_x @ self._prior_coef
        self._coef = tuple(float(v) for v in prior)
        self._dirty = self._seq > 0

    def _add(self, inputs: Sequence[float], seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"seconds must be finite and >= 0, got {seconds}")
        slot = self._seq % self._window
        self._x[slot] = self._features(*inputs)
        self._y[slot] = seconds
        self._obs_seq[slot] = self._seq
        self._obs_time[slot] = self._clock()
        self._seq += 1
        self._dirty = True

    def _fit_window(self, now: float) -> np.ndarray:
        count = self.num_observations
        live = now - self._obs_time[:count] <= self.max_age_s
        if not live.any():
            self._fit_expires_at = math.inf
            return self._prior_coef
        self._fit_expires_at = float(self._obs_time[:count][live].min()) + self.max_age_s
        x, y = self._x[:count][live], self._y[:count][live]
        age = self._seq - 1 - self._obs_seq[:count][live]
        w = np.power(0.5, age / self.half_life)
        # The prior's *shape* is kept but its level follows the data: scale it by the
        # weighted geometric mean of observed / prior, so one observation 3x slower
        # than the prior predicts 3x slower everywhere instead of bending the curve.
        prior_at_obs = np.maximum(x @ self._prior_coef, _MIN_SECONDS)
        log_ratio = np.log(np.maximum(y, _MIN_SECONDS) / prior_at_obs)
        level = float(np.exp(np.sum(w * log_ratio) / np.sum(w)))
        # Pseudo-observations of the prior, weight `prior_weight` each, never forgotten.
        pw = np.full(len(self._prior_y), self.prior_weight)
        x = np.vstack([x, self._prior_x])
        y = np.concatenate([y, self._prior_y * level])
        # Relative error is what matters (a 5 ms error is huge for a short prompt and
        # noise for a long one), so residuals are weighted by 1 / seconds².
        w = np.concatenate([w, pw]) / np.maximum(y, _MIN_SECONDS) ** 2
        gram = (x * w[:, None]).T @ x
        rhs = (x * w[:, None]).T @ y
        return _nnls(gram, rhs)

    def _coefficients(self) -> tuple[float, ...]:
        now = self._clock()
        if self._dirty or now > self._fit_expires_at:
            self._coef = tuple(float(v) for v in self._fit_window(now))
            self._dirty = False
        return self._coef

    def _predict(self, *inputs: float) -> float:
        # Plain floats: predictions run per worker per request, numpy costs more here.
        coef = self._coefficients()
        return max(0.0, sum(f * c for f, c in zip(self._features(*inputs), coef, strict=True)))

    @property
    def num_observations(self) -> int:
        """Observations currently in the window (profile seeds included)."""
        return min(self._seq, self._window)


class PrefillLatencyModel(LinearLatencyModel[PrefillObservation]):
    """Seconds to prefill `n` uncached tokens: `a + b·n + c·n²`.

    Defaults are a small model on one modern GPU (5 ms + 10k tokens/s); a warm-up
    profile or a few online observations replace them.
    """

    DEFAULT_COEFFICIENTS = (5e-3, 1e-4, 1e-9)  # s, s/token, s/token²
    _PRIOR_POINTS = ((16,), (256,), (1024,), (4096,))

    def _scaled(self, coefficients: Sequence[float]) -> tuple[float, ...]:
        a, b, c = coefficients
        return (a, b * _TOKEN_SCALE, c * _TOKEN_SCALE**2)

    def _features(self, *inputs: float) -> tuple[float, ...]:
        x = max(0.0, inputs[0]) / _TOKEN_SCALE
        return (1.0, x, x * x)

    def observe(self, num_tokens: int, seconds: float) -> None:
        self._add((num_tokens,), seconds)

    def observe_all(self, observations: Iterable[PrefillObservation]) -> None:
        for obs in observations:
            self.observe(obs.num_tokens, obs.seconds)

    def predict(self, num_tokens: int) -> float:
        """Seconds to prefill `num_tokens` uncached tokens (0 tokens costs nothing)."""
        return 0.0 if num_tokens <= 0 else self._predict(num_tokens)

    def predict_queue(self, num_tokens: int, num_requests: int) -> float:
        """Seconds to drain a queue of `num_requests` prompts totalling `num_tokens`.

        The queue's size distribution is unknown, so prompts are taken as equal:
        `num_requests·a + b·N + c·N²/num_requests`.
        """
        if num_tokens <= 0 or num_requests <= 0:
            return 0.0
        a, b, c = self.coefficients
        return num_requests * a + b * num_tokens + c * num_tokens**2 / num_requests

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """`(a, b, c)` in seconds, seconds/token, seconds/token²."""
        a, b, c = self._coefficients()
        return float(a), float(b / _TOKEN_SCALE), float(c / _TOKEN_SCALE**2)


class DecodeLatencyModel(LinearLatencyModel[DecodeObservation]):
    """Seconds per decode step: `a + b·batch + c·context_tokens`.

    Defaults: 10 ms floor (weights read once per step), 0.1 ms per sequence, 1 ms per
    ~6.5k context tokens of KV read.
    """

    DEFAULT_COEFFICIENTS = (1e-2, 1e-4, 1.5e-7)  # s, s/seq, s/token
    _PRIOR_POINTS = ((1, 512), (8, 8192), (32, 65536), (64, 131072))

    def _scaled(self, coefficients: Sequence[float]) -> tuple[float, ...]:
        a, b, c = coefficients
        return (a, b * _BATCH_SCALE, c * _CONTEXT_SCALE)

    def _features(self, *inputs: float) -> tuple[float, ...]:
        batch, context = inputs
        return (1.0, max(0.0, batch) / _BATCH_SCALE, max(0.0, context) / _CONTEXT_SCALE)

    def observe(self, batch_size: int, num_context_tokens: int, seconds: float) -> None:
        self._add((batch_size, num_context_tokens), seconds)

    def observe_all(self, observations: Iterable[DecodeObservation]) -> None:
        for obs in observations:
            self.observe(obs.batch_size, obs.num_context_tokens, obs.seconds)

    def predict(self, batch_size: int, num_context_tokens: int) -> float:
        """Seconds per step for a batch of `batch_size` holding `num_context_tokens`."""
        return 0.0 if batch_size <= 0 else self._predict(batch_size, num_context_tokens)

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """`(a, b, c)` in seconds, seconds/sequence, seconds/context token."""
        a, b, c = self._coefficients()
        return float(a), float(b / _BATCH_SCALE), float(c / _CONTEXT_SCALE)
