"""Structured-output fields of the public APIs → a validated `GuidedDecoding`.

vLLM's extras `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (EBNF)
and Tandem's `guided_json_object`, or vLLM's newer `structured_outputs` object, come in
the same shape on every API (OpenAI bodies, KServe `sampling_parameters`), so one parser
serves all of them (`vllm_guided`); OpenAI's
`response_format` maps onto it (router/openai/guided.py). Every spec is checked here
by building its grammar (no tokenizer needed), so a bad schema, an unsupported regex
feature or a broken grammar is a 400 / INVALID_ARGUMENT naming the field, before any
worker sees it.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured.grammar_builder import GrammarSpecError, build_grammar
from tandem.engine.structured.schema_keywords import unenforced_keyword
from tandem.engine.structured.spec import GuidedDecoding, GuidedKind
from tandem.proto.tandem.v1 import generation_pb2 as gen_pb
from tandem.router.errors import InvalidRequest
from tandem.router.json_fields import get_object, invalid, show

# The vLLM-style request keys and the kind each asks for.
GUIDED_FIELDS: dict[str, GuidedKind] = {
    "guided_json": GuidedKind.JSON_SCHEMA,
    "guided_regex": GuidedKind.REGEX,
    "guided_choice": GuidedKind.CHOICE,
    "guided_grammar": GuidedKind.GRAMMAR,
    "guided_json_object": GuidedKind.JSON_OBJECT,
}
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


# Distinct specs whose check is remembered (a client repeats its schema).
_MAX_CHECKED_SPECS = 512


def guided_from_fields(
    fields: dict[str, Any], keys: dict[str, GuidedKind] = GUIDED_FIELDS, prefix: str = ""
) -> tuple[str, GuidedDecoding] | None:
    """The one guided-decoding key of `keys` set in `fields` (None: none), checked;
    raises InvalidRequest naming the key (after `prefix`) when it is malformed, or when
    several are set."""
    # Unset: absent, null, or false (`guided_json_object: false`); 0 or "" are set, and
    # checked (`0 in (None, False)` holds in Python: compared by identity).
    given = [key for key in keys if fields.get(key) is not None and fields.get(key) is not False]
    if not given:
        return None
    first, name = given[0], prefix + given[0]
    if len(given) > 1:
        raise invalid(prefix + given[1], f"cannot be combined with '{name}'; send one constraint")
    return name, checked(name, _spec(keys[first], fields[first], name))


def vllm_guided(fields: dict[str, Any]) -> tuple[str, GuidedDecoding] | None:
    """vLLM's constraint fields (`guided_*`, or the `structured_outputs` object), as
    every API takes them (KServe's `sampling_parameters` too)."""
    return one_of(guided_from_fields(fields), _structured_outputs(fields))


def one_of(
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


def field_ruling_out_grammar_tokens(params: SamplingParams) -> str | None:
    """The request field (`allowed_token_ids`, `bad_words`) that rules out tokens the
    grammar in `params` could need, leaving it none to choose; None without a grammar or
    such a field. Every API refuses the combination."""
    if params.structured is None:
        return None
    if params.allowed_token_ids:
        return "allowed_token_ids"
    return "bad_words" if params.bad_words_token_ids else None


def guided_from_generate(msg: gen_pb.GuidedDecoding) -> GuidedDecoding | None:
    """The `guided` field of a `tandem.v1.GenerateRequest` (None: unset), checked."""
    which = msg.WhichOneof("constraint")
    if which is None:
        return None
    name = f"guided.{which}"
    if which == "json_object":
        return GuidedDecoding(GuidedKind.JSON_OBJECT) if msg.json_object else None
    if which == "choice":
        value: Any = list(msg.choice.options)
    else:
        value = getattr(msg, which)
    kind = {"json_schema": GuidedKind.JSON_SCHEMA, "regex": GuidedKind.REGEX,
            "grammar": GuidedKind.GRAMMAR}.get(which, GuidedKind.CHOICE)  # fmt: skip
    return checked(name, _spec(kind, value, name))


def checked(field_name: str, guided: GuidedDecoding, enforced: bool = True) -> GuidedDecoding:
    """`guided` if its grammar builds and (with `enforced`: it will constrain an output)
    holds every keyword of a JSON schema; otherwise InvalidRequest naming `field_name`."""
    error = _grammar_error(guided.kind, guided.spec, enforced)
    if error is not None:
        raise invalid(field_name, error)
    return guided


def _spec(kind: GuidedKind, value: Any, name: str) -> GuidedDecoding:
    """The constraint of `kind` that `value` asks for; errors name `name`."""
    try:
        if kind is GuidedKind.JSON_OBJECT:
            if value is not True:
                raise invalid(name, f"must be true or false, got {show(value)}")
            return GuidedDecoding(kind)
        if kind is GuidedKind.JSON_SCHEMA:
            if isinstance(value, str):
                return GuidedDecoding(kind, value)
            if not isinstance(value, (dict, bool)):
                raise invalid(name, f"must be a JSON schema object, got {show(value)}")
            return GuidedDecoding.json_schema(value)
        if kind is GuidedKind.CHOICE:
            if not isinstance(value, list) or not value:
                raise invalid(name, f"must be a non-empty list of strings, got {show(value)}")
            return GuidedDecoding.choice(value)
        if not isinstance(value, str) or not value:
            raise invalid(name, f"must be a non-empty string, got {show(value)}")
        return GuidedDecoding(kind, value)
    except InvalidRequest:
        raise
    except ValueError as exc:  # GuidedDecoding's own checks (size)
        raise invalid(name, str(exc)) from exc


@functools.lru_cache(maxsize=_MAX_CHECKED_SPECS)
def _grammar_error(kind: GuidedKind, spec: str, enforced: bool) -> str | None:
    try:
        build_grammar(GuidedDecoding(kind, spec))
    except GrammarSpecError as exc:
        return f"is not a valid {_KIND_NAMES[kind]}: {exc}"
    if enforced and kind is GuidedKind.JSON_SCHEMA:
        return unenforced_keyword(json.loads(spec))
    return None


_KIND_NAMES = {
    GuidedKind.JSON_SCHEMA: "JSON schema",
    GuidedKind.JSON_OBJECT: "JSON object constraint",
    GuidedKind.REGEX: "regular expression (or uses an unsupported feature)",
    GuidedKind.CHOICE: "choice list",
    GuidedKind.GRAMMAR: "EBNF grammar",
}
