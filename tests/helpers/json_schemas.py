"""Twenty JSON schemas bounded in size (strings with maxLength, integers and arrays
with bounds), so a grammar-constrained output always completes within `MAX_TOKENS`
tokens even when a random-weight model picks every choice at random."""

from __future__ import annotations

from typing import Any

# Enough for the largest schema below (~50 characters of fixed JSON + bounded values;
# the tiny model's byte-level tokens are one character or more).
MAX_TOKENS = 240

_NAME = {"type": "string", "maxLength": 8}
_SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 99}
_UNIT = {"type": "number", "minimum": 0, "maximum": 1}


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


SCHEMAS: list[dict[str, Any]] = [
    _obj({"name": _NAME}),
    _obj({"age": _SMALL_INT}),
    _obj({"ok": {"type": "boolean"}}),
    _obj({"color": {"enum": ["red", "green", "blue"]}}),
    _obj({"score": _UNIT}),
    _obj({"temperature": {"type": "number", "minimum": -40, "maximum": 50}}),
    _obj({"name": _NAME, "age": _SMALL_INT, "ok": {"type": "boolean"}}),
    _obj({"user": _obj({"id": _SMALL_INT, "name": _NAME})}),
    _obj({"a": _obj({"b": _obj({"c": {"enum": [1, 2, 3]}})})}),
    _obj({"tags": {"type": "array", "items": _NAME, "maxItems": 3}}),
    _obj({"ids": {"type": "array", "items": _SMALL_INT, "minItems": 1, "maxItems": 4}}),
    _obj(
        {
            "points": {
                "type": "array",
                "items": _obj({"x": _SMALL_INT, "y": _SMALL_INT}),
                "maxItems": 2,
            }
        }
    ),
    _obj({"level": {"enum": ["low", "mid", "high"]}, "count": _SMALL_INT}),
    _obj(
        {"status": {"const": "done"}, "code": {"type": "integer", "minimum": 200, "maximum": 599}}
    ),
    _obj({"maybe": {"anyOf": [_SMALL_INT, {"type": "null"}]}}),
    _obj({"value": {"type": ["integer", "boolean"], "minimum": 0, "maximum": 9}}),
    {"type": "array", "items": {"enum": ["x", "y", "z"]}, "minItems": 1, "maxItems": 5},
    _obj({"name": _NAME, "nickname": _NAME}, required=["name"]),
    _obj(
        {
            "matrix": {
                "type": "array",
                "maxItems": 2,
                "items": {"type": "array", "items": {"enum": [0, 1]}, "maxItems": 2},
            }
        }
    ),
    _obj(
        {
            "order": _obj(
                {
                    "item": {"enum": ["tea", "coffee"]},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 5},
                    "price": _UNIT,
                }
            )
        }
    ),
]
