"""JSON Schema keywords the grammar cannot enforce, found before a request runs.

xgrammar builds a grammar for a schema that uses them and leaves them out silently, so
the output may break them (`uniqueItems`: `[2, 2, 3]`). A schema is refused instead,
naming the keyword and where it is, as vLLM refuses them for its xgrammar backend and
OpenAI's strict mode does. `oneOf` is enforced as `anyOf` (an output valid for two
branches is not refused), as vLLM and xgrammar do.
"""

from __future__ import annotations

from typing import Any

# Keyword -> why the grammar cannot hold it.
UNENFORCED = {
    "uniqueItems": "items that differ from each other",
    "contains": "an item somewhere matching a schema",
    "minContains": "a count of items matching a schema",
    "maxContains": "a count of items matching a schema",
    "not": "everything but a schema",
    "if": "a schema chosen by another",
    "then": "a schema chosen by another",
    "else": "a schema chosen by another",
    "dependentRequired": "properties required by another's presence",
    "dependentSchemas": "a schema applied by a property's presence",
    "dependencies": "properties required by another's presence",
}
# Keywords whose value is a schema, a list of schemas, or a map of name -> schema.
_SCHEMA = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties",
           "unevaluatedItems", "additionalItems")  # fmt: skip
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def unenforced_keyword(schema: Any, path: str = "#") -> str | None:
    """Why `schema` cannot be enforced ("uses 'uniqueItems' at #/properties/tags, ..."),
    or None; the reason reads after the field's name."""
    if not isinstance(schema, dict):
        return None
    for keyword, reason in UNENFORCED.items():
        if keyword in schema and not (keyword == "uniqueItems" and schema[keyword] is False):
            return (
                f"uses '{keyword}' at {path}, which a grammar cannot enforce ({reason}); "
                "leave it out and check the output yourself"
            )
    ref = schema.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        return (
            f"uses a '$ref' to {ref!r} at {path}; only references within the schema "
            "('#' or '#/...') are supported"
        )
    children: list[tuple[str, Any]] = []
    for key in _SCHEMA:
        if isinstance(schema.get(key), dict):
            children.append((f"{path}/{key}", schema[key]))
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            children += [(f"{path}/{key}/{i}", s) for i, s in enumerate(schema[key])]
    if isinstance(schema.get("items"), list):  # the older form of prefixItems
        children += [(f"{path}/items/{i}", s) for i, s in enumerate(schema["items"])]
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            children += [(f"{path}/{key}/{name}", s) for name, s in schema[key].items()]
    for child_path, child in children:
        if (why := unenforced_keyword(child, child_path)) is not None:
            return why
    return None
