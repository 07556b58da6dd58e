"""A `GuidedDecoding` spec → an xgrammar `Grammar` (no tokenizer needed).

Used twice: by the router to refuse a bad spec up front (a 400 naming the field), and by
the engine's compiler, which turns the grammar into a token-level one. JSON is generated
compactly (no free whitespace): a model then cannot wander in whitespace, and a schema
bounded in size gives an output bounded in tokens.
"""

from __future__ import annotations

import json
import re

import xgrammar as xgr

from tandem.engine.structured.spec import MAX_NUM_CHOICES, GuidedDecoding, GuidedKind

# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: ".
# A JSON string character as xgrammar writes it for bounded strings, and the same class
# without the control characters JSON forbids raw.
_LOOSE_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: .*? is false: )?")


# The deepest nesting of objects and arrays a JSON schema document may have. xgrammar's
# build time grows about with its cube (arrays nested 100 deep: 0.07 s, 200: 0.45 s, 400:
# 3.5 s, 800: 30-56 s; AMX Xeon), on the router's one tokenizer thread that every request
# shares, and a worker gives a grammar 30 s to compile. 128 document levels (64 nested
# object schemas) build in ~0.04 s; OpenAI's structured outputs take 10 levels of nesting.
MAX_SCHEMA_DEPTH = 128


class GrammarSpecError(ValueError):
    """The spec is not a grammar we can enforce; the message says why."""


def build_grammar(guided: GuidedDecoding) -> xgr.Grammar:
    """The spec's grammar; raises GrammarSpecError with a readable reason."""
    try:
        return _build(guided)
    except GrammarSpecError:
        raise
    except (RuntimeError, ValueError, TypeError) as exc:
        raise GrammarSpecError(_clean(str(exc))) from exc


def _build(guided: GuidedDecoding) -> xgr.Grammar:
    kind, spec = guided.kind, guided.spec
    if kind is GuidedKind.JSON_SCHEMA:
        schema = _json(spec, "a JSON schema")
        if not isinstance(schema, (dict, bool)):
            raise GrammarSpecError(f"a JSON schema must be an object, got {type(schema).__name__}")
        if (depth := _nesting_depth(schema)) > MAX_SCHEMA_DEPTH:
            raise GrammarSpecError(
                f"nests objects and arrays {depth} levels deep; at most {MAX_SCHEMA_DEPTH} "
                "are accepted"
            )
        return _json_safe(xgr.Grammar.from_json_schema(spec, any_whitespace=False))
    if kind is GuidedKind.JSON_OBJECT:
        # Not strict: any properties are allowed in a plain JSON object.
        return _json_safe(
            xgr.Grammar.from_json_schema(
                '{"type": "object"}', any_whitespace=False, strict_mode=False
            )
        )
    if kind is GuidedKind.REGEX:
        return xgr.Grammar.from_regex(spec)
    if kind is GuidedKind.CHOICE:
        return xgr.Grammar.from_ebnf(_choice_ebnf(_json(spec, "a list of strings")))
    if kind is GuidedKind.GRAMMAR:
        return xgr.Grammar.from_ebnf(spec)
    raise GrammarSpecError(f"unknown guided decoding kind {kind!r}")


def _json_safe(grammar: xgr.Grammar) -> xgr.Grammar:
    """`grammar` with raw control characters kept out of length-bounded JSON strings.

    xgrammar 0.2.9 writes the characters of a string with `maxLength` / `minLength` as
    `[^"\\\r\n]`, which admits U+0000-U+001F (invalid raw in JSON: `json.loads`
    refuses them); its unbounded strings exclude them. Found with random-weight models.
    """
    text = str(grammar)
    if _LOOSE_STRING_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))


def _json(spec: str, what: str) -> object:
    try:
        return json.loads(spec)
    except ValueError as exc:
        raise GrammarSpecError(f"is not valid JSON ({what} expected): {exc}") from exc


def _nesting_depth(value: object) -> int:
    """How deep objects and arrays nest in a parsed JSON document (a scalar: 0)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = list(node.values())
        if isinstance(node, list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in node)
    return deepest


def _choice_ebnf(options: object) -> str:
    if not isinstance(options, list) or not options:
        raise GrammarSpecError("must be a non-empty list of strings")
    if len(options) > MAX_NUM_CHOICES:
        raise GrammarSpecError(f"may hold at most {MAX_NUM_CHOICES} options, got {len(options)}")
    for i, option in enumerate(options):
        if not isinstance(option, str) or not option:
            raise GrammarSpecError(f"must hold non-empty strings, got {option!r} at index {i}")
    # EBNF string literals take JSON's escapes.
    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


def _clean(message: str) -> str:
    """The first meaningful line of a library error, without its C++ source prefix."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    first = lines[0] if lines else "the grammar library refused it"
    return _CPP_PREFIX.sub("", first)
