"""`auto_call_streams`: `auto` replies in the Hermes and Llama 3 JSON formats, read as
they stream, against the whole reply's reading (`tool_parsers.parse_output`)."""

from __future__ import annotations

import json
import random

from tandem.router.openai.auto_call_streams import HermesCallStream, JsonCallStream
from tandem.router.openai.tool_parsers import parse_output
from tandem.router.openai.tools import parse_tools

NAMES = frozenset({"add", "get_time"})
TOOLS = [{"type": "function", "function": {"name": name}} for name in sorted(NAMES)]
# Content around the blocks; a block whose call names no declared tool (content, as the
# whole reply has it); arguments written as a JSON string; `<` and a tag's start in text.
REPLY = (
    "I'll check. a < b <tool"
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "s": "</tool"}}\n</tool_call>'
    ' then <tool_call>{"name": "nope", "arguments": {}}</tool_call> and\n'
    '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"utc\\"}"}</tool_call> done'
)


def stream_in_pieces(text: str, rng: random.Random, parallel: bool = True, kind=HermesCallStream):
    """Content and {number: (name, joined arguments)} of `text` fed in random pieces."""
    stream = kind(NAMES, parallel)
    content: list[str] = []
    calls: dict[int, list[str]] = {}

    def take(released, pieces):
        content.append(released)
        for piece in pieces:
            if piece.name is not None:
                assert piece.index not in calls, "a call is named once, on its first piece"
                calls[piece.index] = [piece.name, ""]
            calls[piece.index][1] += piece.arguments

    at = 0
    while at < len(text):
        end = at + rng.randint(1, 12)
        take(*stream.feed(text[at:end]))
        at = end
    take(*stream.finish())
    assert stream.num_calls == len(calls)
    return "".join(content), {i: tuple(call) for i, call in calls.items()}


def test_streamed_calls_and_content_are_the_whole_replys():
    plan = parse_tools({"tools": TOOLS, "tool_choice": "auto"})
    whole = parse_output(plan, REPLY)
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [
        ("add", {"a": 1, "s": "</tool"}), ("get_time", {"zone": "utc"})
    ]  # fmt: skip
    rng = random.Random(0)
    for _ in range(300):
        content, calls = stream_in_pieces(REPLY, rng)
        assert calls == {i: (c.name, c.arguments) for i, c in enumerate(whole.calls)}
        # The whole reply strips the content's ends; a stream sends it as it comes.
        assert content.strip() == whole.content
        assert content == (
            'I\'ll check. a < b <tool then <tool_call>{"name": "nope", "arguments": {}}'
            "</tool_call> and\n done"
        )


def test_without_parallel_calls_a_second_declared_call_is_dropped():
    two = ('<tool_call>{"name": "add", "arguments": {}}</tool_call> x '
           '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')  # fmt: skip
    content, calls = stream_in_pieces(two, random.Random(1), parallel=False)
    assert calls == {0: ("add", "{}")} and content == " x "
    plan = parse_tools({"tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": False})
    assert [c.name for c in parse_output(plan, two).calls] == ["add"]


def test_a_block_that_never_closes():
    # A declared call stays the call it began; another is content when the reply ends.
    content, calls = stream_in_pieces(
        'ok <tool_call>{"name": "add", "arguments": {"a"', random.Random(2)
    )
    assert calls == {0: ("add", '{"a"')} and content == "ok "
    content, calls = stream_in_pieces('ok <tool_call>{"name": "nope", "argu', random.Random(3))
    assert calls == {} and content == 'ok <tool_call>{"name": "nope", "argu'
    content, calls = stream_in_pieces("ok <tool_ca", random.Random(4))
    assert calls == {} and content == "ok <tool_ca"


def test_a_block_with_a_list_of_calls():
    listed = ('<tool_call>[{"name": "add", "arguments": {"a": 2}}, '
              '{"name": "get_time", "arguments": {}}]</tool_call>')  # fmt: skip
    content, calls = stream_in_pieces(listed, random.Random(5))
    assert calls == {0: ("add", '{"a": 2}'), 1: ("get_time", "{}")} and content == ""


LLAMA3 = [
    ' {"name": "add", "parameters": {"a": [1, "}"]}}',
    '[{"name": "get_time", "parameters": "{\\"zone\\": \\"utc\\"}"}, '
    '{"parameters": {}, "name": "add"}]',
    '{"answer": 42, "name": "nope"}',
]  # fmt: skip


def test_llama3_json_replies_stream_their_calls():
    plan = parse_tools({"tools": TOOLS, "tool_choice": "auto"})
    rng = random.Random(6)
    for text in LLAMA3:
        whole = parse_output(plan, text)
        for _ in range(100):
            content, calls = stream_in_pieces(text, rng, kind=JsonCallStream)
            assert calls == {i: (c.name, c.arguments) for i, c in enumerate(whole.calls)}
            assert (content or None) == (whole.content if not whole.calls else None)
    assert [c.name for c in parse_output(plan, LLAMA3[1]).calls] == ["get_time", "add"]
    assert parse_output(plan, LLAMA3[2]).content == LLAMA3[2]
