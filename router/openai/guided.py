"""OpenAI structured-output fields → the request's `GuidedDecoding`.

Chat's `response_format` (`text`, `json_object`, `json_schema`) and the vLLM extras
(`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, or the newer
`structured_outputs` object holding `json`, `regex`, `choice`, `grammar` or
`json_object`) on both endpoints; at most one constraint per request (a forced tool
call brings its own, see tools.py).
"""

from __future__ import annotations

from typing import Any

from tandem.engine.structured.spec import GuidedDecoding, GuidedKind
from tandem.router.openai.fields import get_object, invalid, show
from tandem.router.structured_outputs import checked, guided_from_fields

_RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


# vLLM's `structured_outputs` object (what its newer releases take instead of the
# guided_* fields): its constraint keys, and the other keys that would change the output
# but are not built, refused unless at their no-op value. Its `backend` and
# `disable_fallback` choose how, not what, and are ignored.
_STRUCTURED_OUTPUTS_KEYS = {
    "json": GuidedKind.JSON_SCHEMA,
    "regex": GuidedKind.REGEX,
    "choice": GuidedKind.CHOICE,
    "grammar": GuidedKind.GRAMMAR,
    "json_object": GuidedKind.JSON_OBJECT,
}
_STRUCTURED_OUTPUTS_UNSUPPORTED = {
    "structural_tag": (None,),
    "whitespace_pattern": (None,),
    "disable_any_whitespace": (None, False),
    "disable_additional_properties": (None, False),
}
_STRUCTURED_OUTPUTS_IGNORED = frozenset({"backend", "disable_fallback"})


def guided_from_body(body: dict[str, Any]) -> tuple[str, GuidedDecoding] | None:
    """(field that set it, constraint), or None; raises InvalidRequest naming the field.
    `response_format` counts on completions too, as vLLM takes it there."""
    return _one_of(vllm_guided(body), _response_format(body))


def vllm_guided(fields: dict[str, Any]) -> tuple[str, GuidedDecoding] | None:
    """vLLM's constraint fields (`guided_*`, or the `structured_outputs` object), as
    every API takes them (KServe's `sampling_parameters` too)."""
    return _one_of(guided_from_fields(fields), _structured_outputs(fields))


def _one_of(
    *found: tuple[str, GuidedDecoding] | None,
) -> tuple[str, GuidedDecoding] | None:
    given = [item for item in found if item is not None]
    if len(given) > 1:
        raise invalid(given[1][0], f"cannot be combined with '{given[0][0]}'; send one of them")
    return given[0] if given else None


def _structured_outputs(body: dict[str, Any]) -> tuple[str, GuidedDecoding] | None:
    value = get_object(body, "structured_outputs")
    if value is None:
        return None
    for key, item in value.items():
        name = f"structured_outputs.{key}"
        if key in _STRUCTURED_OUTPUTS_UNSUPPORTED:
            if item not in _STRUCTURED_OUTPUTS_UNSUPPORTED[key]:
                raise invalid(name, f"is not supported by this server (got {show(item)})")
        elif key not in _STRUCTURED_OUTPUTS_KEYS and key not in _STRUCTURED_OUTPUTS_IGNORED:
            known = ", ".join(sorted(_STRUCTURED_OUTPUTS_KEYS))
            raise invalid(name, f"is not a structured-output key (constraints: {known})")
    return guided_from_fields(value, _STRUCTURED_OUTPUTS_KEYS, prefix="structured_outputs.")


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
    if name is not None and not isinstance(name, str):
        raise invalid("response_format.json_schema.name", f"must be a string, got {show(name)}")
    schema = spec.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise invalid(
            "response_format.json_schema.schema",
            f"must be a JSON schema object, got {show(schema)}",
        )
    field = "response_format.json_schema.schema"
    return field, checked(field, GuidedDecoding.json_schema(schema))
