"""The OpenAI-compatible HTTP API, driven by the official `openai` client.

On the session's shared in-process cluster (1 prefill + 1 decode worker, router with an
API key); every test ends with the workers back to idle (checked by conftest).
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import openai
import pytest

from tandem.router.openai.protocol import RequestParser
from tandem.router.policy import SloConfig
from tandem.router.tokenization import PromptTokenizer
from tests.helpers.grpc_calls import worker_stats
from tests.helpers.hf_reference import LOGPROB_TOLERANCE, hf_greedy, hf_top_logprobs
from tests.helpers.inproc_cluster import SHARED_API_KEY, InprocCluster, openai_client
from tests.helpers.prompts import make_prompts

API_KEY = SHARED_API_KEY

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path) -> Path:
    """The model the shared `cluster` serves."""
    return tiny_model_dir


@pytest.fixture
def client(cluster: InprocCluster) -> Iterator[openai.OpenAI]:
    yield from openai_client(cluster.http_endpoint)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> PromptTokenizer:
    return PromptTokenizer(str(model_dir))


def model_name(cluster: InprocCluster) -> str:
    return cluster.router.config.model_name


def post(cluster: InprocCluster, path: str, body: dict, key: str | None = API_KEY) -> dict:
    request = urllib.request.Request(
        cluster.http_endpoint + path, data=json.dumps(body).encode(), method="POST"
    )
    request.add_header("Content-Type", "application/json")
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_streamed_completion_has_usage_chunk_and_matches_non_streamed(client, cluster, tokenizer):
    prompt = "the quick brown fox jumps over the lazy dog"
    args = dict(
        model=model_name(cluster),
        prompt=prompt,
        max_tokens=12,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    chunks = list(
        client.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    *token_chunks, usage_chunk = chunks
    assert token_chunks and all(len(c.choices) == 1 for c in token_chunks)
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("cmpl-")
    assert all(c.object == "text_completion" and c.model == model_name(cluster) for c in chunks)
    assert all(c.usage is None for c in token_chunks)
    assert [c.choices[0].finish_reason for c in token_chunks][-1] == "length"
    assert usage_chunk.choices == []
    num_prompt_tokens = len(tokenizer.encode(prompt))
    assert usage_chunk.usage.prompt_tokens == num_prompt_tokens
    assert usage_chunk.usage.completion_tokens == 12
    assert usage_chunk.usage.total_tokens == num_prompt_tokens + 12
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens >= 0

    whole = client.completions.create(**args)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert whole.choices[0].text == "".join(c.choices[0].text for c in token_chunks)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == num_prompt_tokens
    assert whole.usage.completion_tokens == 12


def test_greedy_completion_equals_transformers(client, cluster, model_dir, tokenizer):
    prompts = make_prompts(tokenizer.vocab_size, (5, 90), seed=7)
    expected = hf_greedy(model_dir, prompts, 8)
    for prompt, ref in zip(prompts, expected, strict=True):
        out = client.completions.create(
            model=model_name(cluster), prompt=prompt, max_tokens=8, temperature=0, logprobs=1
        )
        choice = out.choices[0]
        assert choice.text == tokenizer.decode(ref)
        # Per-token strings pin the exact ids, not just the joined text.
        token_text = tokenizer.tokenizer.decode
        assert choice.logprobs.tokens == [token_text([t], skip_special_tokens=False) for t in ref]
        assert len(choice.logprobs.token_logprobs) == len(ref)
        assert all(lp <= 0.0 for lp in choice.logprobs.token_logprobs)
        assert out.usage.prompt_tokens == len(prompt)
        assert out.usage.completion_tokens == len(ref)


def test_top_logprobs_equal_transformers(client, cluster, model_dir, tokenizer):
    """Completions' `logprobs: k` and chat's `top_logprobs: k`, whole and streamed: the k
    most likely tokens at each position, as transformers ranks them."""
    prompt = make_prompts(tokenizer.vocab_size, (30,), seed=8)[0]
    args = dict(
        model=model_name(cluster), max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    whole = client.completions.create(**args, prompt=prompt, logprobs=3).choices[0].logprobs
    streamed = client.completions.create(**args, prompt=prompt, logprobs=3, stream=True)
    streamed_tops = [top for c in streamed for top in c.choices[0].logprobs.top_logprobs]
    text = lambda t: tokenizer.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    [output] = hf_greedy(model_dir, [prompt], 6)
    assert whole.tokens == [text(t) for t in output]
    expected = hf_top_logprobs(model_dir, prompt, output, 3)
    for got in (whole.top_logprobs, streamed_tops):
        assert len(got) == len(expected) == 6
        for top, (ids, logprobs) in zip(got, expected, strict=True):
            assert list(top) == [text(t) for t in ids]  # greedy: the chosen token leads
            assert list(top.values()) == pytest.approx(logprobs, **LOGPROB_TOLERANCE)

    prompt_text = tokenizer.decode(prompt)
    chat = client.chat.completions.create(
        **{**args, "max_tokens": 4}, messages=[{"role": "user", "content": prompt_text}],
        logprobs=True, top_logprobs=5,
    ).choices[0].logprobs.content  # fmt: skip
    chat_ids = post(cluster, "/tokenize", {"messages": [{"role": "user", "content": prompt_text}]})
    [output] = hf_greedy(model_dir, [chat_ids["tokens"]], 4)
    expected = hf_top_logprobs(model_dir, chat_ids["tokens"], output, 5)
    for entry, (ids, logprobs) in zip(chat, expected, strict=True):
        assert [alt.token for alt in entry.top_logprobs] == [text(t) for t in ids]
        assert [alt.logprob for alt in entry.top_logprobs] == pytest.approx(
            logprobs, **LOGPROB_TOLERANCE
        )
        assert entry.top_logprobs[0].logprob == entry.logprob


def test_streamed_chat_starts_with_role_and_ends_with_usage(client, cluster):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "name a river"},
    ]
    args = dict(
        model=model_name(cluster),
        messages=messages,
        max_completion_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    chunks = list(
        client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    *delta_chunks, usage_chunk = chunks
    assert chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert delta_chunks[0].choices[0].delta.role == "assistant"
    assert delta_chunks[-1].choices[0].finish_reason == "length"
    streamed_text = "".join(c.choices[0].delta.content or "" for c in delta_chunks)
    num_prompt_tokens = post(cluster, "/tokenize", {"messages": messages})["count"]
    assert usage_chunk.choices == []
    assert usage_chunk.usage.prompt_tokens == num_prompt_tokens
    assert usage_chunk.usage.completion_tokens == 10

    whole = client.chat.completions.create(**args, logprobs=True, top_logprobs=2)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content == streamed_text
    assert len(whole.choices[0].logprobs.content) == 10
    assert whole.choices[0].logprobs.content[0].top_logprobs[0].token == (
        whole.choices[0].logprobs.content[0].token
    )
    assert whole.usage.prompt_tokens == num_prompt_tokens
    assert whole.usage.completion_tokens == 10


def test_stop_string_cuts_the_text(client, cluster):
    args = dict(model=model_name(cluster), prompt="model token request", temperature=0)
    full = client.completions.create(**args, max_tokens=24, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    assert len(text) > 12, text
    stop = text[8:11]
    cut = client.completions.create(**args, max_tokens=24, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    kept = client.completions.create(
        **args, max_tokens=24, stop=[stop], extra_body={"include_stop_str_in_output": True}
    )
    assert kept.choices[0].text == text[: text.index(stop) + len(stop)]
    assert kept.choices[0].finish_reason == "stop"
    # A stop string that the last allowed token completes: the text ends there, so the
    # finish reason is `stop` (the decode worker's engine sees it; the prefill worker
    # made the first token).
    short = client.completions.create(**args, max_tokens=6, extra_body={"ignore_eos": True})
    last = short.choices[0].text[-2:]
    assert short.choices[0].text.index(last) == len(short.choices[0].text) - 2, short
    ended = client.completions.create(**args, max_tokens=6, stop=[last])
    assert ended.choices[0].text == short.choices[0].text[:-2]
    assert ended.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client, cluster):
    """Repeated: the router may prefill a short prompt on either worker, by load, and the
    draws must not depend on which (tests/engine/test_engine.py covers both paths)."""
    args = dict(
        model=model_name(cluster),
        prompt="the cache",
        max_tokens=16,
        temperature=1.0,
        top_p=0.9,
        seed=1234,
        extra_body={"ignore_eos": True, "top_k": 50},
    )
    texts = [client.completions.create(**args).choices[0].text for _ in range(8)]
    assert texts == texts[:1] * 8
    # A negative (int64) seed is its uint64 two's complement: -1 draws as 2**64 - 1 does.
    negative = client.completions.create(**{**args, "seed": -1}).choices[0].text
    assert negative == client.completions.create(**{**args, "seed": 2**64 - 1}).choices[0].text
    assert negative != texts[0]


def test_an_empty_text_prompt_is_the_bos_alone(client, cluster, model_dir, tokenizer):
    """OpenAI's and vLLM's reading of `prompt: ""`: generation from the start of a
    document, the tokenizer's BOS the whole prompt; without the BOS it is no prompt."""
    bos = tokenizer.encode("")
    assert bos == [tokenizer.tokenizer.bos_token_id]
    assert post(cluster, "/tokenize", {"prompt": ""}) == {
        "tokens": bos, "count": 1, "max_model_len": 1024,
    }  # fmt: skip
    reply = client.completions.create(
        model=model_name(cluster), prompt="", max_tokens=3, temperature=0.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert reply.usage.prompt_tokens == 1 and reply.usage.completion_tokens == 3
    greedy = hf_greedy(model_dir, [bos], 3)[0]
    assert reply.choices[0].text == tokenizer.decode(greedy)
    with pytest.raises(openai.BadRequestError) as refusal:
        client.completions.create(
            model=model_name(cluster), prompt="", max_tokens=3,
            extra_body={"add_special_tokens": False},
        )  # fmt: skip
    assert refusal.value.body["param"] == "prompt"
    assert "encodes to no tokens" in refusal.value.body["message"]


def test_models_and_tokenize(client, cluster, model_dir, tokenizer):
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name(cluster)]
    card = models.data[0].model_dump()
    assert card["object"] == "model" and card["owned_by"] == "tandem"
    assert card["root"] == str(model_dir)
    assert card["max_model_len"] == 1024  # what the workers serve, not the model limit
    assert card["dtype"] == "float32"  # what the workers run (EngineConfig default)
    assert isinstance(card["created"], int)
    assert client.models.retrieve(model_name(cluster)).id == model_name(cluster)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")

    out = post(cluster, "/tokenize", {"prompt": "hello world"})
    assert out == {
        "tokens": tokenizer.encode("hello world"),
        "count": len(tokenizer.encode("hello world")),
        "max_model_len": 1024,
    }
    chat = [{"role": "user", "content": "hi"}]
    assert post(cluster, "/tokenize", {"messages": chat})["tokens"] == tokenizer.encode_chat(chat)
    ids = post(cluster, "/tokenize", {"prompt": "hello world"})["tokens"]
    assert post(cluster, "/detokenize", {"tokens": ids}) == {
        "prompt": tokenizer.decode(ids, skip_special_tokens=False)
    }
    # The template's own variables (vLLM's chat_template_kwargs) reach it; ChatML uses none.
    body = {"messages": chat, "chat_template_kwargs": {"enable_thinking": False}}
    assert post(cluster, "/tokenize", body)["tokens"] == tokenizer.encode_chat(chat)
    # vLLM's add_generation_prompt and return_token_strs.
    body = {"messages": chat, "add_generation_prompt": False, "return_token_strs": True}
    out = post(cluster, "/tokenize", body)
    assert out["tokens"] == tokenizer.encode_chat(chat, add_generation_prompt=False)
    assert out["tokens"] != tokenizer.encode_chat(chat)
    assert out["token_strs"] == tokenizer.token_strs(out["tokens"])
    assert tokenizer.tokenizer.convert_tokens_to_string(out["token_strs"]) == (
        tokenizer.decode(out["tokens"], skip_special_tokens=False)
    )


def test_chat_continues_the_final_assistant_message(client, cluster, tokenizer):
    """vLLM's continue_final_message: the prompt ends inside the last (assistant)
    message, and the reply goes on from there, as a completion of those tokens does."""
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The model"}]
    ids = tokenizer.encode_chat(chat, add_generation_prompt=False, continue_final_message=True)
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith("The model")
    reply = client.chat.completions.create(
        model=model_name(cluster),
        messages=chat,
        max_tokens=8,
        temperature=0,
        extra_body={
            "continue_final_message": True,
            "add_generation_prompt": False,
            "ignore_eos": True,
        },
    )
    assert reply.usage.prompt_tokens == len(ids)
    same = client.completions.create(
        model=model_name(cluster), prompt=ids, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert reply.choices[0].message.content == same.choices[0].text


def test_chat_template_kwargs_are_the_templates_variables(model_dir):
    tokenizer = PromptTokenizer(str(model_dir))
    tokenizer.tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if shout %}!!{% endif %}"
    )
    chat = [{"role": "user", "content": "hi"}]
    assert tokenizer.decode(tokenizer.encode_chat(chat)) == "hi"
    assert tokenizer.decode(tokenizer.encode_chat(chat, None, {"shout": True})) == "hi!!"


def test_tokenize_hands_tools_to_the_template_as_chat_does(model_dir):
    tokenizer = PromptTokenizer(str(model_dir))
    tokenizer.tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% for t in tools or [] %}[{{ t['function']['name'] }}]{% endfor %}"
    )
    parser = RequestParser(tokenizer, "m", SloConfig(), max_n=1)
    chat = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    ids = parser.tokenize({"messages": chat, "tools": tools})
    assert tokenizer.decode(ids) == "hi[get_time]"
    assert ids == parser.chat({"messages": chat, "tools": tools}).prompt_ids


def test_api_key_is_required_and_health_stays_open(client, cluster):
    out = client.completions.create(model=model_name(cluster), prompt="hello", max_tokens=2)
    assert out.choices[0].finish_reason in ("length", "stop")
    wrong = openai.OpenAI(
        base_url=f"{cluster.http_endpoint}/v1", api_key="sk-wrong", max_retries=0, timeout=30
    )
    with pytest.raises(openai.AuthenticationError) as excinfo:
        wrong.completions.create(model=model_name(cluster), prompt="hello", max_tokens=2)
    assert excinfo.value.status_code == 401
    wrong.close()
    with urllib.request.urlopen(cluster.http_endpoint + "/health", timeout=30) as response:
        assert json.loads(response.read())["status"] == "ok"


def _send_completion(cluster: InprocCluster, body: dict) -> socket.socket:
    """A raw HTTP request on its own socket, so the test can hang up at any moment."""
    url = urlsplit(cluster.http_endpoint)
    sock = socket.create_connection((url.hostname, url.port), timeout=60)
    data = json.dumps(body).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\n"
        f"Host: {url.netloc}\r\n"
        f"Authorization: Bearer {API_KEY}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def _long_generation(cluster: InprocCluster, stream: bool) -> dict:
    # 1000 tokens take the tiny model ~0.9 s on CPU: far longer than the 0.3 s the workers
    # get to become idle (a cancelled request frees them in ~10 ms), so only a real
    # cancellation passes.
    return {
        "model": model_name(cluster),
        "prompt": "the",
        "max_tokens": 1000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


@pytest.mark.parametrize("num_events", [1, 4])
def test_client_disconnect_mid_stream_frees_the_workers(cluster, num_events):
    sock = _send_completion(cluster, _long_generation(cluster, stream=True))
    received = b""
    try:
        while received.count(b"data: ") < num_events:
            data = sock.recv(65536)
            assert data, f"stream closed early: {received!r}"
            received += data
    finally:
        sock.close()
    assert received.startswith(b"HTTP/1.1 200"), received[:200]
    assert b"[DONE]" not in received  # the generation was still running
    cluster.assert_idle(timeout_s=0.3)


def test_client_disconnect_during_non_streamed_completion_frees_the_workers(cluster):
    sock = _send_completion(cluster, _long_generation(cluster, stream=False))
    decode = next(w for w in cluster.workers if w.role == "decode")
    try:
        deadline = time.monotonic() + 30
        auth = cluster.cluster_auth
        while not cluster.run(worker_stats(decode.endpoint, decode.role, auth)).num_running:
            assert time.monotonic() < deadline, "the decode worker never started the request"
            time.sleep(0.05)
    finally:
        sock.close()
    cluster.assert_idle(timeout_s=0.3)
