"""The OpenAI sampling extras: penalties, `logit_bias`, `n` / `best_of`, `echo`, `suffix`.

Read from a request body and checked against the served model (vocabulary) and the
router's limits (`max_n`); every mistake is a 400 naming the field. What Tandem does
not do is refused with the reason, never silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.engine.sampling_params import (
    MAX_ABS_LOGIT_BIAS,
    MAX_ABS_PENALTY,
    MAX_NUM_LOGIT_BIAS,
)
from tandem.router.json_fields import (
    get_bool,
    get_float,
    get_int,
    get_object,
    integer_key,
    invalid,
    show,
)

# Most choices (`n`) one request may ask for, unless the router is configured otherwise.
DEFAULT_MAX_N = 16


@dataclass
class SamplingExtras:
    """The extras of one request, validated (engine `SamplingParams` keywords + API ones)."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # None: the request left it out.
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Choices to return (completions and chat).
    n: int = 1
    # Completions: prepend the prompt (and, with logprobs, its logprobs) to the choice.
    echo: bool = False

    def params_kwargs(self, default_repetition_penalty: float) -> dict[str, Any]:
        """What goes into the engine's `SamplingParams`."""
        repetition = self.repetition_penalty
        return {
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": default_repetition_penalty if repetition is None else repetition,
            "logit_bias": dict(self.logit_bias),
        }


def parse_extras(
    body: dict[str, Any], vocab_size: int, max_n: int, completion: bool
) -> SamplingExtras:
    """The extras of a completion (`completion`) or chat request body."""
    extras = SamplingExtras()
    for name in ("presence_penalty", "frequency_penalty"):
        value = get_float(body, name)
        if value is not None:
            if not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                bounds = f"[-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}]"
                raise invalid(name, f"must be in {bounds}, got {show(value)}")
            setattr(extras, name, value)
    repetition = get_float(body, "repetition_penalty")
    if repetition is not None:
        if repetition <= 0:
            raise invalid("repetition_penalty", f"must be > 0 (1 = off), got {show(repetition)}")
        extras.repetition_penalty = repetition
    extras.logit_bias = _logit_bias(body, vocab_size)
    extras.n = _n(body, max_n, completion)
    if completion:
        extras.echo = bool(get_bool(body, "echo"))
        suffix = body.get("suffix")
        if suffix not in (None, ""):
            raise invalid(
                "suffix",
                "is not supported: it needs a fill-in-the-middle model (FIM prefix/suffix/"
                "middle tokens), and Tandem serves every model as a plain left-to-right one",
            )
    return extras


def _logit_bias(body: dict[str, Any], vocab_size: int) -> dict[int, float]:
    raw = get_object(body, "logit_bias")
    if not raw:
        return {}
    if len(raw) > MAX_NUM_LOGIT_BIAS:
        raise invalid(
            "logit_bias", f"may hold at most {MAX_NUM_LOGIT_BIAS} entries, got {len(raw)}"
        )
    bias: dict[int, float] = {}
    for key, value in raw.items():
        token_id = integer_key(key)
        if token_id is None:
            raise invalid(
                "logit_bias", f"keys must be token ids (integers as strings), got {show(key)}"
            )
        if not 0 <= token_id < vocab_size:
            raise invalid(
                "logit_bias",
                f"holds token id {token_id}, outside the vocabulary [0, {vocab_size})",
            )
        number = get_float({"logit_bias": value}, "logit_bias")
        if number is None or not -MAX_ABS_LOGIT_BIAS <= number <= MAX_ABS_LOGIT_BIAS:
            raise invalid(
                "logit_bias",
                f"values must be numbers in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}], "
                f"got {show(value)} for token {token_id}",
            )
        bias[token_id] = number
    return bias


def _n(body: dict[str, Any], max_n: int, completion: bool) -> int:
    n = get_int(body, "n", min_value=1, max_value=max_n)
    n = 1 if n is None else n
    if completion:
        best_of = get_int(body, "best_of", min_value=1)
        if best_of is not None and best_of != n:
            raise invalid(
                "best_of",
                f"must equal 'n' ({n}) when given, got {best_of}: ranking more candidates "
                "than are returned needs every candidate's whole-sequence logprob, which "
                "Tandem does not compute; ask for n choices and pick among them",
            )
    return n
