"""A JSON schema nested past MAX_SCHEMA_DEPTH is refused before xgrammar builds it (its
build time grows about with the cube of the depth: 800 nested arrays took the router's
tokenizer thread, shared by every request, 30-56 s)."""

from __future__ import annotations

import json

import pytest

from tandem.engine.structured.grammar_builder import (
    MAX_SCHEMA_DEPTH,
    GrammarSpecError,
    build_grammar,
)
from tandem.engine.structured.spec import GuidedDecoding


def nested_arrays(levels: int) -> dict:
    """A schema document `levels` deep: arrays of arrays ... of strings."""
    schema: dict = {"type": "string"}
    for _ in range(levels - 1):
        schema = {"type": "array", "items": schema}
    return schema


def test_a_schema_at_the_limit_builds():
    build_grammar(GuidedDecoding.json_schema(nested_arrays(MAX_SCHEMA_DEPTH)))


@pytest.mark.parametrize("levels", [MAX_SCHEMA_DEPTH + 1, 800])
def test_a_schema_past_the_limit_is_refused_with_its_depth(levels):
    with pytest.raises(GrammarSpecError, match=f"{levels} levels deep; at most {MAX_SCHEMA_DEPTH}"):
        build_grammar(GuidedDecoding.json_schema(nested_arrays(levels)))


def test_lists_count_as_levels_too():
    schema = {"anyOf": [nested_arrays(MAX_SCHEMA_DEPTH - 1)]}  # anyOf's list adds one
    assert json.dumps(schema).count("[") == 1
    with pytest.raises(GrammarSpecError, match=f"{MAX_SCHEMA_DEPTH + 1} levels deep"):
        build_grammar(GuidedDecoding.json_schema(schema))
