"""Keywords a grammar cannot enforce are found wherever a schema sits, and only there."""

from __future__ import annotations

import pytest

from tandem.engine.structured.schema_keywords import unenforced_keyword


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "array", "uniqueItems": True}, "'uniqueItems' at #,"),
        ({"properties": {"a": {"contains": {"const": 1}}}}, "'contains' at #/properties/a,"),
        ({"anyOf": [{}, {"if": {}, "then": {}}]}, "'if' at #/anyOf/1,"),
        ({"$defs": {"d": {"dependentRequired": {"a": ["b"]}}}},
         "'dependentRequired' at #/$defs/d,"),
        ({"items": [{}, {"not": {}}]}, "'not' at #/items/1,"),
        ({"items": {"additionalProperties": {"maxContains": 2}}},
         "'maxContains' at #/items/additionalProperties,"),
        ({"properties": {"a": {"$ref": "other.json#/x"}}}, "'other.json#/x' at #/properties/a;"),
    ],
)  # fmt: skip
def test_an_unenforced_keyword_is_named_with_its_place(schema, where):
    reason = unenforced_keyword(schema)
    assert reason is not None and where in reason, reason


@pytest.mark.parametrize(
    "schema",
    [
        # Names and values that only look like keywords.
        {"properties": {"not": {"type": "string"}, "if": {"enum": ["contains"]}}},
        {"const": {"uniqueItems": True}, "default": {"not": 1}, "examples": [{"if": 1}]},
        {"type": "array", "uniqueItems": False},
        {"$ref": "#/$defs/a", "$defs": {"a": {"items": {"$ref": "#"}}}},
        True,
    ],
)
def test_what_a_grammar_holds_passes(schema):
    assert unenforced_keyword(schema) is None
