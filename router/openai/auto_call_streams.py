"""`tool_choice: auto` output read as it streams: content and the calls in it.

tool_parsers.py reads a whole reply in the two formats chat templates teach: Hermes /
Qwen (content with `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks)
and Llama 3 JSON (the whole reply is `{"name": ..., "parameters": {...}}` or a list of
them). `HermesCallStream` and `JsonCallStream` read the same formats a piece at a time:
`feed` answers the content that can go out now and the `CallPiece`s of the calls so far.
Each call object (`call_scanner`) that names a declared tool becomes a call, its first
piece once the name is complete, then its arguments as they grow, numbered in the order
the calls come; with `parallel_tool_calls` false a declared call after the first is
dropped (as from the whole reply). Arguments are streamed as generated; ones a model
wrote as a JSON string holding the object are sent whole, decoded, when their object's
text ends. Hermes text outside blocks is content as soon as it cannot be the start of a
`<tool_call>`, and a block naming no declared tool goes out as content once it closes; a
Llama 3 reply naming none is content when it ends. What a stream sent is not taken back:
text that breaks off or stops being JSON after a call's name went out stays the call it
began (as vLLM's tool parsers stream).
"""

from __future__ import annotations

import json

from tandem.router.openai.call_scanner import CallListScanner, CallPiece
from tandem.router.openai.tool_parsers import HERMES_CLOSE, HERMES_OPEN, arguments_json

# An auto call's arguments key: `arguments` (Hermes), `parameters` (Llama 3's).
ARGUMENT_KEYS = ("arguments", "parameters")


class CallNumbers:
    """The numbers of one reply's calls, in order: only declared tools, and only the
    first with `parallel_tool_calls` false."""

    def __init__(self, names: frozenset[str], parallel: bool) -> None:
        self.names = names
        self.parallel = parallel
        self.num_calls = 0

    def number_of(self, name: str) -> int | None:
        """The call's number; None when it names no declared tool or is one too many."""
        if name not in self.names or (not self.parallel and self.num_calls > 0):
            return None
        self.num_calls += 1
        return self.num_calls - 1


class CallObjects:
    """One JSON text of a call object or a list of them (a Hermes block, a Llama 3
    reply), read as it grows."""

    def __init__(self, numbers: CallNumbers) -> None:
        self.numbers = numbers
        self.text = ""
        self.declared = False  # whether one of its calls named a declared tool
        self._scanner = CallListScanner(ARGUMENT_KEYS)
        # Per call object: its number among the reply's calls (None: not a call), and
        # whether its arguments' text was passed.
        self._numbers: dict[int, int | None] = {}
        self._argued: set[int] = set()

    def feed(self, fresh: str) -> list[CallPiece]:
        if not self.text.strip() and fresh.lstrip()[:1] == "{":
            self._scanner.feed("[")  # one call object: read as a list of one
        self.text += fresh
        pieces = []
        for piece in self._scanner.feed(fresh):
            if piece.name is not None:
                self.declared = self.declared or piece.name in self.numbers.names
                self._numbers[piece.index] = self.numbers.number_of(piece.name)
            number = self._numbers.get(piece.index)
            if number is None:
                continue
            if piece.arguments:
                self._argued.add(piece.index)
            pieces.append(CallPiece(number, piece.name, piece.arguments))
        return pieces

    def close(self) -> list[CallPiece]:
        """At the text's end: the arguments of its calls that were a JSON string (as the
        whole reply reads them), sent whole."""
        missing = [i for i, n in self._numbers.items() if n is not None and i not in self._argued]
        if not missing:
            return []
        try:
            value = json.loads(self.text)
        except ValueError:
            return []
        items = value if isinstance(value, list) else [value]
        pieces = []
        for i in missing:
            item = items[i] if i < len(items) and isinstance(items[i], dict) else {}
            arguments = arguments_json(item, ARGUMENT_KEYS)
            number = self._numbers[i]
            if arguments is not None and number is not None:
                pieces.append(CallPiece(number, None, arguments))
        return pieces


class HermesCallStream:
    """One choice's `auto` reply in the Hermes format (see the module docstring)."""

    def __init__(self, names: frozenset[str], parallel: bool) -> None:
        self.numbers = CallNumbers(names, parallel)
        self._outside = ""  # text outside blocks that may start a `<tool_call>`
        self._block: CallObjects | None = None  # the open block

    @property
    def num_calls(self) -> int:
        return self.numbers.num_calls

    def feed(self, text: str) -> tuple[str, list[CallPiece]]:
        """The content and the call pieces that `text` (the reply's next characters)
        lets go out."""
        content: list[str] = []
        pieces: list[CallPiece] = []
        while text:
            if self._block is None:
                text = self._read_outside(text, content)
            else:
                text = self._read_block(self._block, text, content, pieces)
        return "".join(content), pieces

    def finish(self) -> tuple[str, list[CallPiece]]:
        """What is still held when the reply ends: a tail that began a tag, or a block
        that never closed, as content when it made no call."""
        held, self._outside = self._outside, ""
        block, self._block = self._block, None
        if block is None:
            return held, []
        if not block.declared:
            return held + HERMES_OPEN + block.text, []
        return held, block.close()

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
        self._block = CallObjects(self.numbers)
        return joined[at + len(HERMES_OPEN) :]

    def _read_block(
        self, block: CallObjects, text: str, content: list[str], pieces: list[CallPiece]
    ) -> str:
        seen = len(block.text)
        joined = block.text + text
        end = joined.find(HERMES_CLOSE, max(0, seen - len(HERMES_CLOSE) + 1))
        if end < 0:
            pieces.extend(block.feed(text))
            return ""
        if end < seen:  # the tag began in text already read: no JSON in it
            block.text = joined[:end]
        else:
            pieces.extend(block.feed(joined[seen:end]))
        pieces.extend(block.close())
        if not block.declared:
            content.append(HERMES_OPEN + block.text + HERMES_CLOSE)
        self._block = None
        return joined[end + len(HERMES_CLOSE) :]


class JsonCallStream:
    """One choice's `auto` reply in the Llama 3 JSON format: the reply (it opened with
    `{` or `[`) is the call or calls, or content when it names no declared tool."""

    def __init__(self, names: frozenset[str], parallel: bool) -> None:
        self.numbers = CallNumbers(names, parallel)
        self._reply = CallObjects(self.numbers)

    @property
    def num_calls(self) -> int:
        return self.numbers.num_calls

    def feed(self, text: str) -> tuple[str, list[CallPiece]]:
        return "", self._reply.feed(text)

    def finish(self) -> tuple[str, list[CallPiece]]:
        if not self._reply.declared:
            return self._reply.text, []
        return "", self._reply.close()


def _tag_start(text: str) -> int:
    """The length of the longest tail of `text` that begins `<tool_call>`."""
    for kept in range(min(len(text), len(HERMES_OPEN) - 1), 0, -1):
        if HERMES_OPEN.startswith(text[-kept:]):
            return kept
    return 0
