"""`tool_choice: auto` output parsing (Hermes and Llama 3 JSON) and the streamed shape."""

from __future__ import annotations

import json

from tandem.engine.request import FinishReason
from tandem.router.generation_chunk import GenerationChunk
from tandem.router.openai.responses import LogprobsFormatter, ResponseOptions
from tandem.router.openai.tool_parsers import parse_output
from tandem.router.openai.tool_responses import ToolChatResponses
from tandem.router.openai.tools import parse_tools
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


def test_auto_stream_releases_content_and_streams_a_llama3_call(tiny_model_dir):
    formatter = LogprobsFormatter(PromptTokenizer(str(tiny_model_dir)))
    builder = ToolChatResponses(_plan(), "id", "m", 0, formatter, ResponseOptions([[1]]))
    assert builder.chunk(GenerationChunk([1], "hel")) is not None  # clearly content
    builder = ToolChatResponses(_plan(), "id", "m", 0, formatter, ResponseOptions([[1]]))
    assert builder.chunk(GenerationChunk([1], '{"na')) is None  # held: no name yet
    begun = builder.chunk(GenerationChunk([1], 'me": "add", '))["choices"][0]
    assert begun["delta"]["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}
    last = builder.chunk(GenerationChunk([2], '"parameters": {}}', [], FinishReason.STOP))
    choice = last["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["delta"]["tool_calls"] == [{"index": 0, "function": {"arguments": "{}"}}]


def test_a_hermes_call_naming_no_tool_stays_content_beside_one_that_does():
    text = ('keep me <tool_call>{"name": "oops", "arguments": {}}</tool_call> '
            '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')  # fmt: skip
    parsed = parse_output(_plan(), text)
    assert [c.name for c in parsed.calls] == ["add"]
    assert parsed.content == 'keep me <tool_call>{"name": "oops", "arguments": {}}</tool_call>'


def test_auto_stream_sends_content_then_streams_the_calls_that_follow_it(tiny_model_dir):
    """Content streams until a `<tool_call>` may begin; a call in it goes out once its
    name is complete, then its arguments as they grow, joining into the whole
    response's arguments."""
    formatter = LogprobsFormatter(PromptTokenizer(str(tiny_model_dir)))
    pieces = ["Sure! ", "<tool", '_call>{"name": "add", ', '"arguments": {"a": 1}}', "</tool_call>"]
    options = ResponseOptions([[1]], logprobs=True)
    builder = ToolChatResponses(_plan(), "id", "m", 0, formatter, options)
    chunks = [
        builder.chunk(GenerationChunk([i], text, [-0.5], FinishReason.STOP if i == 4 else None))
        for i, text in enumerate(pieces)
    ]
    assert chunks[0]["choices"][0]["delta"] == {"content": "Sure! "}
    assert chunks[1] is None  # held: it may begin a `<tool_call>`
    begun = chunks[2]["choices"][0]
    (entry,) = begun["delta"]["tool_calls"]
    assert entry["id"].startswith("call_")
    assert entry["function"] == {"name": "add", "arguments": ""} and "content" not in begun["delta"]
    assert len(begun["logprobs"]["content"]) == 2  # the held `<tool`'s token too
    assert chunks[3]["choices"][0]["delta"]["tool_calls"] == [
        {"index": 0, "function": {"arguments": '{"a": 1}'}}
    ]
    last = chunks[4]["choices"][0]
    assert last["finish_reason"] == "tool_calls" and last["delta"] == {}
    (call,) = parse_output(_plan(), "".join(pieces)).calls
    assert (call.name, call.arguments) == ("add", '{"a": 1}')
    # A `<` that opens no call is released as content.
    builder = ToolChatResponses(_plan(), "id", "m", 0, formatter, ResponseOptions([[1]]))
    assert builder.chunk(GenerationChunk([1], "a < b"))["choices"][0]["delta"]["content"] == "a < b"
    assert builder.chunk(GenerationChunk([2], " <"))["choices"][0]["delta"]["content"] == " "
    released = builder.chunk(GenerationChunk([3], "= c", [], FinishReason.STOP))
    assert released["choices"][0]["delta"]["content"] == "<= c"
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


REQUIRED_PIECES = ['[{"name"', ': "add", "argu', 'ments": {"a": ', "1}}, ", '{"name": "get_time"',
                   ', "arguments": {', "}}", "]"]  # fmt: skip


def test_required_stream_names_each_call_then_streams_its_arguments(tiny_model_dir):
    formatter = LogprobsFormatter(PromptTokenizer(str(tiny_model_dir)))
    options = ResponseOptions([[1]], logprobs=True)
    builder = ToolChatResponses(_plan("required"), "id", "m", 0, formatter, options)
    last = len(REQUIRED_PIECES) - 1
    chunks = [
        builder.chunk(GenerationChunk([i], text, [-0.5], FinishReason.STOP if i == last else None))
        for i, text in enumerate(REQUIRED_PIECES)
    ]
    assert chunks[0] is None  # held until the first call's name is complete
    first = chunks[1]["choices"][0]
    (entry,) = first["delta"]["tool_calls"]
    assert entry["index"] == 0 and entry["id"].startswith("call_")
    assert entry["function"] == {"name": "add", "arguments": ""}
    assert len(first["logprobs"]["content"]) == 2  # the held token's too
    deltas = [e for c in chunks if c for e in c["choices"][0]["delta"].get("tool_calls", [])]
    assert [e["function"].get("name") for e in deltas if "id" in e] == ["add", "get_time"]
    assert [e["index"] for e in deltas] == [0, 0, 0, 1, 1, 1]
    joined = {
        i: "".join(e["function"]["arguments"] for e in deltas if e["index"] == i) for i in (0, 1)
    }
    assert joined == {0: '{"a": 1}', 1: "{}"}
    # The whole response's arguments are the same text.
    whole = parse_output(_plan("required"), "".join(REQUIRED_PIECES))
    assert [(c.name, c.arguments) for c in whole.calls] == [("add", '{"a": 1}'), ("get_time", "{}")]
    assert chunks[last]["choices"][0]["finish_reason"] == "tool_calls"
    # Every token's logprob went out once.
    assert sum(len(c["choices"][0]["logprobs"]["content"]) for c in chunks if c) == last + 1


def test_required_stream_cut_short_before_a_name_is_content_and_after_it_a_call(tiny_model_dir):
    formatter = LogprobsFormatter(PromptTokenizer(str(tiny_model_dir)))
    builder = ToolChatResponses(_plan("required"), "id", "m", 0, formatter, ResponseOptions([[1]]))
    assert builder.chunk(GenerationChunk([1], '[{"name": "ad')) is None
    cut = builder.chunk(GenerationChunk([2], "d", [], FinishReason.LENGTH))["choices"][0]
    assert cut["delta"] == {"content": '[{"name": "add'} and cut["finish_reason"] == "length"
    assert parse_output(_plan("required"), '[{"name": "add').content == '[{"name": "add'
    builder = ToolChatResponses(_plan("required"), "id", "m", 0, formatter, ResponseOptions([[1]]))
    begun = builder.chunk(GenerationChunk([1], '[{"name": "add", "arguments": {"a'))
    assert begun["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] == '{"a'
    cut = builder.chunk(GenerationChunk([2], '": 2', [], FinishReason.LENGTH))["choices"][0]
    assert cut["delta"]["tool_calls"] == [{"index": 0, "function": {"arguments": '": 2'}}]
    assert cut["finish_reason"] == "length"
