"""What a request's output is constrained to: `GuidedDecoding`, immutable and wire-safe.

The matcher state of a request is not serialized; it is *replayed*: `accepted_token_ids`
are tokens at the end of the prompt that the grammar has already accepted (the output a
migrated request had streamed before it moved), and the decode side also replays the
first token the prefill side sampled. Replaying accepted tokens into a fresh matcher is
exact (the grammar is deterministic) and cheap (microseconds per token).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass

# A spec larger than this (a schema or grammar in characters) is refused.
MAX_SPEC_CHARS = 64 * 1024
# Most options a `choice` may hold.
MAX_NUM_CHOICES = 256


class GuidedKind(enum.StrEnum):
    """The kind of constraint; the `spec` string is read according to it."""

    JSON_SCHEMA = "json_schema"  # spec: a JSON schema (JSON text)
    JSON_OBJECT = "json_object"  # spec: "" (any JSON object)
    REGEX = "regex"  # spec: a regular expression the whole output matches
    CHOICE = "choice"  # spec: a JSON list of strings; the output is one of them
    GRAMMAR = "grammar"  # spec: an EBNF grammar (GBNF style, root rule `root`)


@dataclass(frozen=True)
class GuidedDecoding:
    """A request's output constraint, plus grammar progress made before this engine."""

    kind: GuidedKind
    spec: str = ""
    # Tokens at the end of the prompt already accepted by the grammar (after a migration
    # or a local recompute); the matcher replays them before the first new token.
    accepted_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.kind, GuidedKind):
            raise ValueError(f"guided decoding kind must be a GuidedKind, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"guided decoding spec must be a string, got {self.spec!r}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(
                f"guided decoding spec has {len(self.spec)} characters; "
                f"at most {MAX_SPEC_CHARS} are accepted"
            )
        if self.kind is not GuidedKind.JSON_OBJECT and not self.spec:
            raise ValueError(f"guided decoding of kind {self.kind.value} needs a spec")
        for token_id in self.accepted_token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"accepted_token_ids must be non-negative ints, got {token_id!r}")

    @property
    def cache_key(self) -> tuple[GuidedKind, str]:
        """What the compiled grammar depends on (not the progress)."""
        return (self.kind, self.spec)

    def continued(self, token_ids: Sequence[int]) -> GuidedDecoding:
        """The same constraint after the grammar accepted `token_ids` as well."""
        if not token_ids:
            return self
        return GuidedDecoding(self.kind, self.spec, (*self.accepted_token_ids, *token_ids))

    @classmethod
    def choice(cls, options: Sequence[str]) -> GuidedDecoding:
        return cls(GuidedKind.CHOICE, json.dumps(list(options), ensure_ascii=False))

    @classmethod
    def json_schema(cls, schema: object) -> GuidedDecoding:
        """A JSON schema given as a parsed object (dict / bool) or as JSON text."""
        text = schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False)
        return cls(GuidedKind.JSON_SCHEMA, text)
