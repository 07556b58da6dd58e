"""Bad HTTP input to the OpenAI API: the right status, OpenAI error JSON, a message that
names the problem, and nothing left running in the cluster afterwards.

Also: router errors (overload, worker failures) map to 429 / 503 / 504, before and
during a stream, checked on an app whose request flow fails on purpose.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer

from tandem.router.config import RouterConfig
from tandem.router.errors import Overloaded, RouterError, WorkerUnavailable, from_worker_error
from tandem.router.generation_chunk import GenerationChunk, Usage
from tandem.router.http_server import make_http_app
from tandem.router.policy import SloConfig
from tandem.router.tokenization import PromptTokenizer
from tests.helpers.inproc_cluster import SHARED_API_KEY, SHARED_MAX_BODY_BYTES, InprocCluster

API_KEY = SHARED_API_KEY
MAX_BODY_BYTES = SHARED_MAX_BODY_BYTES

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path) -> Path:
    """The model the shared `cluster` serves."""
    return tiny_model_dir


def http(
    base_url: str,
    method: str,
    path: str,
    body: Any = None,
    key: str | None = API_KEY,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], Any]:
    """One request; `body` is JSON-encoded unless already bytes (or an iterable of bytes);
    `headers` on top of the JSON content type and the key."""
    if body is None or isinstance(body, (bytes, Iterator)):
        data = body
    else:
        data = json.dumps(body).encode()
    request = urllib.request.Request(base_url + path, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


@dataclass
class Bad:
    """One bad request and what the answer must say."""

    name: str
    body: Any
    status: int
    # Substrings the error message must contain (case-insensitive).
    words: tuple[str, ...]
    path: str = "/v1/completions"
    method: str = "POST"
    key: str | None = API_KEY
    # Expected `param` (checked when not ...).
    param: Any = ...
    code: Any = ...
    extra: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)


def _chunks(total: int) -> Iterator[bytes]:
    """A body sent with chunked transfer encoding (no Content-Length to refuse early)."""
    yield b'{"prompt": "'
    for _ in range(total // 4096):
        yield b"a" * 4096
    yield b'"}'


def _chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], **fields}


def _nested(depth: int) -> dict[str, Any]:
    """An object schema whose property "a" is such a schema, `depth` levels down."""
    schema: dict[str, Any] = {"type": "object", "properties": {}}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


CASES = [
    Bad(
        "empty prompt without the BOS",
        {"prompt": "", "add_special_tokens": False},
        400,
        ("'prompt'", "encodes to no tokens"),
        param="prompt",
    ),
    Bad("empty token ids", {"prompt": []}, 400, ("'prompt'", "must not be empty"), param="prompt"),
    Bad(
        "gzip body that is not gzip",
        b'{"prompt": "hi"}',
        400,
        ("body cannot be read", "gzip"),
        headers={"Content-Encoding": "gzip"},
    ),
    # aiohttp answered these two in plain text from its parser, before any middleware,
    # while their decoders were not installed.
    Bad(
        "zstd body that is not zstd",
        b'{"prompt": "hi"}',
        400,
        ("body cannot be read", "zstd"),
        headers={"Content-Encoding": "zstd"},
    ),
    Bad(
        "br body that is not brotli",
        b"\x8b" * 64,
        400,
        ("body",),
        headers={"Content-Encoding": "br"},
    ),
    Bad("missing prompt", {"max_tokens": 3}, 400, ("'prompt'", "required"), param="prompt"),
    Bad(
        "prompt longer than the context",
        {"prompt": [5] * 2100, "max_tokens": 1},
        400,
        ("2100 tokens", "maximum context length is 1024"),
        param="prompt",
        code="context_length_exceeded",
    ),
    Bad("max_tokens 0", {"prompt": "hi", "max_tokens": 0}, 400, ("'max_tokens'", ">= 1", "0")),
    Bad("max_tokens negative", {"prompt": "hi", "max_tokens": -3}, 400, ("'max_tokens'", "-3")),
    Bad(
        "max_tokens above the limit",
        {"prompt": "hi", "max_tokens": 5000},
        400,
        ("'max_tokens' = 5000", "maximum context length is 1024"),
        param="max_tokens",
        code="context_length_exceeded",
    ),
    Bad(
        "max_tokens and max_completion_tokens disagree",
        {"prompt": "hi", "max_tokens": 3, "max_completion_tokens": 4},
        400,
        ("'max_completion_tokens'", "'max_tokens'"),
    ),
    Bad(
        "negative temperature",
        {"prompt": "hi", "temperature": -0.5},
        400,
        ("'temperature'", "-0.5"),
        param="temperature",
    ),
    Bad(
        "NaN temperature",
        b'{"prompt": "hi", "temperature": NaN}',
        400,
        ("'temperature'", "finite", "nan"),
        param="temperature",
    ),
    Bad(
        "temperature string",
        {"prompt": "hi", "temperature": "hot"},
        400,
        ("'temperature'", "number", '"hot"'),
    ),
    Bad("top_p 0", {"prompt": "hi", "top_p": 0}, 400, ("'top_p'", "(0, 1]", "0"), param="top_p"),
    Bad("top_p 1.5", {"prompt": "hi", "top_p": 1.5}, 400, ("'top_p'", "1.5")),
    Bad("top_p infinite", b'{"prompt": "hi", "top_p": Infinity}', 400, ("'top_p'", "infinity")),
    Bad("top_k -2", {"prompt": "hi", "top_k": -2}, 400, ("'top_k'", "-2")),
    Bad(
        "seed under int64",
        {"prompt": "hi", "seed": -(2**63) - 1},
        400,
        ("'seed'", ">= -9223372036854775808"),
    ),
    Bad(
        "unknown model",
        {"prompt": "hi", "model": "gpt-17"},
        404,
        ("gpt-17", "does not exist"),
        param="model",
        code="model_not_found",
        extra={"type": "invalid_request_error"},
    ),
    Bad("invalid JSON", b'{"prompt": "hi",', 400, ("not valid json",)),
    Bad("empty body", b"", 400, ("empty",)),
    Bad("body is an array", [1, 2], 400, ("json object", "array")),
    Bad(
        "string max_tokens",
        {"prompt": "hi", "max_tokens": "10"},
        400,
        ("'max_tokens'", "integer", '"10"'),
    ),
    Bad("prompt is a dict", {"prompt": {"text": "hi"}}, 400, ("'prompt'", "string", "token ids")),
    Bad(
        "an empty prompt in a batch",
        {"prompt": ["one", []]},
        400,
        ("'prompt[1]'", "must not be empty"),
        param="prompt[1]",
    ),
    Bad("n=0", {"prompt": "hi", "n": 0}, 400, ("'n'", ">= 1"), param="n"),
    Bad(
        "17 stop strings",
        {"prompt": "hi", "stop": [f"s{i}" for i in range(17)]},
        400,
        ("'stop'", "at most 16", "17"),
        param="stop",
    ),
    Bad("empty stop string", {"prompt": "hi", "stop": ["ok", ""]}, 400, ("'stop'", "index 1")),
    Bad(
        "chat's top_logprobs on completions",
        {"prompt": "hi", "logprobs": 2, "top_logprobs": 2},
        400,
        ("'top_logprobs'", "takes 'logprobs'"),
        param="top_logprobs",
    ),
    Bad(
        "stop string over 1,000 characters",
        {"prompt": "hi", "stop": ["ok", "x" * 1001]},
        400,
        ("'stop'", "at most 1000 characters", "1001 at index 1"),
        param="stop",
    ),
    Bad(
        "bad word over 1,000 characters",
        {"prompt": "hi", "bad_words": ["x" * 1001]},
        400,
        ("'bad_words'", "at most 1000 characters", "1001 at index 0"),
        param="bad_words",
    ),
    Bad(
        "token id outside the vocabulary",
        {"prompt": [1, 5, 99999]},
        400,
        ("99999", "index 2", "vocabulary [0, 2048)"),
        param="prompt",
    ),
    Bad("negative token id", {"prompt": [1, -4]}, 400, ("-4", "vocabulary")),
    Bad("token id not an int", {"prompt": [1, "x"]}, 400, ("'prompt'", '"x"')),
    Bad("logprobs too many", {"prompt": "hi", "logprobs": 21}, 400, ("'logprobs'", "<= 20")),
    Bad(
        "stream_options without stream",
        {"prompt": "hi", "stream_options": {"include_usage": True}},
        400,
        ("'stream_options'", "'stream'"),
    ),
    Bad(
        "ignore_eos not a bool",
        {"prompt": "hi", "ignore_eos": "yes"},
        400,
        ("'ignore_eos'", '"yes"'),
    ),
    Bad(
        "presence_penalty out of range",
        {"prompt": "hi", "presence_penalty": 2.5},
        400,
        ("'presence_penalty'", "[-2, 2]", "2.5"),
        param="presence_penalty",
    ),
    Bad(
        "frequency_penalty not a number",
        {"prompt": "hi", "frequency_penalty": "1"},
        400,
        ("'frequency_penalty'", "number"),
        param="frequency_penalty",
    ),
    Bad(
        "repetition_penalty zero",
        {"prompt": "hi", "repetition_penalty": 0},
        400,
        ("'repetition_penalty'", "> 0"),
        param="repetition_penalty",
    ),
    Bad(
        "logit_bias token outside the vocabulary",
        {"prompt": "hi", "logit_bias": {"5": 1, "2048": -100}},
        400,
        ("'logit_bias'", "2048", "vocabulary [0, 2048)"),
        param="logit_bias",
    ),
    Bad(
        "logit_bias value out of range",
        {"prompt": "hi", "logit_bias": {"5": 150}},
        400,
        ("'logit_bias'", "[-100, 100]", "150"),
        param="logit_bias",
    ),
    Bad(
        "logit_bias key not a token id",
        {"prompt": "hi", "logit_bias": {"hello": 1}},
        400,
        ("'logit_bias'", '"hello"'),
        param="logit_bias",
    ),
    *(
        Bad(
            f"logit_bias key {key!r}, which int() takes, not ASCII digits alone",
            {"prompt": "hi", "logit_bias": {key: 1}},
            400,
            ("'logit_bias'", "keys must be token ids"),
            param="logit_bias",
        )
        for key in (" 5", "+5", "5_0", "\u0665", "9" * 5000)
    ),
    Bad("n above the maximum", {"prompt": "hi", "n": 17}, 400, ("'n'", "<= 16"), param="n"),
    Bad(
        "best_of other than n",
        {"prompt": "hi", "best_of": 3},
        400,
        ("'best_of'", "must equal 'n'"),
        param="best_of",
    ),
    Bad(
        "suffix without a FIM model",
        {"prompt": "def f(", "suffix": "return x"},
        400,
        ("'suffix'", "fill-in-the-middle"),
        param="suffix",
    ),
    Bad(
        "oversized body",
        {"prompt": "a" * (MAX_BODY_BYTES + 10)},
        413,
        ("too large", str(MAX_BODY_BYTES)),
        code="request_too_large",
    ),
    Bad(
        "oversized chunked body",
        lambda: _chunks(MAX_BODY_BYTES + 10),
        413,
        ("too large", str(MAX_BODY_BYTES)),
    ),
    Bad("missing API key", {"prompt": "hi"}, 401, ("missing api key", "bearer"), key=None),
    Bad(
        "wrong API key",
        {"prompt": "hi"},
        401,
        ("incorrect api key",),
        key="sk-nope",
        code="invalid_api_key",
    ),
    Bad("unknown route", {"prompt": "hi"}, 404, ("/v1/nothing",), path="/v1/nothing"),
    Bad("wrong method", None, 405, ("get", "/v1/completions", "post"), method="GET"),
    Bad(
        "messages empty",
        {"messages": []},
        400,
        ("'messages'", "empty"),
        path="/v1/chat/completions",
        param="messages",
    ),
    Bad(
        "message with a bad role",
        {"messages": [{"role": "robot", "content": "hi"}]},
        400,
        ("messages[0].role", '"robot"', "'user'"),
        path="/v1/chat/completions",
        param="messages[0].role",
    ),
    Bad(
        "tool message without the id of the call it answers",
        {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "12:00"}]},
        400,
        ("messages[1].tool_call_id", "required"),
        path="/v1/chat/completions",
        param="messages[1].tool_call_id",
    ),
    Bad(
        "message content not text",
        {"messages": [{"role": "user", "content": 42}]},
        400,
        ("messages[0].content", "42"),
        path="/v1/chat/completions",
    ),
    Bad(
        "chat top_logprobs without logprobs",
        _chat(top_logprobs=2),
        400,
        ("'top_logprobs'", "'logprobs': true"),
        path="/v1/chat/completions",
    ),
    Bad(
        "chat logprobs not a bool",
        _chat(logprobs=3),
        400,
        ("'logprobs'", "true or false"),
        path="/v1/chat/completions",
    ),
    Bad(
        "chat tool schema that does not compile",
        _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}]),
        400,
        ("'tools[0].function.parameters'", "not a valid JSON schema"),
        path="/v1/chat/completions",
        param="tools[0].function.parameters",
    ),
    Bad(
        "chat tool schema nested 400 deep",
        _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": _nested(400)}}]),
        400,
        ("'tools[0].function.parameters'", "802 levels deep", "at most 128"),
        path="/v1/chat/completions",
        param="tools[0].function.parameters",
    ),
    Bad(
        "chat max_completion_tokens above the limit",
        _chat(max_completion_tokens=4000),
        400,
        ("'max_completion_tokens' = 4000", "1024"),
        path="/v1/chat/completions",
        param="max_completion_tokens",
    ),
    Bad(
        "vLLM beam search (changes the output; refused, not ignored)",
        {"prompt": "hi", "use_beam_search": True},
        400,
        ("'use_beam_search'", "not supported", "true"),
        param="use_beam_search",
    ),
    Bad(
        "vLLM priority (its scheduler too refuses it unless it runs by priority)",
        {"prompt": "hi", "priority": 1},
        400,
        ("'priority'", "not supported"),
        param="priority",
    ),
    Bad(
        "cache_salt too long",
        {"prompt": "hi", "cache_salt": "s" * 257},
        400,
        ("'cache_salt'", "1 to 256 characters", "257"),
        param="cache_salt",
    ),
    Bad(
        "cache_salt not a string",
        {"prompt": "hi", "cache_salt": 7},
        400,
        ("'cache_salt'", "string"),
        param="cache_salt",
    ),
    Bad(
        "vLLM chat echo",
        _chat(echo=True),
        400,
        ("'echo'", "not supported"),
        path="/v1/chat/completions",
        param="echo",
    ),
    Bad(
        "chat add_special_tokens (the template places them)",
        _chat(add_special_tokens=True),
        400,
        ("'add_special_tokens'", "not supported"),
        path="/v1/chat/completions",
        param="add_special_tokens",
    ),
    Bad(
        "completions add_special_tokens not a bool",
        {"prompt": "hi", "add_special_tokens": "no"},
        400,
        ("'add_special_tokens'", "true or false"),
        param="add_special_tokens",
    ),
    Bad(
        "structured_outputs with an unknown key",
        {"prompt": "hi", "structured_outputs": {"xml": "<a/>"}},
        400,
        ("'structured_outputs.xml'", "json, json_object, regex"),
        param="structured_outputs.xml",
    ),
    Bad(
        "structured_outputs whitespace_pattern (not built)",
        {"prompt": "hi", "structured_outputs": {"json": {}, "whitespace_pattern": " "}},
        400,
        ("'structured_outputs.whitespace_pattern'", "not supported"),
        param="structured_outputs.whitespace_pattern",
    ),
    Bad(
        "structured_outputs beside guided_regex",
        {"prompt": "hi", "guided_regex": "a+", "structured_outputs": {"regex": "b+"}},
        400,
        ("'structured_outputs.regex'", "cannot be combined", "'guided_regex'"),
        param="structured_outputs.regex",
    ),
    Bad(
        "structured_outputs with a broken regex",
        {"prompt": "hi", "structured_outputs": {"regex": "(?<=a)b"}},
        400,
        ("'structured_outputs.regex'",),
        param="structured_outputs.regex",
    ),
    Bad(
        "include_stop_str_in_output not a bool",
        _chat(include_stop_str_in_output=1),
        400,
        ("'include_stop_str_in_output'", "true or false"),
        path="/v1/chat/completions",
        param="include_stop_str_in_output",
    ),
    Bad(
        "vLLM chat_template",
        _chat(chat_template="{{ messages }}"),
        400,
        ("'chat_template'", "not supported"),
        path="/v1/chat/completions",
        param="chat_template",
    ),
    Bad(
        "chat_template_kwargs setting what the server sets",
        _chat(chat_template_kwargs={"tokenize": False, "tools": []}),
        400,
        ("'chat_template_kwargs'", "tokenize", "tools"),
        path="/v1/chat/completions",
        param="chat_template_kwargs",
    ),
    Bad(
        "continue_final_message with the generation prompt",
        _chat(continue_final_message=True, add_generation_prompt=True),
        400,
        ("'continue_final_message'", "add_generation_prompt"),
        path="/v1/chat/completions",
        param="continue_final_message",
    ),
    Bad(
        "continue_final_message after a user message",
        _chat(continue_final_message=True, add_generation_prompt=False),
        400,
        ("'continue_final_message'", "assistant message last", "user"),
        path="/v1/chat/completions",
        param="continue_final_message",
    ),
    Bad(
        "return_token_strs not a bool",
        {"prompt": "hi", "return_token_strs": "yes"},
        400,
        ("'return_token_strs'", "true or false"),
        path="/tokenize",
        param="return_token_strs",
    ),
    Bad(
        "chat_template_kwargs not an object",
        _chat(chat_template_kwargs=["x"]),
        400,
        ("'chat_template_kwargs'", "object"),
        path="/v1/chat/completions",
    ),
    Bad("tokenize with nothing", {}, 400, ("'prompt'", "'messages'"), path="/tokenize"),
    Bad("detokenize with nothing", {}, 400, ("'tokens'", "required"), path="/detokenize"),
    Bad(
        "detokenize outside the vocabulary",
        {"tokens": [1, 4096]},
        400,
        ("'tokens'", "4096", "vocabulary"),
        path="/detokenize",
        param="tokens",
    ),
    Bad("detokenize a string", {"tokens": "hi"}, 400, ("'tokens'", "list"), path="/detokenize"),
    Bad("unknown SLO class", {"prompt": "hi", "slo_class": "gold"}, 400, ("slo_class", "gold")),
    # A lone UTF-16 surrogate (JSON's "\ud800" escape; json.dumps writes one) is not text.
    Bad(
        "lone surrogate in the prompt",
        {"prompt": "a\ud800b"},
        400,
        ("'prompt'", "surrogate"),
        param="prompt",
    ),
    Bad(
        "lone surrogate in the model",
        {"prompt": "hi", "model": "m\udfff"},
        400,
        ("'model'", "surrogate"),
        param="model",
    ),
    Bad(
        "lone surrogate in a stop string",
        {"prompt": "hi", "stop": ["x", "\udc00"]},
        400,
        ("'stop[1]'", "surrogate"),
        param="stop[1]",
    ),
    Bad(
        "lone surrogate in a logit_bias key",
        {"prompt": "hi", "logit_bias": {"\ud800": 1}},
        400,
        ("a key of 'logit_bias'", "surrogate"),
        param="logit_bias",
    ),
    Bad(
        "lone surrogate in a chat message",
        {"messages": [{"role": "user", "content": "hi \ud83d"}]},
        400,
        ("'messages[0].content'", "surrogate"),
        path="/v1/chat/completions",
        param="messages[0].content",
    ),
    Bad(
        "lone surrogate to tokenize",
        {"prompt": "\ud800"},
        400,
        ("'prompt'", "surrogate"),
        path="/tokenize",
        param="prompt",
    ),
    Bad("negative TTFT target", {"prompt": "hi", "ttft_slo_s": -1}, 400, ("ttft",)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_openai_error(cluster: InprocCluster, case: Bad):
    body = case.body() if callable(case.body) else case.body
    status, _, answer = http(
        cluster.http_endpoint, case.method, case.path, body, case.key, case.headers
    )
    assert status == case.status, answer
    assert set(answer) == {"error"}, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["type"], str) and error["type"], error
    message = error["message"].lower()
    for word in case.words:
        assert word.lower() in message, f"{word!r} not in {error['message']!r}"
    if case.param is not ...:
        assert error["param"] == case.param, error
    if case.code is not ...:
        assert error["code"] == case.code, error
    for key, value in case.extra.items():
        assert error[key] == value, error


def test_compressed_bodies_are_read(cluster: InprocCluster):
    """Every Content-Encoding an HTTP client may send (gzip, deflate, br, zstd) is read."""
    import gzip
    import zlib

    import brotli

    try:
        from compression import zstd  # type: ignore[import-not-found]  # Python >= 3.14
    except ImportError:
        from backports import zstd

    plain = json.dumps({"prompt": "hi there"}).encode()
    encoders = {"gzip": gzip.compress, "deflate": zlib.compress, "br": brotli.compress,
                "zstd": zstd.compress}  # fmt: skip
    answers = {}
    for name, encode in encoders.items():
        headers = {"Content-Encoding": name}
        answers[name] = http(
            cluster.http_endpoint, "POST", "/tokenize", encode(plain), headers=headers
        )
    expected = http(cluster.http_endpoint, "POST", "/tokenize", plain)
    assert expected[0] == 200, expected
    for name, (status, _, answer) in answers.items():
        assert (status, answer["tokens"]) == (200, expected[2]["tokens"]), (name, answer)


def test_a_compressed_body_that_decodes_to_nothing_says_so(cluster: InprocCluster):
    """A gzip header and no stream after it: aiohttp reads no bytes; the answer names the
    encoding rather than calling the body empty."""
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    status, _, answer = http(
        cluster.http_endpoint,
        "POST",
        "/v1/completions",
        b"\x1f\x8b\x08\x00garbage",
        headers=headers,
    )
    assert status == 400, answer
    assert 'Content-Encoding: "gzip"' in answer["error"]["message"], answer


def test_escaped_surrogate_pairs_are_text(cluster: InprocCluster):
    """An emoji written as an escaped UTF-16 pair (as an ASCII-only JSON writer does) is
    one character once parsed: accepted, and tokenized as the raw UTF-8 text is."""
    escaped = json.dumps({"prompt": "hi \U0001f600"}).encode()
    assert b"\\ud83d\\ude00" in escaped
    raw = json.dumps({"prompt": "hi \U0001f600"}, ensure_ascii=False).encode()
    answers = [http(cluster.http_endpoint, "POST", "/tokenize", body) for body in (escaped, raw)]
    assert [status for status, _, _ in answers] == [200, 200], answers
    assert answers[0][2]["tokens"] == answers[1][2]["tokens"]


def test_good_request_after_bad_ones_succeeds_and_cluster_is_idle(cluster: InprocCluster):
    # vLLM fields at their no-op values are accepted.
    neutral = {"use_beam_search": False, "length_penalty": 1.0, "bad_words": []}
    body = {"prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True, **neutral}
    status, headers, answer = http(cluster.http_endpoint, "POST", "/v1/completions", body)
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == 4
    assert headers["X-Request-Id"] == answer["id"]
    status, _, answer = http(cluster.http_endpoint, "GET", "/health", key=None)
    assert status == 200 and answer["status"] == "ok"
    cluster.assert_idle()


# --- router errors → HTTP status, on an app whose flow fails on purpose ---------------


class FailingFlow:
    """Stands in for `RequestFlow`: yields `num_chunks` chunks, then raises `error`."""

    def __init__(self, error: RouterError, num_chunks: int) -> None:
        self.error = error
        self.num_chunks = num_chunks
        self.closed = False
        self.slo = SloConfig()

    async def generate(
        self, req_id: str, prompt_ids: list[int], params, slo, n: int = 1
    ) -> AsyncIterator:
        try:
            for _ in range(self.num_chunks):
                yield GenerationChunk([5], "x", usage=Usage(len(prompt_ids)))
            raise self.error
        finally:
            self.closed = True


def _deadline_error() -> RouterError:
    metadata = grpc.aio.Metadata()
    rpc_error = grpc.aio.AioRpcError(
        grpc.StatusCode.DEADLINE_EXCEEDED, metadata, metadata, details="decode took too long"
    )
    return from_worker_error(rpc_error)


async def _call_failing_app(
    model_dir: Path, flow: FailingFlow, body: dict
) -> tuple[int, dict[str, str], str]:
    config = RouterConfig(model_dir=str(model_dir), grpc_port=0, http_port=0)
    app = make_http_app(None, flow, PromptTokenizer(str(model_dir)), config)
    async with TestClient(TestServer(app)) as client:
        response = await client.post("/v1/completions", json=body)
        return response.status, dict(response.headers), await response.text()


@pytest.mark.parametrize(
    ("error", "status", "words"),
    [
        (Overloaded("no worker pair can meet the SLO", retry_after_s=2.5), 429, ("slo",)),
        (WorkerUnavailable("decode worker decode-0 is down"), 503, ("decode-0",)),
        (_deadline_error(), 504, ("deadline_exceeded", "decode took too long")),
    ],
)
def test_router_errors_before_the_stream_map_to_http_status(model_dir, error, status, words):
    for stream in (False, True):
        flow = FailingFlow(error, num_chunks=0)
        body = {"prompt": "hi", "stream": stream}
        got, headers, text = asyncio.run(_call_failing_app(model_dir, flow, body))
        assert got == status, text
        error_json = json.loads(text)["error"]
        assert error_json["type"] == error.openai_type
        assert all(w in error_json["message"].lower() for w in words), error_json
        if status == 429:
            assert headers["Retry-After"] == "3"
        assert flow.closed


def test_router_error_mid_stream_becomes_an_error_event(model_dir):
    flow = FailingFlow(WorkerUnavailable("decode worker decode-0 is down"), num_chunks=2)
    body = {"prompt": "hi", "stream": True}
    status, _, text = asyncio.run(_call_failing_app(model_dir, flow, body))
    assert status == 200
    events = [line[len("data: ") :] for line in text.split("\n\n") if line]
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["x", "x"]
    assert json.loads(events[2])["error"]["message"] == "decode worker decode-0 is down"
    assert events[3:] == ["[DONE]"]
    assert flow.closed


def test_unexpected_error_is_a_500_without_details(model_dir):
    class Broken(FailingFlow):
        async def generate(self, req_id, prompt_ids, params):
            raise RuntimeError("secret internal state")
            yield  # an async generator

    status, _, text = asyncio.run(_call_failing_app(model_dir, Broken(None, 0), {"prompt": "hi"}))
    assert status == 500
    error = json.loads(text)["error"]
    assert error["type"] == "internal_error" and "secret" not in error["message"]


def test_a_long_prompt_being_tokenized_stalls_no_other_request(model_dir):
    """Megabytes of text take seconds to tokenize: on the tokenizer's own thread, so the
    event loop, and with it every other request and stream, goes on meanwhile."""

    async def scenario() -> int:
        config = RouterConfig(model_dir=str(model_dir), grpc_port=0, http_port=0)
        tokenizer = PromptTokenizer(str(model_dir))
        flow = FailingFlow(WorkerUnavailable("no worker in this test"), num_chunks=0)
        app = make_http_app(None, flow, tokenizer, config)
        answered = 0
        try:
            async with TestClient(TestServer(app)) as client:
                body = {"prompt": "a " * 1_500_000}  # 3 MB, under the 8 MiB body limit
                big = asyncio.create_task(client.post("/tokenize", json=body))
                while not big.done():
                    reply = await client.get("/v1/models")
                    assert reply.status == 200
                    answered += 1
                    await asyncio.sleep(0.05)
                response = await big
                assert response.status == 200
                assert (await response.json())["count"] > 1_000_000
        finally:
            tokenizer.close()
        return answered

    # Other requests were answered while the long one was in flight (with the loop
    # blocked, only the one sent before it reached the tokenizer was).
    assert asyncio.run(scenario()) >= 5
