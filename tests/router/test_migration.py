"""Request migration and healing against real worker processes killed with -9.

The router is told nothing about a kill: it finds out from the broken streams and its
own polls, as in production, and the test publishes DEAD / a replacement afterwards as
the pool controller would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import urllib.error
import urllib.request

import aiohttp
import grpc
import pytest

from tandem.proto.tandem.v1 import generation_pb2 as gen_pb
from tandem.proto.tandem.v1 import generation_pb2_grpc
from tandem.router.membership import WorkerLifecycle
from tandem.router.openai import streaming
from tandem.worker.config import WorkerRole
from tests.helpers.grpc_calls import (
    assert_workers_idle,
    public_channel,
    start_streams,
    stream_tokens,
    wait_streaming,
)
from tests.helpers.hf_reference import hf_greedy
from tests.helpers.parallel import DISRUPTS_ITS_CLUSTER
from tests.helpers.process_cluster import ProcessCluster
from tests.helpers.prompts import make_prompts

pytestmark = [pytest.mark.timeout(600), DISRUPTS_ITS_CLUSTER]

MAX_TOKENS = 160
# Every other stream of the decode-kill test carries these: after a migration the
# streamed tokens are prompt for the new pair, yet still count as generated.
PENALTIES = {"presence_penalty": 1.5, "frequency_penalty": 1.5}
# The `n > 1` request of the decode-kill test: its prompt is longer than the router's
# `max_local_prefill_tokens` (512), so it takes one prefill on the prefill worker and
# `N_CHOICES` KV handles to one decode worker.
N_CHOICES = 3
FORK_MAX_TOKENS = 96
FORK_PROMPT = make_prompts(2048, (600,), seed=77)[0]


def sampling_of(index: int) -> dict[str, float]:
    return PENALTIES if index % 2 else {}


async def run_all(
    cluster: ProcessCluster,
    prefix: str,
    prompts: list[list[int]],
    max_tokens: int = MAX_TOKENS,
    penalties: bool = False,
) -> list[tuple[list[int], str]]:
    return list(
        await asyncio.gather(
            *(
                stream_tokens(
                    cluster.grpc_endpoint,
                    f"{prefix}-{i}",
                    p,
                    max_tokens=max_tokens,
                    **(sampling_of(i) if penalties else {}),
                )
                for i, p in enumerate(prompts)
            )
        )
    )


async def stream_choices(
    endpoint: str,
    req_id: str,
    prompt: list[int],
    progress: dict[str, int] | None = None,
    first_token: asyncio.Event | None = None,
) -> tuple[list[list[int]], list[str], int]:
    """One greedy `n = N_CHOICES` request over `Generate`: (token ids, text) per choice,
    and the completion tokens of the final usage; `progress[req_id]`: the fewest tokens
    any choice has so far; `first_token` set once any choice has one."""
    tokens: list[list[int]] = [[] for _ in range(N_CHOICES)]
    texts = ["" for _ in range(N_CHOICES)]
    num_completion_tokens = 0
    async with public_channel(endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = gen_pb.GenerateRequest(
            request_id=req_id, prompt_token_ids=prompt, max_tokens=FORK_MAX_TOKENS,
            temperature=0.0, ignore_eos=True, n=N_CHOICES,
        )  # fmt: skip
        async for msg in stub.Generate(request, timeout=120):
            tokens[msg.index] += msg.token_ids
            texts[msg.index] += msg.text
            if msg.HasField("usage"):
                num_completion_tokens = msg.usage.completion_tokens
            if progress is not None:
                progress[req_id] = min(len(t) for t in tokens)
            if first_token is not None and msg.token_ids:
                first_token.set()
    return tokens, texts, num_completion_tokens


@pytest.fixture
def decode_pair(tiny_model_dir):
    roles = {"prefill-0": WorkerRole.PREFILL, "decode-0": WorkerRole.DECODE,
             "decode-1": WorkerRole.DECODE}  # fmt: skip
    cluster = ProcessCluster(str(tiny_model_dir), roles).start()
    yield cluster
    cluster.stop()


def test_kill_decode_worker_mid_stream_continues_every_request(decode_pair):
    """kill -9 of a decode worker with 6 greedy streams and one `n = 3` request in flight
    on 1P + 2D: every stream completes with the tokens and text of an uninterrupted run
    (half of them with presence/frequency penalties, which must count the streamed
    tokens as generated), and each choice of the `n = 3` request, all decoding on the
    victim, migrates on its own (re-prefill on the other pair, tokens already sent kept)
    and ends as an uninterrupted run does."""
    cluster = decode_pair
    prompts = make_prompts(2048, (40, 90, 17, 150, 64, 120), seed=71)
    reference = cluster.run(run_all(cluster, "ref", prompts, penalties=True))
    cluster.assert_idle()

    async def scenario() -> tuple[list[tuple[list[int], str]], tuple, str]:
        progress: dict[str, int] = {}
        # A prompt no worker has cached yet: prefilled on the prefill worker.
        fork = asyncio.ensure_future(
            stream_choices(cluster.grpc_endpoint, "fork", FORK_PROMPT, progress)
        )
        ids = [f"req-{i}" for i in range(len(prompts))]
        sampling = [sampling_of(i) for i in range(len(ids))]
        tasks = await start_streams(cluster.grpc_endpoint, ids, prompts, sampling)
        await wait_streaming(progress, ["fork"])
        policy = cluster.router.policy_runtime.policy
        assert policy.placement_of("fork").prefill_worker_id == "prefill-0"
        victim = policy.placement_of("fork").decode_worker_id
        await asyncio.get_running_loop().run_in_executor(None, cluster.kill, victim)
        return list(await asyncio.gather(*tasks)), await fork, victim

    results, (tokens, texts, num_completion_tokens), victim = cluster.run(scenario(), timeout_s=300)
    assert [r[0] for r in results] == [r[0] for r in reference]
    assert [r[1] for r in results] == [r[1] for r in reference]
    counts = cluster.migrations()
    # Every sequence of the `n = 3` request was decoding on the victim: each one moved.
    assert counts["decode_failed"] >= 1
    assert counts["decode_failed"] + counts["worker_lost"] >= N_CHOICES
    # The controller declares it dead: the router drops it; nothing is left charged.
    cluster.set_state(victim, WorkerLifecycle.DEAD)
    assert victim not in {w.worker_id for w in cluster.router.pool.workers}
    cluster.assert_idle()
    # The uninterrupted `n = 3` run, on the pair that is left.
    uninterrupted = stream_choices(cluster.grpc_endpoint, "fork-ref", FORK_PROMPT)
    ref_tokens, ref_texts, _ = cluster.run(uninterrupted)
    assert [len(t) for t in tokens] == [FORK_MAX_TOKENS] * N_CHOICES
    assert tokens == ref_tokens
    assert texts == ref_texts
    assert num_completion_tokens == N_CHOICES * FORK_MAX_TOKENS
    cluster.assert_idle()


PREFILLS = ("prefill-0", "prefill-1")


def test_kill_prefill_worker_with_queued_prompts(tiny_model_dir):
    """kill -9 of a prefill worker with prompts queued on it (2P + 1D): every request
    completes, token-equal to a run without the kill."""
    roles = {**dict.fromkeys(PREFILLS, WorkerRole.PREFILL), "decode-0": WorkerRole.DECODE}
    # Every prompt goes through a prefill worker.
    cluster = ProcessCluster(str(tiny_model_dir), roles, max_local_prefill_tokens=0).start()
    try:

        async def scenario() -> tuple[str, list[tuple[list[int], str]]]:
            tasks = [
                asyncio.ensure_future(
                    stream_tokens(cluster.grpc_endpoint, f"req-{i}", p, max_tokens=24)
                )
                for i, p in enumerate(new_prompts)
            ]
            policy = cluster.router.policy_runtime.policy

            def queued_on(worker_id: str) -> int:
                return sum(not f.prefilled for f in policy.workers[worker_id].in_flight.values())

            deadline = time.monotonic() + 60
            # Kill a prefill worker while at least two prompts wait for (or are in) prefill
            # there (prefix affinity may have sent most of them to either). Frozen first:
            # the prompts hit its prefix cache, and it could answer them before the kill
            # lands; once frozen, what the router still waits for is lost to the kill.
            while True:
                while (victim := next((w for w in PREFILLS if queued_on(w) >= 2), None)) is None:
                    assert time.monotonic() < deadline, "no prompts queued on a prefill worker"
                    await asyncio.sleep(0.001)
                os.kill(cluster.procs[victim].pid, signal.SIGSTOP)
                await asyncio.sleep(0.3)  # answers sent before the freeze arrive
                if queued_on(victim) >= 1:
                    break
                os.kill(cluster.procs[victim].pid, signal.SIGCONT)
            await asyncio.get_running_loop().run_in_executor(None, cluster.kill, victim)
            return victim, list(await asyncio.gather(*tasks))

        new_prompts = make_prompts(2048, (700, 650, 600, 720, 680, 610, 690, 640), seed=73)
        expected = cluster.run(run_all(cluster, "exp", new_prompts, max_tokens=24))
        cluster.assert_idle()
        # (The prompts hit the prefix caches now; greedy output does not depend on it.)
        victim, results = cluster.run(scenario(), timeout_s=300)
        assert [r[0] for r in results] == [r[0] for r in expected]
        assert cluster.migrations().get("prefill_failed", 0) >= 1
        cluster.set_state(victim, WorkerLifecycle.DEAD)
        cluster.assert_idle()
    finally:
        cluster.stop()


def test_only_decode_worker_killed_gets_503_then_heals(tiny_model_dir):
    """The only decode worker dies: requests get 503 + Retry-After at once; once the
    controller publishes a replacement, requests succeed again with no other action."""
    roles = {"prefill-0": WorkerRole.PREFILL, "decode-0": WorkerRole.DECODE}
    cluster = ProcessCluster(str(tiny_model_dir), roles).start()
    try:
        prompt = make_prompts(2048, (30,), seed=74)[0]
        before, _ = cluster.run(stream_tokens(cluster.grpc_endpoint, "before", prompt))
        cluster.kill("decode-0")
        # Until the router's Stats poll (every 0.25 s) finds it gone: a request placed on
        # it before then may get its first token from the prefill worker, and then waits
        # for a decode worker (test_streams_on_the_only_decode_worker_wait_for_...).
        decode = cluster.router.policy_runtime.policy.workers["decode-0"]
        deadline = time.monotonic() + 10.0
        while decode.available and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not decode.available, "the router did not find decode-0 gone in 10 s"

        async def http_completion() -> tuple[int, dict[str, str], float]:
            body = {"model": cluster.router.config.model_name, "prompt": prompt,
                    "max_tokens": 8, "temperature": 0}  # fmt: skip
            started = time.monotonic()
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    f"{cluster.http_endpoint}/v1/completions",
                    json=body,
                    timeout=aiohttp.ClientTimeout(total=30),
                ) as response,
            ):
                await response.read()
                return response.status, dict(response.headers), time.monotonic() - started

        # Before and after the controller notices (DEAD): 503 + Retry-After, at once.
        for _ in range(2):
            status, headers, elapsed_s = cluster.run(http_completion())
            assert status == 503
            assert int(headers["Retry-After"]) >= 1
            assert elapsed_s < 5.0
        cluster.set_state("decode-0", WorkerLifecycle.DEAD)
        status, headers, _ = cluster.run(http_completion())
        assert status == 503 and "Retry-After" in headers

        async def grpc_status() -> tuple[grpc.StatusCode, str | None]:
            try:
                await stream_tokens(cluster.grpc_endpoint, "down", prompt)
            except grpc.aio.AioRpcError as exc:
                trailers = dict(exc.trailing_metadata() or ())
                return exc.code(), trailers.get("retry-after")
            return grpc.StatusCode.OK, None

        code, retry_after = cluster.run(grpc_status())
        assert code is grpc.StatusCode.UNAVAILABLE and retry_after is not None

        cluster.add("decode-1", WorkerRole.DECODE)
        after, _ = cluster.run(stream_tokens(cluster.grpc_endpoint, "after", prompt))
        assert after == before
        cluster.assert_idle()
    finally:
        cluster.stop()


def test_worker_declared_dead_migrates_its_streams_and_stop_strings_still_cut(decode_pair):
    """The controller declares a live decode worker DEAD (e.g. a drain past its timeout):
    the router ends its streams there and continues them elsewhere; the worker frees
    everything. A stop string met after the switch cuts the text exactly where an
    uninterrupted run does (the router detokenizes the continuation itself)."""
    cluster = decode_pair
    prompts = make_prompts(2048, (50, 70, 90, 110), seed=75)
    plain = cluster.run(run_all(cluster, "plain", prompts))
    # A stop string from late in each output (found after the switch, not before).
    stops = []
    for _, text in plain:
        start = len(text) * 3 // 4
        stop = text[start : start + 3]
        stops.append(stop if stop.strip() and text.find(stop) >= len(text) // 2 else "")

    async def run_with_stops(prefix: str, progress: dict[str, int] | None):
        async with public_channel(cluster.grpc_endpoint) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)

            async def one(i: int) -> tuple[list[int], str, int, str]:
                request = gen_pb.GenerateRequest(
                    request_id=f"{prefix}-{i}",
                    prompt_token_ids=prompts[i],
                    max_tokens=MAX_TOKENS,
                    temperature=0.0,
                    ignore_eos=True,
                    stop=[stops[i]] if stops[i] else [],
                )
                tokens, text, reason, stop = [], "", 0, ""
                async for msg in stub.Generate(request, timeout=180):
                    tokens += msg.token_ids
                    text += msg.text
                    reason = msg.finish_reason or reason
                    stop = msg.stop_string or stop  # vLLM's stop_reason
                    if progress is not None:
                        progress[request.request_id] = len(tokens)
                return tokens, text, reason, stop

            return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))

    expected = cluster.run(run_with_stops("exp", None))
    assert any(r[2] == gen_pb.FINISH_REASON_STOP for r in expected)
    for (_, _, reason, stop), wanted in zip(expected, stops, strict=True):
        assert stop == (wanted if reason == gen_pb.FINISH_REASON_STOP else "")

    async def scenario() -> tuple[list, str]:
        progress: dict[str, int] = {}
        task = asyncio.ensure_future(run_with_stops("req", progress))
        ids = [f"req-{i}" for i in range(len(prompts))]
        await wait_streaming(progress, ids)
        policy = cluster.router.policy_runtime.policy
        on = [policy.placement_of(rid).decode_worker_id for rid in ids]
        victim = max(("decode-0", "decode-1"), key=on.count)
        cluster.states[victim] = WorkerLifecycle.DEAD
        await cluster.router.update_membership(cluster.membership())
        return await task, victim

    results, victim = cluster.run(scenario(), timeout_s=300)
    assert results == expected
    assert cluster.migrations().get("worker_lost", 0) >= 1
    # The worker is alive: the cancelled streams must have freed everything there too.
    proc = cluster.procs[victim]
    cluster.run(assert_workers_idle([(proc.endpoint, "decode")], max_channels=4, timeout_s=10))
    cluster.assert_idle()


def test_past_max_migrations_the_client_gets_one_retriable_error(tiny_model_dir):
    """With migrations off (`max_migrations=0`), a stream whose decode worker dies ends
    with one UNAVAILABLE naming the cause; streams elsewhere are untouched."""
    roles = {"prefill-0": WorkerRole.PREFILL, "decode-0": WorkerRole.DECODE,
             "decode-1": WorkerRole.DECODE}  # fmt: skip
    cluster = ProcessCluster(str(tiny_model_dir), roles, max_migrations=0).start()
    try:
        prompts = make_prompts(2048, (40, 41, 42, 43), seed=76)

        async def scenario() -> tuple[list, str]:
            ids = [f"req-{i}" for i in range(len(prompts))]
            tasks = await start_streams(cluster.grpc_endpoint, ids, prompts)
            policy = cluster.router.policy_runtime.policy
            on = [policy.placement_of(rid).decode_worker_id for rid in ids]
            victim = "decode-0" if "decode-0" in on else "decode-1"
            await asyncio.get_running_loop().run_in_executor(None, cluster.kill, victim)
            results = await asyncio.gather(*tasks, return_exceptions=True)
            return [(w == victim, r) for w, r in zip(on, results, strict=True)], victim

        outcomes, victim = cluster.run(scenario(), timeout_s=300)
        for on_victim, result in outcomes:
            if on_victim:
                assert isinstance(result, grpc.aio.AioRpcError), result
                assert result.code() is grpc.StatusCode.UNAVAILABLE
                assert "after 0 migrations" in result.details()
            else:
                assert len(result[0]) == MAX_TOKENS
        # Every reason is exported from the start, and none was counted.
        assert cluster.migrations() == {"prefill_failed": 0, "decode_failed": 0, "worker_lost": 0}
        cluster.set_state(victim, WorkerLifecycle.DEAD)
        cluster.assert_idle()
    finally:
        cluster.stop()


async def outcome_of_kill(
    cluster: ProcessCluster, worker_id: str, task: asyncio.Future
) -> tuple[BaseException | tuple, float]:
    """kill -9 `worker_id`, then `task`'s result (or exception) and the seconds from just
    before the kill (the router may see it before the kill call returns)."""
    killed_at = time.monotonic()
    await asyncio.get_running_loop().run_in_executor(None, cluster.kill, worker_id)
    (result,) = await asyncio.gather(task, return_exceptions=True)
    return result, time.monotonic() - killed_at


def unavailable_details(result: BaseException | tuple) -> str:
    """The details of a stream that ended with UNAVAILABLE."""
    assert isinstance(result, grpc.aio.AioRpcError), result
    assert result.code() is grpc.StatusCode.UNAVAILABLE
    return result.details() or ""


def test_streams_on_the_only_decode_worker_wait_for_its_replacement(tiny_model_dir):
    """kill -9 of the only decode worker (1P + 1D) with 4 greedy streams in flight: with
    nowhere to move, they wait (`migration_wait_s`) instead of failing; once the
    controller publishes a replacement they continue there, token- and text-equal to an
    uninterrupted run, and every worker ends idle."""
    roles = {"prefill-0": WorkerRole.PREFILL, "decode-0": WorkerRole.DECODE}
    cluster = ProcessCluster(str(tiny_model_dir), roles).start()
    try:
        prompts = make_prompts(2048, (40, 90, 17, 150), seed=78)
        reference = cluster.run(run_all(cluster, "ref", prompts))
        cluster.assert_idle()

        # The replacement's process is up before the kill (published only after it): its
        # start on a loaded machine must not eat into the streams' 60 s migration wait.
        cluster.prepare("decode-1", WorkerRole.DECODE)

        async def scenario() -> tuple[list[tuple[list[int], str]], bool]:
            ids = [f"req-{i}" for i in range(len(prompts))]
            tasks = await start_streams(cluster.grpc_endpoint, ids, prompts)
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, cluster.kill, "decode-0")
            # Long enough for the router to see the broken streams (well under 0.1 s
            # here) and, before this change, to fail them.
            await asyncio.sleep(1.0)
            waited = not any(task.done() for task in tasks)
            await loop.run_in_executor(None, cluster.set_state, "decode-0", WorkerLifecycle.DEAD)
            await loop.run_in_executor(None, cluster.set_state, "decode-1", WorkerLifecycle.SERVING)
            return list(await asyncio.gather(*tasks)), waited

        results, waited = cluster.run(scenario(), timeout_s=300)
        assert waited, "a stream ended while no decode worker was there to move to"
        assert results == reference
        counts = cluster.migrations()
        assert counts["decode_failed"] + counts["worker_lost"] >= len(prompts)
        cluster.assert_idle()
    finally:
        cluster.stop()


def test_a_stream_with_nowhere_to_move_fails_after_migration_wait(tiny_model_dir):
    """The only decode worker dies and no replacement comes: the stream in flight ends
    with one UNAVAILABLE once `migration_wait_s` (1 s here) has passed, not before."""
    roles = {"prefill-0": WorkerRole.PREFILL, "decode-0": WorkerRole.DECODE}
    cluster = ProcessCluster(str(tiny_model_dir), roles, migration_wait_s=1.0).start()
    try:
        prompt = make_prompts(2048, (60,), seed=79)[0]

        async def scenario() -> tuple[BaseException | tuple, float]:
            (task,) = await start_streams(cluster.grpc_endpoint, ["req-0"], [prompt])
            return await outcome_of_kill(cluster, "decode-0", task)

        result, took_s = cluster.run(scenario(), timeout_s=120)
        assert "waited 1 s" in unavailable_details(result)
        assert 1.0 <= took_s < 10.0, took_s
        cluster.set_state("decode-0", WorkerLifecycle.DEAD)
        cluster.assert_idle()
    finally:
        cluster.stop()


def test_the_router_is_ready_while_a_request_can_be_served(tiny_model_dir):
    """Readiness (`/health`, what Kubernetes probes on every router) asks whether a
    request can be served, not whether every worker answers: with one of two decode
    workers frozen (SIGSTOP) /health answers 200 without waiting for the 5 s probe of
    the frozen one, and with it killed and the only prefill worker too the router still
    serves (the decode worker prefills itself), so it stays ready; with the last
    decode worker draining (it takes no new requests) it is not."""
    roles = {"prefill-0": WorkerRole.PREFILL, "decode-0": WorkerRole.DECODE,
             "decode-1": WorkerRole.DECODE}  # fmt: skip
    cluster = ProcessCluster(str(tiny_model_dir), roles).start()
    prompt = make_prompts(2048, (30,), seed=81)[0]

    def health() -> tuple[int, dict, float]:
        started = time.monotonic()
        try:
            with urllib.request.urlopen(f"{cluster.http_endpoint}/health", timeout=30) as reply:
                return reply.status, json.loads(reply.read()), time.monotonic() - started
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read()), time.monotonic() - started

    try:
        assert health()[:2] == (200, {"status": "ok", "workers": 3})
        frozen = cluster.procs["decode-1"].pid
        os.kill(frozen, signal.SIGSTOP)
        try:
            status, body, took_s = health()
        finally:
            os.kill(frozen, signal.SIGCONT)
        # (Not the 5 s the frozen worker's health check may take: the first answer decides.)
        assert (status, body["status"]) == (200, "ok") and took_s < 2.5, took_s
        cluster.kill("decode-1")
        cluster.kill("prefill-0")
        assert health()[:2] == (200, {"status": "ok", "workers": 3})
        tokens, _ = cluster.run(stream_tokens(cluster.grpc_endpoint, "prefilled-locally", prompt))
        assert len(tokens) > 0
        cluster.set_state("decode-0", WorkerLifecycle.DRAINING)
        assert health()[:2] == (503, {"status": "unavailable", "workers": 3})
        cluster.set_state("decode-0", WorkerLifecycle.SERVING)
        for worker_id in ("decode-1", "prefill-0"):
            cluster.set_state(worker_id, WorkerLifecycle.DEAD)
        cluster.assert_idle()
    finally:
        cluster.stop()


def test_an_sse_stream_waiting_for_a_decode_worker_sends_keep_alives(tiny_model_dir, monkeypatch):
    """An OpenAI stream whose only decode worker dies waits `migration_wait_s` (60 s by
    default: many proxies' idle timeout) with nothing to send: it sends `: keep-alive`
    comments meanwhile (every 0.25 s here), then the error event and [DONE]."""
    monkeypatch.setattr(streaming, "KEEPALIVE_S", 0.25)
    roles = {"prefill-0": WorkerRole.PREFILL, "decode-0": WorkerRole.DECODE}
    cluster = ProcessCluster(str(tiny_model_dir), roles, migration_wait_s=2.0).start()
    try:
        prompt = make_prompts(2048, (60,), seed=80)[0]
        body = {"model": cluster.router.config.model_name, "prompt": prompt, "max_tokens": 400,
                "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip

        async def scenario() -> list[bytes]:
            lines: list[bytes] = []
            timeout = aiohttp.ClientTimeout(total=60)
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.post(f"{cluster.http_endpoint}/v1/completions", json=body) as response,
            ):
                assert response.status == 200
                killing = None
                async for line in response.content:
                    if line.strip():
                        lines.append(line.strip())
                    if len(lines) == 4 and killing is None:  # streaming: kill its worker
                        killing = asyncio.get_running_loop().run_in_executor(
                            None, cluster.kill, "decode-0"
                        )
                assert killing is not None
                await killing
            return lines

        lines = cluster.run(scenario(), timeout_s=120)
        assert lines[-1] == b"data: [DONE]"
        assert b'"server_error"' in lines[-2] and b"waited 2 s" in lines[-2], lines[-2]
        # After the last token: only keep-alives while it waited (2 s: about 8).
        last_token = max(i for i, line in enumerate(lines[:-2]) if b'"text"' in line)
        waiting = lines[last_token + 1 : -2]
        assert set(waiting) == {b": keep-alive"} and len(waiting) >= 4, waiting
        cluster.set_state("decode-0", WorkerLifecycle.DEAD)
        cluster.assert_idle()
    finally:
        cluster.stop()


def test_every_choice_of_a_streaming_n_request_waits_for_a_decode_worker(tiny_model_dir):
    """`n = 3` on 1P + 1D: the prefill worker's first token reaches the client while the
    only decode worker is frozen (SIGSTOP), before the other choices have a token; then
    it is killed. Every choice waits for the replacement and the request completes as an
    uninterrupted run (transformers' greedy tokens: a reference run through the cluster
    would leave the prompt in the decode worker's prefix cache, and the router would then
    prefill it there). Before, the choices without tokens of their own got 503 at once,
    which ended the stream the client was reading (chaos probe: HTTP 200, one token,
    then an error event)."""
    (want,) = hf_greedy(tiny_model_dir, [FORK_PROMPT], FORK_MAX_TOKENS)
    roles = {"prefill-0": WorkerRole.PREFILL, "decode-0": WorkerRole.DECODE}
    cluster = ProcessCluster(str(tiny_model_dir), roles).start()
    frozen = cluster.procs["decode-0"].pid
    try:
        cluster.prepare("decode-1", WorkerRole.DECODE)  # published after the kill

        async def scenario() -> tuple[tuple, bool]:
            loop = asyncio.get_running_loop()
            os.kill(frozen, signal.SIGSTOP)
            first_token = asyncio.Event()
            fork = asyncio.ensure_future(
                stream_choices(cluster.grpc_endpoint, "fork", FORK_PROMPT, None, first_token)
            )
            await asyncio.wait_for(first_token.wait(), 60.0)
            assert not fork.done()
            await loop.run_in_executor(None, cluster.kill, "decode-0")
            await asyncio.sleep(1.0)  # the router sees the broken calls (and used to fail)
            waited = not fork.done()
            await loop.run_in_executor(None, cluster.set_state, "decode-0", WorkerLifecycle.DEAD)
            await loop.run_in_executor(None, cluster.set_state, "decode-1", WorkerLifecycle.SERVING)
            return await fork, waited

        (tokens, _, _), waited = cluster.run(scenario(), timeout_s=240)
        assert waited, "the request ended while no decode worker was there to move to"
        assert tokens == [want] * N_CHOICES
        cluster.assert_idle()
    finally:
        with contextlib.suppress(ProcessLookupError):  # frozen, not yet killed: a failure
            os.kill(frozen, signal.SIGCONT)  # before the kill lets it stop at once
        cluster.stop()


def test_a_stream_waits_for_a_replacement_once(tiny_model_dir):
    """The only decode worker dies: the stream waits for the replacement and goes on
    there; when that one dies too with none left, the stream may be what kills them, so
    it fails at once (503 / UNAVAILABLE) rather than wait `migration_wait_s` (60 s) again
    for a worker to crash next."""
    roles = {"prefill-0": WorkerRole.PREFILL, "decode-0": WorkerRole.DECODE}
    cluster = ProcessCluster(str(tiny_model_dir), roles).start()
    try:
        prompt = make_prompts(2048, (30,), seed=81)[0]
        cluster.prepare("decode-1", WorkerRole.DECODE)  # published after the kill

        async def scenario() -> tuple[BaseException | tuple, float]:
            loop = asyncio.get_running_loop()
            progress: dict[str, int] = {}
            task = asyncio.ensure_future(
                stream_tokens(cluster.grpc_endpoint, "req-0", prompt, progress, max_tokens=900)
            )
            await wait_streaming(progress, ["req-0"])
            await loop.run_in_executor(None, cluster.kill, "decode-0")
            await loop.run_in_executor(None, cluster.set_state, "decode-0", WorkerLifecycle.DEAD)
            await loop.run_in_executor(None, cluster.set_state, "decode-1", WorkerLifecycle.SERVING)
            # Going on on the replacement.
            await wait_streaming(progress, ["req-0"], min_tokens=progress["req-0"] + 8)
            return await outcome_of_kill(cluster, "decode-1", task)

        result, took_s = cluster.run(scenario(), timeout_s=240)
        assert "no decode worker is available" in unavailable_details(result)
        assert took_s < 5.0, took_s
        cluster.set_state("decode-1", WorkerLifecycle.DEAD)
        cluster.assert_idle()
    finally:
        cluster.stop()
