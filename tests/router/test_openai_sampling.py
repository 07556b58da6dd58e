"""Penalties, logit_bias and echo through a served 1P + 1D cluster, with the official
`openai` client (and `tandem.v1.Generate`, KServe's `sampling_parameters`).

The module's cluster sends every prompt through the prefill worker (no local prefill),
so the first token is chosen there and the rest on the decode worker; a colocated
engine on the same weights is the reference, token for token.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import fields, replace
from pathlib import Path

import grpc
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.engine.config import EngineConfig
from tandem.engine.generate import generate
from tandem.engine.llm_engine import Engine
from tandem.engine.sampling_params import SamplingParams
from tandem.proto.cluster_auth import ClusterAuth, generate_token
from tandem.proto.inference import grpc_service_pb2 as kserve_pb
from tandem.proto.tandem.v1 import generation_pb2 as gen_pb
from tandem.proto.tandem.v1 import generation_pb2_grpc
from tandem.router.errors import InvalidRequest
from tandem.router.kserve_request import parse_request
from tandem.router.tokenization import PromptTokenizer
from tandem.worker.convert import sampling_params_from_proto, sampling_params_to_proto
from tests.helpers.grpc_calls import public_channel, worker_stats
from tests.helpers.hf_reference import LOGPROB_TOLERANCE, hf_prompt_scores
from tests.helpers.inproc_cluster import (
    InprocCluster,
    openai_client,
    shared_router_config,
)
from tests.helpers.kv_budget import TEST_KV_CACHE_BYTES
from tests.helpers.prompts import make_prompts

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 20
PENALTIES = {"presence_penalty": 0.6, "frequency_penalty": 1.1}
REPETITION = 1.3
MAX_N = 4  # the module cluster's --max-n


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path) -> Iterator[InprocCluster]:
    """1P + 1D where every prompt is prefilled by the prefill worker."""
    model_dir = str(tiny_model_dir)
    router = replace(shared_router_config(model_dir), max_local_prefill_tokens=0, max_n=MAX_N)
    cluster = InprocCluster(
        model_dir, router_config=router, cluster_auth=ClusterAuth(token=generate_token())
    )
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def colocated(tiny_model_dir: Path) -> Engine:
    config = EngineConfig(
        model=str(tiny_model_dir),
        num_threads=1,
        max_model_len=1024,
        kv_cache_memory_bytes=TEST_KV_CACHE_BYTES,
    )
    return Engine(config)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> PromptTokenizer:
    return PromptTokenizer(str(tiny_model_dir))


@pytest.fixture
def client(cluster: InprocCluster) -> Iterator[openai.OpenAI]:
    yield from openai_client(cluster.http_endpoint)


PROMPT = make_prompts(2048, (29,), seed=41)[0]
# How soon a closed stream's sequences must have ended and freed their KV: well before
# their 960 tokens each would end on their own (an n=4 stream took 4.6 s whole on a
# 2-core AVX2 EPYC) and the prefill worker's 30 s KV lease, with room for this one-loop
# in-process cluster on a loaded machine (idle 0.12 s after the close there; a 0.3 s
# limit failed once in CI: prefill-0 still held the prompt's KV).
CLOSED_STREAM_FREED_S = 1.0


def colocated_run(engine: Engine, **settings) -> list[int]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **settings)
    (out,) = generate(engine, [PROMPT], params)
    return out.token_ids


def completion_tokens(client: openai.OpenAI, cluster: InprocCluster, **settings) -> list[str]:
    """The greedy completion's tokens (as the API shows them: one string each)."""
    response = client.completions.create(
        model=cluster.router.config.model_name,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        logprobs=0,
        **settings,
    )
    return response.choices[0].logprobs.tokens


def token_texts(tokenizer: PromptTokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.decode([t], skip_special_tokens=False) for t in ids]


def prefix_cache_counts(cluster: InprocCluster, role: str) -> tuple[int, int]:
    """Prompt tokens the `role` worker's engine looked up in its prefix cache, and found."""
    worker = next(w for w in cluster.workers if w.role == role)
    stats = cluster.run(worker_stats(worker.endpoint, role, cluster.cluster_auth))
    return stats.prefix_cache_queries, stats.prefix_cache_hits


def prompt_tokens_prefilled(cluster: InprocCluster) -> int:
    return prefix_cache_counts(cluster, "prefill")[0]


def test_penalties_change_greedy_output_and_equal_a_colocated_run(
    client, cluster, colocated, tokenizer
):
    before = prompt_tokens_prefilled(cluster)
    extra = {"ignore_eos": True, "repetition_penalty": REPETITION}
    penalised = completion_tokens(client, cluster, extra_body=extra, **PENALTIES)
    # The prefill worker chose the first token (disaggregated path).
    assert prompt_tokens_prefilled(cluster) == before + len(PROMPT)
    greedy = completion_tokens(client, cluster, extra_body={"ignore_eos": True})
    expected = colocated_run(colocated, repetition_penalty=REPETITION, **PENALTIES)
    assert penalised == token_texts(tokenizer, expected)
    assert greedy == token_texts(tokenizer, colocated_run(colocated))
    assert penalised != greedy


def test_min_p_keeps_likely_tokens_and_equals_a_colocated_run(
    client, cluster, colocated, tokenizer
):
    """Seeded draws at temperature 2 with min_p 0.3: the same tokens as one engine; each
    chosen token at least 0.3 times as likely (after temperature) as its position's most
    likely one, read from the raw logprobs and top_logprobs through the cluster."""
    temperature, min_p = 2.0, 0.3
    args = dict(
        model=cluster.router.config.model_name, prompt=PROMPT, max_tokens=MAX_TOKENS,
        temperature=temperature, seed=7, logprobs=1,
    )  # fmt: skip
    choice = client.completions.create(**args, extra_body={"ignore_eos": True, "min_p": min_p})
    logprobs = choice.choices[0].logprobs
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert (chosen - max(top.values())) / temperature >= math.log(min_p) - 1e-5
    settings = dict(temperature=temperature, seed=7, min_p=min_p)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **settings)
    (expected,) = generate(colocated, [PROMPT], params)
    assert logprobs.tokens == token_texts(tokenizer, expected.token_ids)
    unfiltered = client.completions.create(**args, extra_body={"ignore_eos": True})
    assert unfiltered.choices[0].logprobs.tokens != logprobs.tokens


def test_top_k_past_the_wire_int32_samples_as_top_k_off(client, cluster, colocated, tokenizer):
    """top_k 2**40 (the API takes any int; the worker wire's top_k is an int32) is served,
    and keeps every token as top_k off does: the same seeded draws as one engine without
    top_k."""
    args = dict(
        model=cluster.router.config.model_name, prompt=PROMPT, max_tokens=MAX_TOKENS,
        temperature=1.0, seed=9, logprobs=0,
    )  # fmt: skip
    choice = client.completions.create(**args, extra_body={"ignore_eos": True, "top_k": 2**40})
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=1.0, seed=9)
    (expected,) = generate(colocated, [PROMPT], params)
    assert choice.choices[0].logprobs.tokens == token_texts(tokenizer, expected.token_ids)
    assert sampling_params_to_proto(SamplingParams(top_k=2**40)).top_k == 2**31 - 1


def test_logit_bias_minus_100_bans_the_greedy_token(client, cluster, colocated, tokenizer):
    greedy = colocated_run(colocated)
    # The token greedy produces first, and the one it repeats most.
    banned = {greedy[0], Counter(greedy).most_common(1)[0][0]}
    bias = {str(t): -100 for t in banned}
    tokens = completion_tokens(client, cluster, logit_bias=bias, extra_body={"ignore_eos": True})
    assert len(tokens) == MAX_TOKENS
    assert not set(tokens) & set(token_texts(tokenizer, sorted(banned)))
    # The same through tandem.v1.Generate, by token id.
    request = gen_pb.GenerateRequest(
        prompt_token_ids=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        ignore_eos=True,
        logit_bias={t: -100.0 for t in banned},
        presence_penalty=PENALTIES["presence_penalty"],
        frequency_penalty=PENALTIES["frequency_penalty"],
        repetition_penalty=REPETITION,
    )
    ids = cluster.run(_generate_ids(cluster.grpc_endpoint, request))
    assert len(ids) == MAX_TOKENS and not set(ids) & banned
    expected = colocated_run(
        colocated,
        logit_bias={t: -100.0 for t in banned},
        repetition_penalty=REPETITION,
        **PENALTIES,
    )
    assert ids == expected


def test_n_choices_come_from_one_prefill(client, cluster, colocated, tokenizer):
    model = cluster.router.config.model_name
    before = prompt_tokens_prefilled(cluster)
    decode_before = prefix_cache_counts(cluster, "decode")
    sampled = client.completions.create(
        model=model, prompt=PROMPT, n=3, max_tokens=8, temperature=1.0, seed=11,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    # One prompt's worth of tokens went through the prefill worker, not three.
    assert prompt_tokens_prefilled(cluster) == before + len(PROMPT)
    # Sequence 0 pulled the KV; 1 and 2 prefilled on the decode worker from its prefix
    # cache (the prompt's full 16-token block; the last block is recomputed), no pull.
    queries, hits = prefix_cache_counts(cluster, "decode")
    assert (queries - decode_before[0], hits - decode_before[1]) == (2 * len(PROMPT), 2 * 16)
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in sampled.choices)
    assert len({c.text for c in sampled.choices}) > 1  # each sequence samples on its own
    assert sampled.usage.completion_tokens == 3 * 8
    assert sampled.usage.prompt_tokens == len(PROMPT)
    # Greedy: every sequence (those sampling their first token on the decode worker
    # too) is the colocated greedy run.
    greedy = client.completions.create(
        model=model, prompt=PROMPT, n=3, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    expected = token_texts(tokenizer, colocated_run(colocated))
    assert [c.logprobs.tokens for c in greedy.choices] == [expected] * 3


def test_n_choices_when_the_first_token_ends_sequence_0(client, cluster, colocated, tokenizer):
    """max_tokens 1: sequence 0 ends at the prefill (no KV held), so sequence 1 leads
    the local starts on the decode worker and sequence 2 follows it."""
    before = prompt_tokens_prefilled(cluster)
    response = client.completions.create(
        model=cluster.router.config.model_name, prompt=PROMPT, n=3, max_tokens=1,
        temperature=0.0, logprobs=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert prompt_tokens_prefilled(cluster) == before + len(PROMPT)
    first = token_texts(tokenizer, colocated_run(colocated))[:1]
    assert [c.logprobs.tokens for c in response.choices] == [first] * 3
    assert [c.finish_reason for c in response.choices] == ["length"] * 3
    assert response.usage.completion_tokens == 3


def test_stop_string_in_the_first_token_ends_the_request_at_the_prefill(client, cluster):
    """The prefill worker's first token completes a stop string: the request ends there
    (`stop`, the text cut before it), unless min_tokens asks for more. Such a request once
    went on to the decode worker, whose engine failed on its next token, and every request
    on that worker with it."""
    args = dict(model=cluster.router.config.model_name, prompt=PROMPT, temperature=0.0,
                extra_body={"ignore_eos": True})  # fmt: skip
    first_text = client.completions.create(**args, max_tokens=1).choices[0].text
    assert first_text.strip(), first_text
    stop = first_text.strip()[-1]
    before = prompt_tokens_prefilled(cluster)
    cut = client.completions.create(**args, max_tokens=8, stop=[stop])
    assert prompt_tokens_prefilled(cluster) == before + len(PROMPT)
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].stop_reason == stop
    assert cut.choices[0].text == first_text[: first_text.index(stop)]
    assert cut.usage.completion_tokens == 1
    # Past min_tokens only: the first token's stop string does not count, nor is it found
    # later; the decode worker goes on (and still serves).
    held_args = {**args, "extra_body": {"ignore_eos": True, "min_tokens": 3}}
    held = client.completions.create(**held_args, max_tokens=8, stop=[stop])
    assert held.usage.completion_tokens > 3
    assert held.choices[0].text.startswith(first_text)
    longer = client.completions.create(**args, max_tokens=8)
    assert longer.choices[0].finish_reason == "length"
    assert longer.choices[0].text.startswith(held.choices[0].text)


def test_stop_reason_names_the_stop_token_id_or_stop_string(client, cluster, colocated):
    """vLLM's stop_reason, decided on the decode worker: the stop token id or stop string
    that ended the choice (whole, and on the streamed finishing chunk only), null when
    it ended by length; chat too."""
    ids = colocated_run(colocated)
    args = dict(model=cluster.router.config.model_name, prompt=PROMPT, temperature=0.0,
                max_tokens=MAX_TOKENS)  # fmt: skip
    free = client.completions.create(**args, extra_body={"ignore_eos": True}).model_dump()
    text = free["choices"][0]["text"]
    assert free["choices"][0]["finish_reason"] == "length"
    assert free["choices"][0]["stop_reason"] is None
    # A token the free run first samples well after the prefill's first one.
    at = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    late = len(text) // 2
    stop = next(
        text[i : i + 3] for i in range(late, len(text) - 3) if text.find(text[i : i + 3]) >= late
    )
    for extra, want in (
        ({"stop_token_ids": [ids[at]]}, ids[at]),
        ({"stop": [stop]}, stop),
    ):
        body = {**args, "extra_body": {"ignore_eos": True, **extra}}
        whole = client.completions.create(**body).model_dump()["choices"][0]
        assert (whole["finish_reason"], whole["stop_reason"]) == ("stop", want)
        chunks = [
            c.model_dump()["choices"][0] for c in client.completions.create(**body, stream=True)
        ]
        assert [c.get("stop_reason", "absent") for c in chunks if c["finish_reason"]] == [want]
        assert all("stop_reason" not in c for c in chunks if not c["finish_reason"])
    chat_args = dict(model=cluster.router.config.model_name, temperature=0.0, max_tokens=12,
                     messages=[{"role": "user", "content": "name three caches"}])  # fmt: skip
    chat_text = client.chat.completions.create(**chat_args).choices[0].message.content
    chat_stop = chat_text[len(chat_text) // 2 :][:2]
    assert chat_stop.strip(), chat_text
    chat = client.chat.completions.create(**chat_args, stop=[chat_stop]).model_dump()
    assert chat["choices"][0]["stop_reason"] == chat_stop
    cluster.assert_idle()


def test_allowed_token_ids_restrict_every_token_as_on_a_colocated_run(
    client, cluster, colocated, tokenizer
):
    """vLLM's allowed_token_ids through the cluster (the prefill worker picks the first
    token, the decode worker the rest): greedy equals the colocated run with the same
    restriction, which the free run's first token is outside of; sampled tokens stay
    inside it too."""
    free = colocated_run(colocated)
    allowed = [t for t in range(5, 60) if t not in free][:6]
    expected = colocated_run(colocated, allowed_token_ids=allowed)
    assert set(expected) <= set(allowed) and expected != free
    args = dict(model=cluster.router.config.model_name, prompt=PROMPT, max_tokens=MAX_TOKENS,
                logprobs=0)  # fmt: skip
    extra = {"ignore_eos": True, "allowed_token_ids": allowed}
    greedy = client.completions.create(**args, temperature=0.0, extra_body=extra)
    assert greedy.choices[0].logprobs.tokens == token_texts(tokenizer, expected)
    sampled = client.completions.create(**args, temperature=1.0, seed=5, extra_body=extra)
    assert set(sampled.choices[0].logprobs.tokens) <= set(token_texts(tokenizer, allowed))
    for bad in ({"allowed_token_ids": [3, 2048]}, {**extra, "guided_regex": "[a-z]+"}):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(**args, extra_body=bad)
        assert info.value.body["param"] == "allowed_token_ids"
    cluster.assert_idle()


def test_bad_words_are_never_generated_as_on_a_colocated_run(client, cluster, colocated, tokenizer):
    """vLLM's bad_words through the cluster: the free greedy run's first two tokens as one
    word (its first token comes from the prefill worker; the decode worker bans the
    second only right after it) and a later token's text as another. Greedy equals the
    colocated run given the router's token sequences, which differs from the free run
    and holds neither word."""
    free = colocated_run(colocated)
    words = [tokenizer.decode(free[:2])]
    sequences = tokenizer.bad_words_token_ids(words)
    assert free[:2] in sequences, sequences
    single = next(
        t for t in free[2:] if [t] in tokenizer.bad_words_token_ids([tokenizer.decode([t])])
    )
    words.append(tokenizer.decode([single]))
    sequences += tokenizer.bad_words_token_ids(words[-1:])
    expected = colocated_run(colocated, bad_words_token_ids=sequences)
    assert expected != free and single not in expected
    assert all(expected[i : i + 2] != free[:2] for i in range(len(expected)))
    args = dict(model=cluster.router.config.model_name, prompt=PROMPT, max_tokens=MAX_TOKENS,
                logprobs=0)  # fmt: skip
    extra = {"ignore_eos": True, "bad_words": words}
    greedy = client.completions.create(**args, temperature=0.0, extra_body=extra)
    assert greedy.choices[0].logprobs.tokens == token_texts(tokenizer, expected)
    for bad in ([""], ["  "], [3], {**extra, "guided_regex": "[a-z]+"}):
        body = bad if isinstance(bad, dict) else {"bad_words": bad}
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(**args, extra_body=body)
        assert info.value.body["param"] == "bad_words"
    cluster.assert_idle()


def test_bad_words_are_banned_alone_and_after_a_space(tokenizer):
    """A word this byte-level BPE tokenizer writes as one token after a space and as
    several alone gets both sequences (vLLM keeps the spaced one only when the lengths
    match, leaving " word" allowed); leading whitespace does not count."""

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    word = next(w for w in ("star", "green", "laugh", "fall") if len(encode(" " + w)) == 1)
    assert len(encode(word)) > 1
    assert tokenizer.bad_words_token_ids([word]) == [encode(word), encode(" " + word)]
    assert tokenizer.bad_words_token_ids(["  " + word]) == [encode(word), encode(" " + word)]


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(
    client, cluster, colocated, tokenizer
):
    """vLLM's truncate_prompt_tokens: the request runs on the prompt's last k tokens
    (usage counts them; echo repeats them); chat truncates its templated prompt."""
    model = cluster.router.config.model_name
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    [expected] = generate(colocated, [PROMPT[-10:]], params)
    extra = {"ignore_eos": True, "truncate_prompt_tokens": 10, "return_token_ids": True}
    args = dict(model=model, prompt=PROMPT, max_tokens=6, temperature=0.0, extra_body=extra)
    whole = client.completions.create(**args).model_dump()
    assert whole["usage"]["prompt_tokens"] == 10
    assert whole["choices"][0]["prompt_token_ids"] == PROMPT[-10:]
    assert whole["choices"][0]["token_ids"] == expected.token_ids
    text = "the paged cache keeps every block of the prompt"
    echoed = client.completions.create(
        model=model, prompt=text, max_tokens=1, echo=True, extra_body={"truncate_prompt_tokens": 3}
    )  # fmt: skip
    last_three = tokenizer.decode(tokenizer.encode(text)[-3:], skip_special_tokens=False)
    assert echoed.choices[0].text.startswith(last_three)
    assert echoed.usage.prompt_tokens == 3
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=1,
        extra_body={"truncate_prompt_tokens": 5},
    )  # fmt: skip
    assert chat.usage.prompt_tokens == 5
    for bad in (0, -2, 1025, "5"):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(
                model=model, prompt=text, max_tokens=1, extra_body={"truncate_prompt_tokens": bad}
            )
        assert info.value.body["param"] == "truncate_prompt_tokens"
    cluster.assert_idle()


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(client, cluster, colocated):
    """vLLM's return_tokens_as_token_ids: every token in logprobs (chosen, alternatives,
    echoed prompt) is "token_id:<id>"; chat's too, its bytes those of that name."""
    ids = colocated_run(colocated)[:4]
    model = cluster.router.config.model_name
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    whole = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, temperature=0.0, logprobs=2, echo=True,
        extra_body=extra,
    ).choices[0].logprobs  # fmt: skip
    assert whole.tokens == [f"token_id:{t}" for t in PROMPT + ids]
    for top in whole.top_logprobs[1:]:
        assert all(key.startswith("token_id:") for key in top) and 2 <= len(top) <= 3
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        temperature=0.0, logprobs=True, top_logprobs=1, extra_body=extra,
    ).choices[0].logprobs.content  # fmt: skip
    for entry in chat:
        assert entry.token.startswith("token_id:") and bytes(entry.bytes) == entry.token.encode()
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen leads


def test_n_choices_stream_with_their_index(client, cluster):
    stream = client.chat.completions.create(
        model=cluster.router.config.model_name,
        messages=[{"role": "user", "content": "name three caches"}],
        n=2, max_tokens=6, temperature=0.8, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    texts = {0: "", 1: ""}
    finished = set()
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert finished == {0, 1}
    assert usage is not None and usage.completion_tokens <= 12


def test_n_stream_closed_early_frees_every_sequence(client, cluster):
    """The client leaves after the first chunk: all n decode calls end, every held KV
    is released, within CLOSED_STREAM_FREED_S."""
    stream = client.completions.create(
        model=cluster.router.config.model_name, prompt=PROMPT, n=MAX_N, max_tokens=960,
        temperature=1.0, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    first = next(iter(stream))
    assert first.choices[0].index in range(MAX_N)
    stream.close()
    cluster.assert_idle(timeout_s=CLOSED_STREAM_FREED_S)


def test_grpc_generate_n_sequences_by_index(cluster, colocated):
    request = gen_pb.GenerateRequest(
        prompt_token_ids=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, n=2
    )
    by_index = cluster.run(_generate_by_index(cluster.grpc_endpoint, request))
    assert by_index == {0: colocated_run(colocated), 1: colocated_run(colocated)}
    request.n = MAX_N + 1
    with pytest.raises(grpc.aio.AioRpcError) as info:
        cluster.run(_generate_by_index(cluster.grpc_endpoint, request))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "n must be <=" in (info.value.details() or "")


def test_n_sequences_are_charged_the_prompt_once(cluster):
    """The decode worker holds the prompt's blocks once for all n sequences (they share
    them through its prefix cache), so the placement charges prompt + n x max_tokens."""
    policy = cluster.router.policy_runtime.policy

    async def charged_blocks() -> int | None:
        request = gen_pb.GenerateRequest(
            request_id="charged", prompt_token_ids=PROMPT, max_tokens=MAX_TOKENS,
            temperature=0.0, ignore_eos=True, n=3,
        )  # fmt: skip
        async with public_channel(cluster.grpc_endpoint) as channel:
            stream = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60)
            num_blocks = None
            async for _ in stream:  # from the first token on, the request is placed
                if num_blocks is None:
                    num_blocks = policy.placement_of("charged").num_decode_blocks
        return num_blocks

    # 29 + 3 x 20 tokens in 16-token blocks (three copies of the prompt would be 10).
    assert cluster.run(charged_blocks()) == -(-(len(PROMPT) + 3 * MAX_TOKENS) // 16) == 6


def test_grpc_refuses_bias_outside_the_vocabulary(cluster):
    request = gen_pb.GenerateRequest(prompt="hi", logit_bias={5000: 1.0})
    with pytest.raises(grpc.aio.AioRpcError) as info:
        cluster.run(_generate_ids(cluster.grpc_endpoint, request))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "logit_bias" in (info.value.details() or "")


def test_echo_returns_the_prompt_then_the_completion(client, cluster):
    args = dict(model=cluster.router.config.model_name, max_tokens=8, temperature=0.0)
    prompt = "the paged cache"
    plain = client.completions.create(prompt=prompt, **args).choices[0].text
    echoed = client.completions.create(prompt=prompt, echo=True, **args).choices[0].text
    assert echoed == prompt + plain
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(prompt=prompt, echo=True, stream=True, **args)
    )
    assert streamed == prompt + plain


def test_echo_with_logprobs_returns_the_prompt_logprobs(client, cluster, tokenizer, tiny_model_dir):
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), torch_dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0, :-1].float()
    expected = logits.log_softmax(-1).gather(1, torch.tensor(PROMPT[1:]).unsqueeze(1))
    args = dict(
        model=cluster.router.config.model_name, prompt=PROMPT, max_tokens=4, temperature=0.0,
        logprobs=0, echo=True,
    )  # fmt: skip
    whole = client.completions.create(**args).choices[0]
    streamed = list(client.completions.create(**args, stream=True))
    for logprobs in (whole.logprobs, streamed[0].choices[0].logprobs):
        assert logprobs.tokens[: len(PROMPT)] == token_texts(tokenizer, PROMPT)
        assert logprobs.token_logprobs[0] is None
        prompt_part = logprobs.token_logprobs[1 : len(PROMPT)]
        assert prompt_part == pytest.approx(expected.squeeze(1).tolist(), **LOGPROB_TOLERANCE)
    assert len(whole.logprobs.tokens) == len(PROMPT) + 4
    assert whole.text == "".join(c.choices[0].text for c in streamed)


def test_echo_with_top_logprobs_ranks_every_prompt_position(
    client, cluster, tokenizer, tiny_model_dir
):
    """What lm-eval's loglikelihood reads (echo, logprobs=k, one token): each prompt
    position's k most likely tokens as transformers ranks them, plus the prompt's own."""
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), torch_dtype=torch.float32)
    with torch.no_grad():
        rows = hf(torch.tensor([PROMPT])).logits[0, :-1].float().log_softmax(-1)
    texts = token_texts(tokenizer, list(range(tokenizer.vocab_size)))
    expected = []
    for row, token_id in zip(rows, PROMPT[1:], strict=True):
        ids = sorted(range(row.shape[0]), key=lambda t: (-row[t].item(), t))[:3]
        want = {texts[t]: row[t].item() for t in ids}
        want.setdefault(texts[token_id], row[token_id].item())
        expected.append(want)
    args = dict(
        model=cluster.router.config.model_name, prompt=PROMPT, max_tokens=1, temperature=0.0,
        logprobs=3, echo=True,
    )  # fmt: skip
    whole = client.completions.create(**args).choices[0].logprobs
    streamed = next(iter(client.completions.create(**args, stream=True))).choices[0].logprobs
    for logprobs in (whole, streamed):
        assert logprobs.top_logprobs[0] is None
        prompt_tops = logprobs.top_logprobs[1 : len(PROMPT)]
        assert len(prompt_tops) == len(expected)
        for top, want in zip(prompt_tops, expected, strict=True):
            assert list(top) == list(want)
            assert list(top.values()) == pytest.approx(list(want.values()), **LOGPROB_TOLERANCE)


def test_echo_with_max_tokens_0_scores_the_prompt_alone(client, cluster, tokenizer, tiny_model_dir):
    """vLLM's echo without generation (lm-eval's loglikelihood request: echo, logprobs,
    max_tokens 0): the prompt's text and logprobs as transformers scores them, no
    generated token, finish_reason length, 0 completion tokens; streamed alike, and for
    a batch of prompts. max_tokens 0 without echo stays refused."""
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), torch_dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0, :-1].float()
    expected = logits.log_softmax(-1).gather(1, torch.tensor(PROMPT[1:]).unsqueeze(1))
    prompt_text = tokenizer.decode(PROMPT, skip_special_tokens=False)
    args = dict(model=cluster.router.config.model_name, prompt=PROMPT, max_tokens=0,
                temperature=0.0, logprobs=1, echo=True)  # fmt: skip
    whole = client.completions.create(**args)
    streamed = list(client.completions.create(**args, stream=True))
    (choice,) = whole.choices
    assert choice.text == prompt_text and choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 0 and whole.usage.prompt_tokens == len(PROMPT)
    assert "".join(c.choices[0].text for c in streamed) == prompt_text
    assert [c.choices[0].finish_reason for c in streamed][-1] == "length"
    for logprobs in (choice.logprobs, streamed[0].choices[0].logprobs):
        assert logprobs.tokens == token_texts(tokenizer, PROMPT)  # the prompt's, no more
        assert logprobs.token_logprobs[0] is None
        got = logprobs.token_logprobs[1:]
        assert got == pytest.approx(expected.squeeze(1).tolist(), **LOGPROB_TOLERANCE)
    batch = client.completions.create(**{**args, "prompt": [PROMPT, PROMPT[:5]]})
    assert [len(c.logprobs.tokens) for c in batch.choices] == [len(PROMPT), 5]
    assert batch.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(**{**args, "echo": False})
    with pytest.raises(openai.BadRequestError, match="'min_tokens' must be <= 0, got 1"):
        client.completions.create(**args, extra_body={"min_tokens": 1})


def assert_prompt_scores(got: list, expected: list, tokenizer: PromptTokenizer) -> None:
    assert len(got) == len(expected) and got[0] is None is expected[0]
    for entries, want in zip(got[1:], expected[1:], strict=True):
        assert list(entries) == list(want)  # the prompt token first, then by rank
        for token_id, (logprob, rank) in want.items():
            entry = entries[token_id]
            assert entry["rank"] == rank
            assert entry["logprob"] == pytest.approx(logprob, **LOGPROB_TOLERANCE)
            text = tokenizer.decode([int(token_id)], skip_special_tokens=False)
            assert entry["decoded_token"] == text


def test_prompt_logprobs_score_each_prompt_token_as_transformers(
    client, cluster, tokenizer, tiny_model_dir
):
    """vLLM's prompt_logprobs through the cluster: per prompt position its token's
    logprob and rank and the k most likely, on every choice of its prompt (a batch, n=2),
    beside echo's own logprobs=1; chat puts the prompt's on the response."""
    prompts = [PROMPT, make_prompts(2048, (9,), seed=43)[0]]
    expected = [hf_prompt_scores(tiny_model_dir, p, 3) for p in prompts]
    assert any(rank > 3 for e in expected[0][1:] for _, rank in e.values())  # some outside
    args = dict(model=cluster.router.config.model_name, prompt=prompts, n=2, max_tokens=2,
                temperature=0.0, logprobs=1, echo=True,
                extra_body={"prompt_logprobs": 3})  # fmt: skip
    choices = client.completions.create(**args).model_dump()["choices"]
    for choice in choices:
        assert_prompt_scores(choice["prompt_logprobs"], expected[choice["index"] // 2], tokenizer)
        # echo keeps its own k: at most 1 alternative + the prompt token per position
        assert max(len(t) for t in choice["logprobs"]["top_logprobs"][1:]) <= 2
    messages = [{"role": "user", "content": "name three caches"}]
    chat = client.chat.completions.create(
        model=cluster.router.config.model_name, messages=messages, max_tokens=2,
        temperature=0.0, extra_body={"prompt_logprobs": 0},
    ).model_dump()  # fmt: skip
    chat_prompt = tokenizer.encode_chat(messages)
    assert_prompt_scores(
        chat["prompt_logprobs"], hf_prompt_scores(tiny_model_dir, chat_prompt, 0), tokenizer
    )
    assert (
        "prompt_logprobs"
        not in client.completions.create(
            model=cluster.router.config.model_name, prompt="hi", max_tokens=1
        ).model_dump()["choices"][0]
    )
    cluster.assert_idle()


def test_bad_prompt_logprobs_get_400(client, cluster):
    model = cluster.router.config.model_name
    before = prompt_tokens_prefilled(cluster)
    for extra, stream, words in (
        ({"prompt_logprobs": 21}, False, "<= 20"),
        ({"prompt_logprobs": -1}, False, ">= 0"),
        ({"prompt_logprobs": "3"}, False, "integer"),
        ({"prompt_logprobs": 1}, True, "'stream' is true"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(
                model=model, prompt="hi", max_tokens=2, stream=stream, extra_body=extra
            )
        assert info.value.body["param"] == "prompt_logprobs"
        assert words in info.value.body["message"], info.value.body["message"]
    assert prompt_tokens_prefilled(cluster) == before


BATCH_TEXT = "the paged cache"


def batch_prompts(tokenizer: PromptTokenizer) -> tuple[list, list[list[int]]]:
    """A batch of three prompts as sent (ids, text, ids) and each one's ids."""
    other = make_prompts(2048, (9,), seed=43)[0]
    return [PROMPT, BATCH_TEXT, other], [PROMPT, tokenizer.encode(BATCH_TEXT), other]


def test_batched_prompts_each_equal_a_colocated_run(client, cluster, colocated, tokenizer):
    """A list of prompts (as lm-eval sends with batch_size > 1): choice p * n + i is
    prompt p's sequence i, each the colocated greedy run of its prompt; usage sums the
    prompts; streamed, the same choices come with their indexes."""
    sent, ids = batch_prompts(tokenizer)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected = [token_texts(tokenizer, out.token_ids) for out in generate(colocated, ids, params)]
    args = dict(
        model=cluster.router.config.model_name, prompt=sent, n=2, max_tokens=MAX_TOKENS,
        temperature=0.0, logprobs=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    whole = client.completions.create(**args)
    assert [c.index for c in whole.choices] == list(range(6))
    assert [c.logprobs.tokens for c in whole.choices] == [e for e in expected for _ in range(2)]
    assert whole.usage.prompt_tokens == sum(len(p) for p in ids)
    assert whole.usage.completion_tokens == 6 * MAX_TOKENS
    texts = dict.fromkeys(range(6), "")
    usage = None
    for chunk in client.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    ):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert list(texts.values()) == [c.text for c in whole.choices]
    assert usage is not None and usage.completion_tokens == 6 * MAX_TOKENS
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    cluster.assert_idle()


def test_batched_prompts_echo_each_its_own_prompt(client, cluster, tokenizer):
    sent, ids = batch_prompts(tokenizer)
    args = dict(model=cluster.router.config.model_name, max_tokens=3, temperature=0.0,
                logprobs=1, echo=True)  # fmt: skip
    batch = client.completions.create(prompt=sent, **args).choices
    streamed = dict.fromkeys(range(3), "")
    for chunk in client.completions.create(prompt=sent, stream=True, **args):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    for p, (prompt, prompt_ids) in enumerate(zip(sent, ids, strict=True)):
        single = client.completions.create(prompt=prompt, **args).choices[0]
        assert batch[p].text == single.text == streamed[p]
        assert batch[p].logprobs.tokens[: len(prompt_ids)] == token_texts(tokenizer, prompt_ids)
        assert batch[p].logprobs.token_logprobs == pytest.approx(
            single.logprobs.token_logprobs, abs=1e-5
        )
    assert batch[1].text.startswith(BATCH_TEXT)


def test_continuous_usage_stats_give_each_choice_its_usage_so_far(client, cluster, tokenizer):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries its choice's
    usage so far (its prompt's tokens, its own tokens), the last chunk the request's."""
    sent, ids = batch_prompts(tokenizer)
    stream = client.completions.create(
        model=cluster.router.config.model_name, prompt=sent[:2], n=2, max_tokens=6,
        temperature=0.9, logprobs=0, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )  # fmt: skip
    counted = dict.fromkeys(range(4), 0)
    chunks = list(stream)
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        counted[choice.index] += len(choice.logprobs.tokens)
        assert chunk.usage.prompt_tokens == len(ids[choice.index // 2])
        assert chunk.usage.completion_tokens == counted[choice.index]
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + counted[choice.index]
    assert counted == dict.fromkeys(range(4), 6)
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == len(ids[0]) + len(ids[1])  # once per prompt
    assert chunks[-1].usage.completion_tokens == 24
    chat = client.chat.completions.create(
        model=cluster.router.config.model_name, messages=[{"role": "user", "content": "hi"}],
        max_tokens=3, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )  # fmt: skip
    usages = [(c.usage.prompt_tokens, c.usage.completion_tokens) for c in chat]
    prompt = usages[0][0]
    assert usages[0] == (prompt, 0)  # the role chunk, before any token
    assert usages[-2][1] == usages[-1][1] == 3
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=cluster.router.config.model_name, prompt="hi", max_tokens=2, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": "yes"},
        )  # fmt: skip
    assert "continuous_usage_stats" in info.value.body["message"]


def test_add_special_tokens_false_leaves_out_the_bos(client, cluster, tokenizer):
    """vLLM's add_special_tokens on completions: false tokenizes a text prompt without
    the tokenizer's BOS, so it runs as the same ids sent without it."""
    args = dict(model=cluster.router.config.model_name, max_tokens=8, temperature=0.0,
                logprobs=0, extra_body={"ignore_eos": True})  # fmt: skip
    with_bos = tokenizer.encode(BATCH_TEXT)
    assert with_bos[0] == tokenizer.tokenizer.bos_token_id
    plain = client.completions.create(
        prompt=BATCH_TEXT,
        **{**args, "extra_body": {"ignore_eos": True, "add_special_tokens": False}},
    )
    as_ids = client.completions.create(prompt=with_bos[1:], **args)
    default = client.completions.create(prompt=BATCH_TEXT, **args)
    assert plain.usage.prompt_tokens == len(with_bos) - 1 == default.usage.prompt_tokens - 1
    assert plain.choices[0].logprobs.tokens == as_ids.choices[0].logprobs.tokens
    assert plain.choices[0].logprobs.token_logprobs != default.choices[0].logprobs.token_logprobs


def test_return_token_ids_gives_prompt_and_output_ids(client, cluster, colocated, tokenizer):
    """vLLM's return_token_ids: each completion choice carries its prompt's ids and its
    own token ids (streamed: the prompt's once, on the choice's first chunk, then each
    chunk's new ids); chat carries the prompt's ids on the response."""
    sent, ids = batch_prompts(tokenizer)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = [out.token_ids for out in generate(colocated, ids[:2], params)]
    extra = {"ignore_eos": True, "return_token_ids": True}
    args = dict(model=cluster.router.config.model_name, prompt=sent[:2], n=2, max_tokens=6,
                temperature=0.0, extra_body=extra)  # fmt: skip
    whole = client.completions.create(**args).model_dump()["choices"]
    assert [c["prompt_token_ids"] for c in whole] == [ids[0], ids[0], ids[1], ids[1]]
    assert [c["token_ids"] for c in whole] == [expected[0]] * 2 + [expected[1]] * 2
    streamed = {i: {"token_ids": [], "prompt_token_ids": []} for i in range(4)}
    for chunk in client.completions.create(**args, stream=True):
        for choice in chunk.model_dump()["choices"]:
            streamed[choice["index"]]["token_ids"] += choice["token_ids"]
            streamed[choice["index"]]["prompt_token_ids"].append(choice.get("prompt_token_ids"))
    for i, choice in streamed.items():
        assert choice["token_ids"] == whole[i]["token_ids"]
        assert choice["prompt_token_ids"][0] == whole[i]["prompt_token_ids"]
        assert not any(choice["prompt_token_ids"][1:])  # the prompt's ids come once
    messages = [{"role": "user", "content": "name three caches"}]
    chat_args = dict(model=cluster.router.config.model_name, messages=messages, max_tokens=4,
                     temperature=0.0, extra_body=extra)  # fmt: skip
    chat = client.chat.completions.create(**chat_args).model_dump()
    assert chat["prompt_token_ids"] == tokenizer.encode_chat(messages)
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"] == 4
    chunks = [c.model_dump() for c in client.chat.completions.create(**chat_args, stream=True)]
    assert chunks[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    stream_ids = [
        t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or []
    ]
    assert stream_ids == chat["choices"][0]["token_ids"]


def test_cache_salt_shares_cached_prefixes_only_within_the_salt(client, cluster, tokenizer):
    """vLLM's cache_salt through the cluster: a salted prompt finds the prefix it cached
    under its own salt and none cached without it or under another salt; the output is
    the same either way. (Every prompt here is prefilled by the prefill worker.)"""
    prompt = make_prompts(2048, (70,), seed=47)[0]
    args = dict(model=cluster.router.config.model_name, prompt=prompt, max_tokens=4,
                temperature=0.0)  # fmt: skip

    def cached(salt: str | None) -> tuple[int, str]:
        extra = {"ignore_eos": True} if salt is None else {"ignore_eos": True, "cache_salt": salt}
        response = client.completions.create(**args, extra_body=extra)
        return response.usage.prompt_tokens_details.cached_tokens, response.choices[0].text

    first, text = cached(None)
    assert first == 0
    assert cached(None) == (64, text)  # 4 full blocks of 16; the last token is recomputed
    assert cached("tenant-a") == (0, text)
    assert cached("tenant-a") == (64, text)
    assert cached("tenant-b") == (0, text)
    # tandem.v1.Generate carries the salt too: tenant-a's blocks, and none of a new salt.
    for salt, want in (("tenant-a", 64), ("tenant-c", 0)):
        request = gen_pb.GenerateRequest(
            prompt_token_ids=prompt, max_tokens=4, temperature=0.0, ignore_eos=True,
            cache_salt=salt,
        )  # fmt: skip
        assert cluster.run(_generate_cached(cluster.grpc_endpoint, request)) == want, salt


def test_a_bad_prompt_in_a_batch_refuses_the_whole_batch(client, cluster):
    model = cluster.router.config.model_name
    before = prompt_tokens_prefilled(cluster)
    too_long = [1] * 1100  # the module cluster's context is 1,024 tokens
    for prompt, param, words in (
        (["fine", []], "prompt[1]", "must not be empty"),
        ([[1, 2], [3, 99999]], "prompt[1]", "99999"),
        (["fine", too_long], "prompt[1]", "maximum context length"),
        (["x"] * 257, "prompt", "at most 256"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=model, prompt=prompt, max_tokens=2)
        assert info.value.body["param"] == param
        assert words in info.value.body["message"]
    assert prompt_tokens_prefilled(cluster) == before  # nothing of any batch ran
    cluster.assert_idle()


def test_batch_stream_closed_early_frees_every_prompt(client, cluster):
    """The client leaves after the first chunk: every prompt's sequences end and their
    KV is released, within CLOSED_STREAM_FREED_S."""
    stream = client.completions.create(
        model=cluster.router.config.model_name, prompt=[PROMPT, "a", "b c"], n=2,
        max_tokens=960, temperature=1.0, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    first = next(iter(stream))
    assert first.choices[0].index in range(6)
    stream.close()
    cluster.assert_idle(timeout_s=CLOSED_STREAM_FREED_S)


def test_bad_sampling_fields_get_400_and_the_server_keeps_serving(client, cluster):
    model = cluster.router.config.model_name
    for bad in (
        {"logit_bias": {"2048": -100}},
        {"logit_bias": {"3": -101}},
        {"presence_penalty": -2.5},
        {"n": MAX_N + 1},
        {"min_p": 1.5},
        {"min_p": "high"},
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=model, prompt="hi", max_tokens=2, extra_body=bad)
        assert info.value.body["param"] == next(iter(bad))
        if "n" in bad:
            assert f"<= {MAX_N}" in info.value.body["message"]
    ok = client.completions.create(model=model, prompt="hi", max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_kserve_sampling_parameters_carry_penalties_and_bias(tokenizer):
    def request(sampling: dict) -> kserve_pb.ModelInferRequest:
        msg = kserve_pb.ModelInferRequest(model_name="tiny")
        text = msg.inputs.add(name="text_input", datatype="BYTES", shape=[1])
        text.contents.bytes_contents.append(b"the cache")
        tensor = msg.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
        tensor.contents.bytes_contents.append(json.dumps(sampling).encode())
        return msg

    params = parse_request(
        request(
            {
                "presence_penalty": "0.5",
                "frequency_penalty": 1,
                "repetition_penalty": 1.2,
                "logit_bias": {"7": -100, "9": "2.5"},
                "min_p": "0.125",
                "include_stop_str_in_output": "true",
                "cache_salt": "tenant-a",
            }
        ),
        tokenizer,
    ).params
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, 1.0)
    assert params.repetition_penalty == 1.2 and params.logit_bias == {7: -100.0, 9: 2.5}
    assert params.min_p == 0.125 and params.include_stop_str_in_output
    assert params.cache_salt == "tenant-a"
    for bad, word in [
        ({"cache_salt": 7}, "cache_salt"),
        ({"cache_salt": "s" * 257}, "cache_salt"),
        ({"logit_bias": {"4096": 1}}, "vocabulary"),
        ({"logit_bias": {"x": 1}}, "token ids"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logit_bias": {"1": 200}}, "logit_bias"),
        ({"min_p": -0.1}, "min_p"),
    ]:
        with pytest.raises(InvalidRequest, match=word):
            parse_request(request(bad), tokenizer)


async def _generate_cached(endpoint: str, request: gen_pb.GenerateRequest) -> int:
    """The prompt tokens a Generate call found in a prefix cache."""
    async with public_channel(endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        async for msg in stub.Generate(request, timeout=60):
            if msg.HasField("usage"):
                return msg.usage.cached_prompt_tokens
    raise AssertionError("no usage in the stream")


async def _generate_ids(endpoint: str, request: gen_pb.GenerateRequest) -> list[int]:
    async with public_channel(endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        ids: list[int] = []
        async for msg in stub.Generate(request, timeout=60):
            ids += msg.token_ids
        return ids


def test_worker_wire_keeps_every_sampling_field():
    params = SamplingParams(
        max_tokens=9, temperature=0.5, top_k=4, top_p=0.75, presence_penalty=-1.5,
        frequency_penalty=0.25, repetition_penalty=1.25, logit_bias={3: -100.0, 7: 2.5},
        allowed_token_ids=[1, 4], bad_words_token_ids=[[5, 6], [7]], num_resumed_tokens=4,
        min_tokens=2, skip_special_tokens=False, seed=3, min_p=0.125, logprobs=True,
        top_logprobs=3, stop=["x"], include_stop_str_in_output=True, stop_token_ids=[2],
        ignore_eos=True, cache_salt="tenant-a", prompt_logprobs=True, prompt_top_logprobs=5,
    )  # fmt: skip
    # Every field set apart from its default, so a field the wire drops fails below
    # (structured outputs cross it in test_grammar_engine.py).
    defaults = SamplingParams()
    unset = [f.name for f in fields(params) if getattr(params, f.name) == getattr(defaults, f.name)]
    assert unset == ["structured"]
    assert sampling_params_from_proto(sampling_params_to_proto(params)) == params
    assert sampling_params_from_proto(sampling_params_to_proto(SamplingParams())) == (
        SamplingParams()
    )


async def _generate_by_index(
    endpoint: str, request: gen_pb.GenerateRequest
) -> dict[int, list[int]]:
    async with public_channel(endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        ids: dict[int, list[int]] = {}
        async for msg in stub.Generate(request, timeout=60):
            ids.setdefault(msg.index, []).extend(msg.token_ids)
        return ids
