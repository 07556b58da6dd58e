"""Many concurrent requests mixing sampling features through a 1P + 1D cluster: each
response keeps its own invariants, no worker's engine fails, and the cluster ends idle.

Every prompt goes through the prefill worker (no local prefill), so first tokens are
sampled there and the rest on the decode worker: the hand-off of every feature. Vowels
as stop strings often complete in the first token (a case that once failed the decode
worker's engine, and every request on it). The mix is seeded: the same requests every
run.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from tandem.proto.tandem.v1 import generation_pb2 as gen_pb
from tandem.proto.tandem.v1 import generation_pb2_grpc
from tests.helpers.grpc_calls import public_channel, worker_stats
from tests.helpers.inproc_cluster import InprocCluster, inproc_router_config
from tests.helpers.prompts import make_prompts

pytestmark = pytest.mark.timeout(300)

NUM_REQUESTS = 48
CONCURRENCY = 8
CHOICES = ["alpha", "beta", "gamma delta"]
REGEX = "[0-9]{2,4}-[a-z]{3}"
KINDS = ["stop", "stop_min_tokens", "n", "logprobs", "penalties", "choice", "regex", "cancel"]
WEIGHTS = [4, 2, 1, 1, 1, 1, 1, 1]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path) -> Iterator[InprocCluster]:
    model_dir = str(tiny_model_dir)
    router = replace(inproc_router_config(model_dir), max_local_prefill_tokens=0, max_n=3)
    cluster = InprocCluster(model_dir, router_config=router)
    cluster.start()
    yield cluster
    cluster.stop()


@dataclass
class Outcome:
    texts: dict[int, str] = field(default_factory=dict)
    num_tokens: dict[int, int] = field(default_factory=dict)
    num_logprobs: dict[int, int] = field(default_factory=dict)
    finish: dict[int, str] = field(default_factory=dict)
    cancelled: bool = False


def make_request(rng: random.Random, kind: str, prompt: list[int]) -> gen_pb.GenerateRequest:
    request = gen_pb.GenerateRequest(
        prompt_token_ids=prompt, max_tokens=rng.randint(1, 12),
        temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(1 << 30),
    )  # fmt: skip
    if kind == "stop":  # any vowel: most first tokens hold one
        request.stop.extend("aeiou")
    if kind == "stop_min_tokens":
        request.stop.append(rng.choice("aeiou"))
        request.min_tokens = rng.randint(1, request.max_tokens)
    if kind == "n":
        request.n = rng.randint(2, 3)
    if kind == "logprobs":
        request.logprobs = True
    if kind == "penalties":
        request.presence_penalty, request.frequency_penalty = 0.5, -0.5
        request.repetition_penalty = 1.3
    if kind == "choice":
        request.guided.choice.options.extend(CHOICES)
        request.max_tokens = 20
    if kind == "regex":
        request.guided.regex = REGEX
        request.max_tokens = 30
    return request


async def run_one(stub, request: gen_pb.GenerateRequest, cancel: bool) -> Outcome:
    outcome = Outcome()
    call = stub.Generate(request, timeout=60)
    async for response in call:
        i = response.index
        outcome.texts[i] = outcome.texts.get(i, "") + response.text
        outcome.num_tokens[i] = outcome.num_tokens.get(i, 0) + len(response.token_ids)
        outcome.num_logprobs[i] = outcome.num_logprobs.get(i, 0) + len(response.logprobs)
        if response.finish_reason:
            outcome.finish[i] = gen_pb.FinishReason.Name(response.finish_reason)
        if cancel:
            call.cancel()
            outcome.cancelled = True
            break
    return outcome


async def run_all(endpoint: str, requests: list[tuple[str, gen_pb.GenerateRequest]]):
    limit = asyncio.Semaphore(CONCURRENCY)
    async with public_channel(endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def limited(kind: str, request: gen_pb.GenerateRequest) -> Outcome:
            async with limit:
                return await run_one(stub, request, cancel=kind == "cancel")

        return await asyncio.gather(*(limited(k, r) for k, r in requests))


def check(kind: str, request: gen_pb.GenerateRequest, outcome: Outcome) -> None:
    if outcome.cancelled:
        return
    n = max(1, request.n)
    assert sorted(outcome.finish) == list(range(n)), (kind, outcome)
    for i in range(n):
        text, num_tokens, finish = outcome.texts[i], outcome.num_tokens[i], outcome.finish[i]
        assert 1 <= num_tokens <= request.max_tokens, (kind, outcome)
        stopped = finish == "FINISH_REASON_STOP"
        if request.stop and not request.min_tokens:
            assert not any(stop in text for stop in request.stop), (kind, request.stop, text)
        if request.min_tokens:  # the stop string may stand in the first min_tokens' text
            assert num_tokens >= request.min_tokens, (kind, request.min_tokens, outcome)
            assert not stopped or num_tokens > request.min_tokens, (kind, outcome)
        if request.logprobs:
            assert outcome.num_logprobs[i] == num_tokens, (kind, outcome)
        if request.guided.choice.options and stopped:
            assert text in CHOICES, (kind, text)
        if request.guided.regex and stopped:
            assert re.fullmatch(REGEX, text), (kind, text)


def test_mixed_concurrent_requests_keep_their_invariants(cluster: InprocCluster) -> None:
    rng = random.Random(2026)
    lengths = [rng.randint(5, 80) for _ in range(NUM_REQUESTS)]
    prompts = make_prompts(2048, lengths, seed=17)
    kinds = rng.choices(KINDS, WEIGHTS, k=NUM_REQUESTS)
    requests = [(k, make_request(rng, k, p)) for k, p in zip(kinds, prompts, strict=True)]
    outcomes = cluster.run(run_all(cluster.grpc_endpoint, requests), timeout_s=240)
    for (kind, request), outcome in zip(requests, outcomes, strict=True):
        check(kind, request, outcome)
    stopped_at_first = sum(
        o.finish.get(0) == "FINISH_REASON_STOP" and o.num_tokens[0] == 1
        for (kind, _), o in zip(requests, outcomes, strict=True)
        if kind == "stop"
    )
    assert stopped_at_first >= 3  # first tokens that complete a stop string, on the prefill
    # Both engines still serve (an engine failure closes its worker's loop).
    for worker in cluster.workers:
        stats = worker_stats(worker.endpoint, worker.role, cluster.cluster_auth)
        assert cluster.run(stats).worker_id == worker.worker_id
