"""`tool_choice: auto` output parsing (Hermes and Llama 3 JSON) and the streamed shape."""

from __future__ import annotations

import json

from tandem.engine.request import FinishReason
from tandem.router.openai.responses import LogprobsFormatter, ResponseOptions
from tandem.router.openai.tool_parsers import may_be_tool_call, parse_output
from tandem.router.openai.tool_responses import ToolChatResponses
from tandem.router.openai.tools import parse_tools
from tandem.router.request_flow import GenerationChunk
from tandem.router.tokenization import PromptTokenizer

TOOLS = [
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "add"}},
]


def _plan(choice="auto"):
    plan = parse_tools({"tools": TOOLS, "tool_choice": choice})
    assert plan is not None
    return plan


def test_auto_reads_hermes_and_llama3_calls_and_leaves_other_text_as_content():
    hermes = 'ok <tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'
    parsed = parse_output(_plan(), hermes)
    assert parsed.content == "ok"
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_time", {"zone": "utc"})
    ]
    llama3 = ' {"name": "add", "parameters": {"a": 1}}'
    (call,) = parse_output(_plan(), llama3).calls
    assert (call.name, json.loads(call.arguments)) == ("add", {"a": 1})
    for text in ('{"name": "nope", "parameters": {}}', "plain words", "<tool_call>{bad"):
        parsed = parse_output(_plan(), text)
        assert parsed.calls == [] and parsed.content == text
    assert may_be_tool_call("  <tool_") and may_be_tool_call('{"na')
    assert not may_be_tool_call("hello")


def test_auto_stream_releases_content_and_sends_whole_calls_at_the_end(tiny_model_dir):
    formatter = LogprobsFormatter(PromptTokenizer(str(tiny_model_dir)))
    builder = ToolChatResponses(_plan(), "id", "m", 0, formatter, ResponseOptions([[1]]))
    assert builder.chunk(GenerationChunk([1], "hel")) is not None  # clearly content
    builder = ToolChatResponses(_plan(), "id", "m", 0, formatter, ResponseOptions([[1]]))
    assert builder.chunk(GenerationChunk([1], '{"name": "add", ')) is None  # held back
    last = builder.chunk(GenerationChunk([2], '"parameters": {}}', [], FinishReason.STOP))
    assert last is not None
    choice = last["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "add", "arguments": "{}"}


def test_a_hermes_call_naming_no_tool_stays_content_beside_one_that_does():
    text = ('keep me <tool_call>{"name": "oops", "arguments": {}}</tool_call> '
            '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')  # fmt: skip
    parsed = parse_output(_plan(), text)
    assert [c.name for c in parsed.calls] == ["add"]
    assert parsed.content == 'keep me <tool_call>{"name": "oops", "arguments": {}}</tool_call>'


def test_auto_stream_sends_content_then_the_calls_that_follow_it(tiny_model_dir):
    """Content streams until a `<tool_call>` begins; the calls come whole at the end, as
    the whole response has them (the stream sent the call's text as content)."""
    formatter = LogprobsFormatter(PromptTokenizer(str(tiny_model_dir)))
    pieces = ["Sure! ", "<tool", '_call>{"name": "add", ', '"arguments": {"a": 1}}', "</tool_call>"]
    builder = ToolChatResponses(_plan(), "id", "m", 0, formatter, ResponseOptions([[1]]))
    chunks = [
        builder.chunk(GenerationChunk([i], text, [], FinishReason.STOP if i == 4 else None))
        for i, text in enumerate(pieces)
    ]
    assert chunks[0]["choices"][0]["delta"] == {"content": "Sure! "}
    assert chunks[1:4] == [None, None, None]  # held from the possible `<tool_call>` on
    last = chunks[4]["choices"][0]
    assert last["finish_reason"] == "tool_calls" and "content" not in last["delta"]
    (call,) = last["delta"]["tool_calls"]
    assert call["function"] == {"name": "add", "arguments": '{"a": 1}'}
    # A `<` that opens no call is released as content.
    builder = ToolChatResponses(_plan(), "id", "m", 0, formatter, ResponseOptions([[1]]))
    assert builder.chunk(GenerationChunk([1], "a < b")) is not None
    assert builder.chunk(GenerationChunk([2], " <")) is None
    released = builder.chunk(GenerationChunk([3], "= c", [], FinishReason.STOP))
    assert released["choices"][0]["delta"]["content"] == " <= c"
    assert released["choices"][0]["finish_reason"] == "stop"


def test_named_stream_keeps_the_tokens_of_a_chunk_without_text(tiny_model_dir):
    """A token that ends inside a UTF-8 character has no text yet; its logprob and id
    were dropped from a named call's stream (the whole response had them)."""
    formatter = LogprobsFormatter(PromptTokenizer(str(tiny_model_dir)))
    plan = _plan({"type": "function", "function": {"name": "add"}})
    options = ResponseOptions([[1]], logprobs=True, return_token_ids=True)
    builder = ToolChatResponses(plan, "id", "m", 0, formatter, options)
    first = builder.chunk(GenerationChunk([7], "", [-0.5]))
    assert first is not None
    assert first["choices"][0]["token_ids"] == [7]
    assert [e["logprob"] for e in first["choices"][0]["logprobs"]["content"]] == [-0.5]
    last = builder.chunk(GenerationChunk([8], "{}", [-0.25], FinishReason.STOP))
    assert last["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] == "add"


def test_auto_with_parallel_tool_calls_false_returns_one_call():
    plan = parse_tools({"tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": False})
    assert plan is not None
    two = ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
           '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')  # fmt: skip
    assert [c.name for c in parse_output(plan, two).calls] == ["add"]
    assert [c.name for c in parse_output(_plan(), two).calls] == ["add", "get_time"]
