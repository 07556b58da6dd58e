"""Structured outputs and tool calls through a 1P+1D cluster, with the official client.

The tiny model's random weights never produce valid JSON by themselves, so every
response that parses and validates shows the grammar at work; the forced-choice tests
show the mask on both sides of the prefill → decode hand-off.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import jsonschema
import openai
import pytest

from tandem.proto.inference import grpc_service_pb2 as kserve_pb
from tandem.proto.inference import grpc_service_pb2_grpc as kserve_grpc
from tandem.proto.tandem.v1 import generation_pb2 as gen_pb
from tandem.proto.tandem.v1 import generation_pb2_grpc
from tests.helpers.grpc_calls import public_channel_sync
from tests.helpers.inproc_cluster import InprocCluster, openai_client
from tests.helpers.json_schemas import MAX_TOKENS, SCHEMAS

pytestmark = pytest.mark.timeout(600)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "local"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
MESSAGES = [{"role": "user", "content": "the cache block decode worker"}]
UNIQUE = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
# Arrays nested 800 deep: its grammar took the router's tokenizer thread 30-56 s to build.
DEEP = json.loads('{"type": "array", "items": ' * 799 + '{"type": "string"}' + "}" * 799)
UNIQUE_TOOL = {
    "type": "function",
    "function": {"name": "tag", "parameters": {"type": "object", "properties": {"ids": UNIQUE}}},
}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


@pytest.fixture
def client(cluster: InprocCluster) -> Iterator[openai.OpenAI]:
    yield from openai_client(cluster.http_endpoint)


def _model(cluster: InprocCluster) -> str:
    return cluster.router.config.model_name


def test_json_schema_responses_parse_and_validate(client, cluster):
    for i, schema in enumerate(SCHEMAS):
        reply = client.chat.completions.create(
            model=_model(cluster),
            messages=MESSAGES,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"schema_{i}", "schema": schema, "strict": True},
            },
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=i,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (i, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_guided_json_and_json_object_on_completions(client, cluster):
    schema = SCHEMAS[7]
    reply = client.completions.create(
        model=_model(cluster),
        prompt="router latency is the",
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"guided_json": schema},
    )
    jsonschema.validate(json.loads(reply.choices[0].text), schema)
    reply = client.chat.completions.create(
        model=_model(cluster),
        messages=MESSAGES,
        response_format={"type": "json_object"},
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    if reply.choices[0].finish_reason == "stop":  # an open object may be cut by max_tokens
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    assert reply.choices[0].message.content.startswith("{")


def test_response_format_on_completions_constrains_as_guided_json(client, cluster):
    """vLLM takes `response_format` on completions; it was ignored there (200, free text,
    even for a bogus type)."""
    schema = SCHEMAS[7]
    response_format = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    texts = [
        client.completions.create(
            model=_model(cluster), prompt="router latency is the", max_tokens=MAX_TOKENS,
            temperature=0, extra_body=extra,
        ).choices[0].text
        for extra in (
            {"guided_json": schema},
            {"response_format": response_format},
        )
    ]  # fmt: skip
    assert texts[0] == texts[1]
    jsonschema.validate(json.loads(texts[1]), schema)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=_model(cluster), prompt="x", max_tokens=2,
                                  extra_body={"response_format": {"type": "bogus"}})  # fmt: skip
    assert info.value.body["param"] == "response_format.type"


def test_vllm_structured_outputs_object_constrains_like_the_guided_fields(client, cluster):
    """vLLM's newer `structured_outputs` ({"choice": ...}, {"regex": ...}, ...): the same
    constraint as the guided_* field, token for token; `backend` is ignored."""
    for constraint, guided in (
        ({"choice": ["alpha", "beta gamma"]}, {"guided_choice": ["alpha", "beta gamma"]}),
        ({"regex": "[0-9]{2,4}-[a-z]{3}", "backend": "xgrammar"},
         {"guided_regex": "[0-9]{2,4}-[a-z]{3}"}),
        ({"json": SCHEMAS[7]}, {"guided_json": SCHEMAS[7]}),
    ):  # fmt: skip
        args = dict(model=_model(cluster), prompt="router latency is the",
                    max_tokens=MAX_TOKENS, temperature=0)  # fmt: skip
        got = client.completions.create(**args, extra_body={"structured_outputs": constraint})
        want = client.completions.create(**args, extra_body=guided)
        assert got.choices[0].text == want.choices[0].text, constraint
        assert got.choices[0].finish_reason == "stop", got.choices[0].text
    assert got.choices[0].text  # the last one, a JSON document
    jsonschema.validate(json.loads(got.choices[0].text), SCHEMAS[7])


def test_forced_first_token_and_decode_side_continues(client, cluster):
    """A single-option choice makes every token, the prefill worker's first one included,
    the only legal one; the decode worker must resume right after it."""
    option = "decode prefill batch queue"
    for stream in (False, True):
        kwargs = dict(
            model=_model(cluster),
            prompt="the",
            max_tokens=64,
            temperature=1.0,
            extra_body={"guided_choice": [option]},
        )
        if stream:
            text = "".join(
                c.choices[0].text for c in client.completions.create(stream=True, **kwargs)
            )
        else:
            reply = client.completions.create(**kwargs)
            text = reply.choices[0].text
            assert reply.choices[0].finish_reason == "stop"
            assert reply.usage.completion_tokens > 2  # decoded past the prefill's token
        assert text == option
    reply = client.completions.create(
        model=_model(cluster),
        prompt="the",
        max_tokens=32,
        temperature=1.0,
        extra_body={"guided_regex": r"worker-[0-9]{3}(ab|cd)"},
    )
    assert reply.choices[0].finish_reason == "stop"
    assert len(reply.choices[0].text) == 12
    assert reply.choices[0].text.startswith("worker-")


def test_named_tool_choice_returns_valid_arguments(client, cluster):
    named = {"type": "function", "function": {"name": "get_weather"}}
    schema = WEATHER["function"]["parameters"]
    reply = client.chat.completions.create(
        model=_model(cluster),
        messages=MESSAGES,
        tools=[WEATHER, CLOCK],
        tool_choice=named,
        max_tokens=MAX_TOKENS,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's (and vLLM's) for a named function
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), schema)
    # Streamed: the first delta names the call, later ones carry pieces of its arguments.
    chunks = list(
        client.chat.completions.create(
            model=_model(cluster),
            messages=MESSAGES,
            tools=[WEATHER, CLOCK],
            tool_choice=named,
            max_tokens=MAX_TOKENS,
            stream=True,
        )
    )
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert all(d.index == 0 and d.id is None for d in deltas[1:])
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), schema)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_required_tool_choice_calls_declared_tools(client, cluster):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    kwargs = dict(
        model=_model(cluster),
        messages=MESSAGES,
        tools=[WEATHER, CLOCK],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        seed=3,
    )
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    # Streamed (the same seeded draws): the call is named first, then its arguments come
    # in pieces as they are generated, joining into the whole response's text.
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == call.function.name
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert len([d for d in deltas if d.function.arguments]) > 1
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


# Parameters with local definitions and a recursive reference (`#`).
ROUTE = {
    "type": "function",
    "function": {
        "name": "plan_route",
        "parameters": {
            "$defs": {"stop": {"type": "object", "properties": {"city": {"enum": ["a", "b"]}},
                               "required": ["city"], "additionalProperties": False}},
            "type": "object",
            "properties": {"via": {"$ref": "#/$defs/stop"},
                           "then": {"type": "array", "maxItems": 1, "items": {"$ref": "#"}}},
            "required": ["via"],
            "additionalProperties": False,
        },
    },
}  # fmt: skip


def test_required_tool_choice_keeps_each_tools_definitions(client, cluster):
    """Nested in the list of calls, a tool's `#/$defs/...` and `#` references pointed into
    the list's schema: the grammar failed on the worker (200, empty, `abort`)."""
    choice = client.chat.completions.create(
        model=_model(cluster), messages=MESSAGES, tools=[ROUTE, CLOCK], tool_choice="required",
        max_tokens=MAX_TOKENS, seed=5,
    ).choices[0]  # fmt: skip
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (ROUTE, CLOCK)}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_tool_choice_none_and_tool_messages_are_plain_chat(client, cluster):
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"zone": "utc"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    reply = client.chat.completions.create(
        model=_model(cluster), messages=messages, tools=[CLOCK], tool_choice="none", max_tokens=8
    )
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"extra_body": {"guided_json": {"type": "wat"}}}, "guided_json"),
        ({"extra_body": {"guided_regex": r"(?<=a)b"}}, "guided_regex"),
        ({"extra_body": {"guided_grammar": 'root ::= "a" |'}}, "guided_grammar"),
        ({"extra_body": {"guided_choice": []}}, "guided_choice"),
        ({"extra_body": {"guided_json": DEEP}}, "guided_json"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"$ref": "#/x"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        # OpenAI requires the schema's name (and refuses one outside [A-Za-z0-9_-]{1,64}).
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "my schema", "schema": {}},
                }
            },
            "response_format.json_schema.name",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        # Arguments are an object: a tool whose parameters describe a string is refused.
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
        # Keywords a grammar cannot hold (the output broke them: `[2, 2, 3]` for unique
        # items) are refused where the output is constrained ...
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "unique", "schema": UNIQUE},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {"extra_body": {"guided_json": {"properties": {"a": {"not": {"type": "string"}}}}}},
            "guided_json",
        ),
        ({"tools": [UNIQUE_TOOL], "tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [UNIQUE_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "tag"}},
            },
            "tool_choice",
        ),
    ],
)
def test_bad_specs_are_400s_naming_the_field(client, cluster, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=_model(cluster), messages=MESSAGES, max_tokens=4, **kwargs
        )
    assert info.value.body["param"] == param, info.value.body
    # The server keeps serving.
    reply = client.chat.completions.create(model=_model(cluster), messages=MESSAGES, max_tokens=2)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_a_tool_the_model_may_call_freely_may_use_any_keyword(client, cluster):
    """... but not in a tool under `auto`, whose arguments no grammar constrains."""
    reply = client.chat.completions.create(
        model=_model(cluster), messages=MESSAGES, max_tokens=4, tools=[UNIQUE_TOOL]
    )
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


# `auto` replies in the Hermes and the Llama 3 JSON format, and their content.
AUTO_CALL_REPLIES = [
    (r'Sure\. <tool_call>\{"name": "get_time", "arguments": \{"zone": "(utc|local)"\}\}'
     r"</tool_call>", "Sure."),
    (r'\{"name": "get_time", "parameters": \{"zone": "(utc|local)"\}\}', None),
]  # fmt: skip


@pytest.mark.parametrize("regex, content", AUTO_CALL_REPLIES)
def test_auto_streams_a_call_as_it_is_generated(client, cluster, regex, content):
    """An `auto` reply that makes a call (made so here by a regex: the model's weights are
    random): content first, then the call named once its name is complete and its
    arguments in pieces, joining into the whole response's."""
    kwargs = dict(
        model=_model(cluster), messages=MESSAGES, tools=[WEATHER, CLOCK], max_tokens=MAX_TOKENS,
        seed=7, extra_body={"guided_regex": regex},
    )  # fmt: skip
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), CLOCK["function"]["parameters"])
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed.strip() == (content or "")
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_time"
    assert len([d for d in deltas if d.function.arguments]) > 1
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_guided_through_generate_and_kserve(cluster):
    schema = SCHEMAS[6]
    with public_channel_sync(cluster.grpc_endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = gen_pb.GenerateRequest(
            prompt="the",
            max_tokens=MAX_TOKENS,
            guided=gen_pb.GuidedDecoding(json_schema=json.dumps(schema)),
        )
        text = "".join(m.text for m in stub.Generate(request, timeout=60))
        jsonschema.validate(json.loads(text), schema)
        bad = gen_pb.GenerateRequest(prompt="the", guided=gen_pb.GuidedDecoding(regex=r"\bx"))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(bad, timeout=60))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "guided.regex" in info.value.details()

        infer = kserve_grpc.GRPCInferenceServiceStub(channel)
        # vLLM's newer `structured_outputs` object too (it was refused as unknown).
        for constraint in ({"guided_choice": ["yes", "no"]},
                           {"structured_outputs": {"choice": ["yes", "no"]}}):  # fmt: skip
            request = kserve_pb.ModelInferRequest(model_name=_model(cluster))
            sampling = {"max_tokens": 32, **constraint}
            inputs = [("text_input", "the"), ("sampling_parameters", json.dumps(sampling))]
            for name, value in inputs:
                tensor = request.inputs.add(name=name, datatype="BYTES", shape=[1])
                tensor.contents.bytes_contents.append(value.encode())
            response = infer.ModelInfer(request, timeout=60)
            names = [o.name for o in response.outputs]
            text = response.raw_output_contents[names.index("text_output")][4:].decode()
            assert text in ("yes", "no")


def test_every_choice_of_n_follows_the_grammar(client, cluster):
    """n > 1 shares one prefill; the decode side samples sequences 1..n-1's first token
    itself, under the same grammar."""
    options = ["decode prefill", "batch queue", "router"]
    reply = client.completions.create(
        model=_model(cluster),
        prompt="the",
        n=3,
        max_tokens=32,
        temperature=1.0,
        seed=5,
        extra_body={"guided_choice": options},
    )
    assert len(reply.choices) == 3
    for choice in reply.choices:
        assert choice.text in options and choice.finish_reason == "stop"
