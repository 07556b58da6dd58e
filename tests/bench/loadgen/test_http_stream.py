"""How the OpenAI SSE client turns stream lines into token arrivals (no server)."""

from __future__ import annotations

import json

from tandem.bench.loadgen.clients import ClientConfig
from tandem.bench.loadgen.http_client import HttpClient, _StreamState
from tandem.bench.loadgen.workloads import RequestSpec


def line(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n".encode()


def chunk(text: str, finish: str | None = None, **choice) -> bytes:
    return line({"choices": [{"index": 0, "text": text, "finish_reason": finish, **choice}]})


def test_one_arrival_per_text_chunk_and_usage_gives_the_count():
    state = _StreamState()
    assert not state.feed(chunk("a"), 1.0)
    assert not state.feed(b"\n", 1.0)
    assert not state.feed(chunk(""), 1.5)  # nothing shown yet: no arrival
    assert not state.feed(chunk("bc", "length"), 2.0)
    assert not state.feed(
        line({"choices": [], "usage": {"completion_tokens": 4, "prompt_tokens": 9}}), 2.1
    )
    assert state.feed(line("[DONE]"), 2.2)
    assert state.times == [1.0, 2.0]
    assert (state.usage, state.prompt_usage, state.finish_reason) == (4, 9, "length")
    assert state.error == ""


def test_logprobs_or_token_ids_say_how_many_tokens_a_chunk_carries():
    state = _StreamState()
    state.feed(chunk("ab", logprobs={"tokens": ["a", "b"], "token_logprobs": [0, 0]}), 1.0)
    state.feed(chunk("", logprobs={"tokens": ["\ufffd"], "token_logprobs": [0]}), 1.5)
    state.feed(chunk("xyz", token_ids=[5, 6, 7]), 2.0)
    assert state.times == [1.0, 1.0, 1.5, 2.0, 2.0, 2.0]


def test_error_event_ends_the_stream():
    state = _StreamState()
    state.feed(chunk("a"), 1.0)
    assert state.feed(line({"error": {"message": "worker died", "type": "internal"}}), 1.2)
    assert state.error == "stream error: worker died"
    assert _StreamState().feed(line("{not json"), 0.0)


def test_strict_openai_bodies_leave_out_ignore_eos():
    spec = RequestSpec("r", (11, 12, 13), max_tokens=4)
    loose = HttpClient(ClientConfig("http://127.0.0.1:1", prompt_format="text"))
    strict = HttpClient(
        ClientConfig("http://127.0.0.1:1", prompt_format="text", strict_openai=True)
    )
    assert loose._body(spec)["ignore_eos"] is True
    body = strict._body(spec)
    assert "ignore_eos" not in body
    assert body["prompt"] == spec.prompt_text and body["max_tokens"] == 4
