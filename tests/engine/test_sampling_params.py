"""Validation and defaults of SamplingParams."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tandem.engine.sampling_params import MAX_NUM_STOP_STRINGS, SamplingParams


def test_defaults_are_valid_and_sampling() -> None:
    params = SamplingParams()
    assert params.max_tokens == 16
    assert params.temperature == 1.0
    assert params.stop == [] and params.stop_token_ids == []
    assert params.skip_special_tokens is True
    assert not params.is_greedy


def test_list_defaults_are_not_shared() -> None:
    first, second = SamplingParams(), SamplingParams()
    first.stop.append("x")
    assert second.stop == []


@pytest.mark.parametrize(
    ("kwargs", "is_greedy"),
    [
        ({"temperature": 0.0}, True),
        ({"temperature": 0}, True),
        ({"temperature": 0.7}, False),
        ({"temperature": 1.0, "top_k": 1}, False),
    ],
)
def test_is_greedy(kwargs: dict[str, Any], is_greedy: bool) -> None:
    assert SamplingParams(**kwargs).is_greedy is is_greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 1},
        {"temperature": 0.0},
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 50},
        {"top_p": 1e-9},
        {"top_p": 1.0},
        {"min_tokens": 16, "max_tokens": 16},
        {"stop": ["a"] * MAX_NUM_STOP_STRINGS},
        {"stop_token_ids": [0, 2]},
        {"seed": 0},
        {"seed": -5},
    ],
)
def test_accepts_edge_values(kwargs: dict[str, Any]) -> None:
    SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field_name", "bad_value"),
    [
        ({"max_tokens": 0}, "max_tokens", "0"),
        ({"max_tokens": 2.5}, "max_tokens", "2.5"),
        ({"temperature": -0.1}, "temperature", "-0.1"),
        ({"temperature": math.nan}, "temperature", "nan"),
        ({"temperature": math.inf}, "temperature", "inf"),
        ({"top_p": 0.0}, "top_p", "0.0"),
        ({"top_p": 1.5}, "top_p", "1.5"),
        ({"top_k": -2}, "top_k", "-2"),
        ({"min_tokens": -1}, "min_tokens", "-1"),
        ({"min_tokens": 17}, "min_tokens", "17"),
        ({"stop": [""]}, "stop", "''"),
        ({"stop": "END"}, "stop", "'END'"),
        ({"stop": ["a"] * (MAX_NUM_STOP_STRINGS + 1)}, "stop", str(MAX_NUM_STOP_STRINGS + 1)),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids", "-1"),
        ({"stop_token_ids": [1.0]}, "stop_token_ids", "1.0"),
        ({"seed": "7"}, "seed", "'7'"),
    ],
)
def test_rejects_bad_values_naming_field_and_value(
    kwargs: dict[str, Any], field_name: str, bad_value: str
) -> None:
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**kwargs)
    message = str(excinfo.value)
    assert field_name in message
    assert bad_value in message


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"frequency_penalty": math.nan}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"3": 1.0}}, "logit_bias"),
        ({"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias"),
        ({"num_resumed_tokens": -1}, "num_resumed_tokens"),
    ],
)
def test_rejects_bad_penalties_and_bias(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_penalty_ranges_accept_their_bounds() -> None:
    params = SamplingParams(
        presence_penalty=-2.0,
        frequency_penalty=2,
        repetition_penalty=1.3,
        logit_bias={0: -100, 5: 100.0},
    )
    assert params.has_penalties
    assert not SamplingParams(logit_bias={1: 5.0}).has_penalties
