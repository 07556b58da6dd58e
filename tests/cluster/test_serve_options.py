"""`tandem serve` engine options, parsed as the command line gives them (no cluster)."""

from __future__ import annotations

import pytest

from tandem.cluster.cli import DEFAULT_TOKEN_BUDGET, _engine_overrides, build_parser
from tandem.engine.config import EngineConfig


def overrides(tiny_model_dir, *flags: str) -> dict:
    args = build_parser().parse_args(["serve", "--model", str(tiny_model_dir), *flags])
    return _engine_overrides(args)


def test_chunked_prefill_is_on_with_the_default_budget(tiny_model_dir):
    assert overrides(tiny_model_dir) == {
        "enable_chunked_prefill": True,
        "max_num_batched_tokens": DEFAULT_TOKEN_BUDGET,
    }


def test_without_chunking_the_budget_covers_the_longest_prompt(tiny_model_dir):
    limit = EngineConfig(model=str(tiny_model_dir)).max_model_len
    unchunked = overrides(tiny_model_dir, "--no-chunked-prefill")
    assert unchunked == {"enable_chunked_prefill": False, "max_num_batched_tokens": limit}
    capped = overrides(tiny_model_dir, "--no-chunked-prefill", "--max-model-len", "300")
    assert capped["max_num_batched_tokens"] == 300
    # The engine accepts what the command line builds.
    config = EngineConfig(model=str(tiny_model_dir), **capped)
    assert not config.enable_chunked_prefill


def test_an_explicit_budget_too_small_for_unchunked_prompts_is_refused(tiny_model_dir):
    small = overrides(tiny_model_dir, "--no-chunked-prefill", "--max-num-batched-tokens", "64")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(model=str(tiny_model_dir), **small)
