"""Per-request sampling settings.

Built once at the API boundary from an OpenAI-style request, validated here, then carried
unchanged with the request through the scheduler to the `Sampler` (token choice) and the
`IncrementalDetokenizer` (stop strings, special tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandem.engine.structured.spec import GuidedDecoding

MAX_NUM_STOP_STRINGS = 16


@dataclass
class SamplingParams:
    """How to choose each next token and when to stop."""

    # Maximum number of tokens to generate (the output length limit).
    max_tokens: int = 16
    # Softmax temperature; 0 means greedy (argmax).
    temperature: float = 1.0
    # Keep only the k most likely tokens; 0 or -1 turns the filter off.
    top_k: int = 0
    # Nucleus sampling: keep the smallest set of tokens whose probability mass reaches top_p.
    top_p: float = 1.0
    # Seed for this request's own generator; None draws from fresh entropy.
    seed: int | None = None
    # Stop strings; the output is cut right before the first one found (not included).
    stop: list[str] = field(default_factory=list)
    # Token ids that end generation (the stop token itself is kept in the output ids).
    stop_token_ids: list[int] = field(default_factory=list)
    # Keep generating past the EOS token (benchmarks want fixed-length outputs).
    ignore_eos: bool = False
    # EOS and stop_token_ids may not end generation before this many tokens are generated.
    min_tokens: int = 0
    # Whether the caller wants the chosen token's logprob reported (always computed).
    logprobs: bool = False
    # Leave special tokens (BOS, EOS, ...) out of the detokenized text.
    skip_special_tokens: bool = True
    # Structured output: the grammar every generated token must follow (None = free).
    structured: GuidedDecoding | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an int, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k not in (-1, 0)):
            raise ValueError(f"top_k must be -1, 0 or >= 1, got {self.top_k!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if not isinstance(self.stop, list):
            # A bare str would otherwise act as one stop string per character.
            raise ValueError(f"stop must be a list of str, got {self.stop!r}")
        if len(self.stop) > MAX_NUM_STOP_STRINGS:
            raise ValueError(
                f"stop may hold at most {MAX_NUM_STOP_STRINGS} strings, got {len(self.stop)}"
            )
        for stop_str in self.stop:
            if not isinstance(stop_str, str) or not stop_str:
                raise ValueError(f"stop strings must be non-empty str, got {stop_str!r}")
        if self.structured is not None and not isinstance(self.structured, GuidedDecoding):
            raise ValueError(f"structured must be a GuidedDecoding, got {self.structured!r}")
        for token_id in self.stop_token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"stop_token_ids must be non-negative ints, got {token_id!r}")

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax of the logits (temperature 0)."""
        return self.temperature == 0.0
