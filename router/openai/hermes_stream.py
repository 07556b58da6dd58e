"""`tool_choice: auto` output in the Hermes / Qwen format, read as it streams.

The reply is content with `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks in it (tool_parsers.py reads a whole reply). `HermesCallStream.feed` takes the
reply's text piece by piece and answers the content that can go out now and the
`CallPiece`s of the calls so far: text outside blocks is content as soon as it cannot be
the start of a `<tool_call>`; inside a block, each call object (`call_scanner`) that
names a declared tool becomes a call, its first piece once the name is complete, then
its arguments as they grow, numbered in the order the calls come. A block whose call
names no declared tool goes out as content once it closes, as the whole reply has it;
with `parallel_tool_calls` false, a declared call after the first is dropped (so is it
from the whole reply). The call's arguments are streamed as generated; ones a model wrote
as a JSON string holding the object are sent whole, decoded, when their block closes.
What the stream has sent is not taken back: a block that breaks off or turns out not to
be JSON after its name was sent stays the call it began (as vLLM's Hermes parser does).
"""

from __future__ import annotations

import json
from typing import Any

from tandem.router.openai.call_scanner import CallListScanner, CallPiece
from tandem.router.openai.tool_parsers import HERMES_CLOSE, HERMES_OPEN

# An auto call's arguments key: `arguments` (Hermes), `parameters` (Llama 3's).
ARGUMENT_KEYS = ("arguments", "parameters")


class HermesCallStream:
    """One choice's `auto` reply (see the module docstring)."""

    def __init__(self, names: frozenset[str], parallel: bool) -> None:
        self.names = names
        self.parallel = parallel
        self.num_calls = 0
        self._outside = ""  # text outside blocks that may start a `<tool_call>`
        self._block: str | None = None  # inside a block: its text so far
        self._scanner = CallListScanner(ARGUMENT_KEYS)
        # Per call object of the open block: its number among the reply's calls (None:
        # not a call), and whether its arguments were passed; whether it named a declared
        # tool (else the block goes out as content).
        self._numbers: dict[int, int | None] = {}
        self._argued: set[int] = set()
        self._declared = False

    def feed(self, text: str) -> tuple[str, list[CallPiece]]:
        """The content and the call pieces that `text` (the reply's next characters)
        lets go out."""
        content: list[str] = []
        pieces: list[CallPiece] = []
        while text:
            if self._block is None:
                text = self._read_outside(text, content)
            else:
                text = self._read_block(text, content, pieces)
        return "".join(content), pieces

    def finish(self) -> str:
        """The content still held when the reply ends: a tail that began a tag, or a
        block that never closed and made no call."""
        held, self._outside = self._outside, ""
        if self._block is not None and not self._declared:
            held += HERMES_OPEN + self._block
        self._block = None
        return held

    def _read_outside(self, text: str, content: list[str]) -> str:
        joined = self._outside + text
        at = joined.find(HERMES_OPEN)
        if at < 0:
            kept = _tag_start(joined)
            content.append(joined[: len(joined) - kept])
            self._outside = joined[len(joined) - kept :]
            return ""
        content.append(joined[:at])
        self._outside = ""
        self._block = ""
        self._scanner = CallListScanner(ARGUMENT_KEYS)
        self._numbers, self._argued, self._declared = {}, set(), False
        return joined[at + len(HERMES_OPEN) :]

    def _read_block(self, text: str, content: list[str], pieces: list[CallPiece]) -> str:
        assert self._block is not None
        seen = len(self._block)
        joined = self._block + text
        end = joined.find(HERMES_CLOSE, max(0, seen - len(HERMES_CLOSE) + 1))
        fresh = joined[seen:] if end < 0 else joined[seen:end]
        if not self._block.strip() and fresh.lstrip()[:1] == "{":
            self._scanner.feed("[")  # one call object: read as a list of one
        self._block = joined if end < 0 else joined[:end]
        pieces.extend(self._numbered(self._scanner.feed(fresh)))
        if end < 0:
            return ""
        pieces.extend(self._decoded_arguments())
        if not self._declared:
            content.append(HERMES_OPEN + self._block + HERMES_CLOSE)
        self._block = None
        return joined[end + len(HERMES_CLOSE) :]

    def _numbered(self, found: list[CallPiece]) -> list[CallPiece]:
        """The block's pieces of calls, numbered among the reply's calls."""
        out = []
        for piece in found:
            if piece.name is not None:
                self._numbers[piece.index] = self._number_of(piece.name)
            number = self._numbers.get(piece.index)
            if number is None:
                continue
            if piece.arguments:
                self._argued.add(piece.index)
            out.append(CallPiece(number, piece.name, piece.arguments))
        return out

    def _number_of(self, name: str) -> int | None:
        """A call's number, or None: it names no declared tool, or it is one too many."""
        if name not in self.names:
            return None
        self._declared = True
        if not self.parallel and self.num_calls > 0:
            return None
        self.num_calls += 1
        return self.num_calls - 1

    def _decoded_arguments(self) -> list[CallPiece]:
        """At a block's close: the arguments of its calls that were a JSON string (as
        the whole reply reads them), sent whole."""
        assert self._block is not None
        missing = [i for i, n in self._numbers.items() if n is not None and i not in self._argued]
        if not missing:
            return []
        try:
            value = json.loads(self._block)
        except ValueError:
            return []
        items = value if isinstance(value, list) else [value]
        pieces = []
        for i in missing:
            item = items[i] if i < len(items) and isinstance(items[i], dict) else {}
            arguments: Any = next((item[k] for k in ARGUMENT_KEYS if k in item), {})
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    continue
            number = self._numbers[i]
            assert number is not None
            pieces.append(CallPiece(number, None, json.dumps(arguments, ensure_ascii=False)))
        return pieces


def _tag_start(text: str) -> int:
    """The length of the longest tail of `text` that begins `<tool_call>`."""
    for kept in range(min(len(text), len(HERMES_OPEN) - 1), 0, -1):
        if HERMES_OPEN.startswith(text[-kept:]):
            return kept
    return 0
