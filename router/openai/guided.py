"""OpenAI structured-output fields → the request's `GuidedDecoding`.

Chat's `response_format` (`text`, `json_object`, `json_schema`) and the vLLM extras
(`guided_*` or the `structured_outputs` object, parsed as every API parses them:
router/structured_outputs.py) on both endpoints; at most one constraint per request (a
forced tool call brings its own, see tools.py).
"""

from __future__ import annotations

import re
from typing import Any

from tandem.engine.structured.spec import GuidedDecoding, GuidedKind
from tandem.router.json_fields import get_object, invalid, show
from tandem.router.structured_outputs import checked, one_of, vllm_guided

_RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def guided_from_body(body: dict[str, Any]) -> tuple[str, GuidedDecoding] | None:
    """(field that set it, constraint), or None; raises InvalidRequest naming the field.
    `response_format` counts on completions too, as vLLM takes it there."""
    return one_of(vllm_guided(body), _response_format(body))


def _response_format(body: dict[str, Any]) -> tuple[str, GuidedDecoding] | None:
    value = get_object(body, "response_format")
    if value is None:
        return None
    kind = value.get("type")
    if kind not in _RESPONSE_FORMAT_TYPES:
        allowed = ", ".join(repr(t) for t in _RESPONSE_FORMAT_TYPES)
        raise invalid("response_format.type", f"must be one of {allowed}; got {show(kind)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", GuidedDecoding(GuidedKind.JSON_OBJECT)
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid(
            "response_format.json_schema",
            f"must be an object with 'name' and 'schema', got {show(spec)}",
        )
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise invalid(
            "response_format.json_schema.name",
            "is required: 1-64 letters, digits, underscores or dashes (as OpenAI's), "
            f"got {show(name)}",
        )
    schema = spec.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise invalid(
            "response_format.json_schema.schema",
            f"must be a JSON schema object, got {show(schema)}",
        )
    field = "response_format.json_schema.schema"
    return field, checked(field, GuidedDecoding.json_schema(schema))
