"""Reads a JSON list of tool calls as it streams: each call's name once its string is
complete, and its arguments' text as it grows.

`tool_choice: required` output is a grammar-shaped list, `[{"name": "f", "arguments":
{...}}, ...]` (tools.py); an `auto` Hermes block holds one call object or a list of them
(auto_call_streams.py). `CallListScanner.feed` takes the reply's text piece by piece
and answers `CallPiece`s: a call's first piece names it (once the name's closing quote
has come), later ones carry the text its arguments object grew by, exactly as generated,
so the pieces of a call join into its arguments text. Only the list's own structure is
read (depth, strings and their escapes, the keys of each call object); the arguments are
passed through, not parsed, so a piece costs the length of its text. Arguments that are
not an object or a list (a JSON string holding one, as some models write) are not
passed: their call's text stays empty.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# Nesting depth of a call object's own keys and values: list (1), call object (2).
_CALL_DEPTH = 2


@dataclass
class CallPiece:
    """What one `feed` adds to call `index`: its name on its first piece, then text
    appended to its arguments."""

    index: int
    name: str | None
    arguments: str


class CallListScanner:
    """The calls of one streamed list (see the module docstring)."""

    def __init__(self, argument_keys: tuple[str, ...] = ("arguments",)) -> None:
        self.argument_keys = argument_keys  # the call-level keys that hold its arguments
        self.calls: list[tuple[str, str]] = []  # complete calls: (name, arguments text)
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._key_chars: list[str] | None = None  # a call-level string being read
        self._key: str | None = None  # the call-level key whose value comes next
        self._value_next = False  # after the key's colon
        self._index = -1  # the call being read
        self._name: str | None = None
        self._named = False  # its first piece is out
        self._in_arguments = False
        self._arguments: list[str] = []  # the call's arguments text so far
        self._unsent = 0  # how much of it no piece has carried yet

    def feed(self, text: str) -> list[CallPiece]:
        """The pieces `text` (the reply's next characters) adds, in order."""
        pieces: list[CallPiece] = []
        for ch in text:
            if self._in_arguments:
                self._arguments.append(ch)
            if self._in_string:
                self._read_string(ch, pieces)
            elif ch == '"':
                self._in_string = True
                at_call_level = self._depth == _CALL_DEPTH and not self._in_arguments
                self._key_chars = [] if at_call_level else None
            elif ch in "[{":
                self._open(ch)
            elif ch in "]}":
                self._close(pieces)
            elif self._depth == _CALL_DEPTH and not self._in_arguments:
                if ch == ":":
                    self._value_next = True
                elif ch == ",":
                    self._key, self._value_next = None, False
        self._flush(pieces)
        return pieces

    def _read_string(self, ch: str, pieces: list[CallPiece]) -> None:
        if self._escaped:
            self._escaped = False
        elif ch == "\\":
            self._escaped = True
        elif ch == '"':
            self._in_string = False
            if self._key_chars is not None:
                self._string_read(_decoded("".join(self._key_chars)), pieces)
                self._key_chars = None
            return
        if self._key_chars is not None:
            self._key_chars.append(ch)

    def _string_read(self, value: str, pieces: list[CallPiece]) -> None:
        """A call-level string ended: a key, or the value of the key before it."""
        if not self._value_next:
            self._key = value
            return
        self._value_next = False
        if self._key == "name":
            self._name = value
            self._flush(pieces)

    def _open(self, ch: str) -> None:
        if self._depth == _CALL_DEPTH - 1 and ch == "{":  # a new call
            self._index += 1
            self._name, self._named, self._key, self._value_next = None, False, None, False
            self._arguments, self._unsent = [], 0
        elif self._depth == _CALL_DEPTH and self._value_next and self._key in self.argument_keys:
            self._in_arguments, self._value_next = True, False
            self._arguments.append(ch)
        self._depth += 1

    def _close(self, pieces: list[CallPiece]) -> None:
        self._depth -= 1
        if self._in_arguments and self._depth == _CALL_DEPTH:
            self._in_arguments = False
        elif self._depth == _CALL_DEPTH - 1 and self._index >= 0 and self._name is not None:
            self._flush(pieces)
            self.calls.append((self._name, "".join(self._arguments)))

    def _flush(self, pieces: list[CallPiece]) -> None:
        """The current call's piece for what it gained since the last one (none while
        its name is unknown: its arguments wait for it)."""
        if self._name is None or self._index < 0:
            return
        fresh = "".join(self._arguments[self._unsent :])
        self._unsent = len(self._arguments)
        if self._named and not fresh:
            return
        if pieces and pieces[-1].index == self._index:
            pieces[-1].arguments += fresh
        else:
            pieces.append(CallPiece(self._index, None if self._named else self._name, fresh))
        self._named = True


def _decoded(raw: str) -> str:
    """A JSON string's value from the text between its quotes (as is, where it does not
    decode)."""
    try:
        return json.loads('"' + raw + '"')
    except ValueError:
        return raw
