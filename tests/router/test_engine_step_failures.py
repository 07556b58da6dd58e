"""A request whose batch breaks the engine is not moved from worker to worker.

A worker's engine step that raises fails every request open on it, and the router
migrates them (their worker is gone). A request present at two such failures is not moved
a third time: it may be what breaks the engine. Here one prompt makes every engine step
that holds it raise (fault injection into `Engine.step`), on three workers that prefill
locally: it takes down two of them, not all three, the client gets a 500 that says why,
and the third worker still serves. A failed prefill shared by n sequences counts for each.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Iterator

import grpc
import openai
import pytest

from tandem.engine.llm_engine import Engine
from tandem.proto.cluster_auth import ClusterAuth, internal_channel
from tandem.proto.tandem.worker.v1 import worker_pb2 as pb
from tandem.proto.tandem.worker.v1 import worker_pb2_grpc
from tandem.router.attempts import AttemptFailed, MigrationReason
from tandem.router.errors import RouterError
from tandem.router.forked_flow import _SharedStart
from tandem.router.sequence_flow import MAX_ENGINE_STEP_FAILURES
from tandem.worker.config import WorkerRole
from tandem.worker.step_failure import ENGINE_STEP_FAILED_KEY
from tests.helpers.inproc_cluster import InprocCluster, openai_client
from tests.helpers.prompts import make_prompts

pytestmark = pytest.mark.timeout(300)

WORKERS = ("decode-0", "decode-1", "decode-2")


@pytest.fixture
def poison(monkeypatch) -> tuple[list[int], collections.Counter[str]]:
    """A prompt whose presence makes an engine's step raise, and the raises per worker
    (read off the engine thread's name, `engine-<worker id>`)."""
    (prompt,) = make_prompts(2048, (24,), seed=97)
    raised: collections.Counter[str] = collections.Counter()
    step = Engine.step

    def poisoned_step(self: Engine) -> list:
        if any(r.prompt_token_ids[: len(prompt)] == prompt for r in self._requests.values()):
            raised[threading.current_thread().name.removeprefix("engine-")] += 1
            raise RuntimeError("injected fault: this batch breaks the engine")
        return step(self)

    monkeypatch.setattr(Engine, "step", poisoned_step)
    return prompt, raised


def serving(cluster: InprocCluster) -> Iterator[tuple[InprocCluster, openai.OpenAI]]:
    """For a fixture to `yield from`: the cluster started, and an OpenAI client of it."""
    cluster.start()
    try:
        for client in openai_client(cluster.http_endpoint):
            yield cluster, client
    finally:
        cluster.stop()


@pytest.fixture
def three_workers(tiny_model_dir) -> Iterator[tuple[InprocCluster, openai.OpenAI]]:
    roles = dict.fromkeys(WORKERS, WorkerRole.DECODE)
    yield from serving(InprocCluster(str(tiny_model_dir), roles=roles))


def test_a_request_that_breaks_two_engines_is_not_moved_to_a_third(three_workers, poison):
    cluster, client = three_workers
    prompt, raised = poison
    model = cluster.router.config.model_name
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0.0)
    message = info.value.body["message"]
    assert f"engine step failed on {MAX_ENGINE_STEP_FAILURES} workers" in message, message
    assert "injected fault" in message, message
    # Two engines broke, once each; the third never saw the request.
    assert len(raised) == MAX_ENGINE_STEP_FAILURES and set(raised.values()) == {1}, raised
    (survivor,) = set(WORKERS) - set(raised)
    # The survivor serves the next requests; the router sends none to the broken workers.
    for seed in (5, 6):
        (other,) = make_prompts(2048, (20,), seed=seed)
        out = client.completions.create(model=model, prompt=other, max_tokens=4, temperature=0.0)
        assert out.usage.completion_tokens == 4
    migrations = cluster.router.metrics.migrations
    assert sum(sample.value for metric in migrations.collect() for sample in metric.samples
               if sample.name.endswith("_total")) == MAX_ENGINE_STEP_FAILURES - 1  # fmt: skip
    cluster.assert_idle(worker_ids={survivor})
    # A call that reaches a broken worker's closed loop was in no failed step: UNAVAILABLE,
    # without the trailer, so it migrates as from any dead worker.
    broken = next(w for w in cluster.workers if w.worker_id in raised)
    code, trailers = cluster.run(decode_call_status(broken.endpoint, other))
    assert code is grpc.StatusCode.UNAVAILABLE and ENGINE_STEP_FAILED_KEY not in trailers
    # So do its unary calls (they were UNKNOWN: an unexpected error in the handler).
    assert cluster.run(unary_call_codes(broken.endpoint)) == {
        "Abort": grpc.StatusCode.UNAVAILABLE,
        "Stats": grpc.StatusCode.UNAVAILABLE,
    }


async def unary_call_codes(endpoint: str) -> dict[str, grpc.StatusCode]:
    """How a decode worker ends an Abort and a Stats call."""
    async with internal_channel(endpoint, ClusterAuth(), options=()) as channel:
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        codes = {}
        for name, call in (("Abort", stub.Abort(pb.AbortRequest(request_id="x"), timeout=10)),
                           ("Stats", stub.Stats(pb.StatsRequest(), timeout=10))):  # fmt: skip
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            codes[name] = info.value.code()
        return codes


async def decode_call_status(endpoint: str, prompt: list[int]) -> tuple[grpc.StatusCode, dict]:
    """How a decode worker ends a local-prefill Decode call: its status and trailers."""
    async with internal_channel(endpoint, ClusterAuth(), options=()) as channel:
        call = worker_pb2_grpc.DecodeWorkerStub(channel).Decode(
            pb.DecodeRequest(request_id="direct", prompt_token_ids=prompt, local_prefill=True,
                             params=pb.SamplingParams(max_tokens=2)),
            timeout=10,
        )  # fmt: skip
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
        return info.value.code(), dict(info.value.trailing_metadata() or ())


def test_a_failed_shared_prefill_counts_for_every_sequence():
    # n > 1 shares one prefill (router/forked_flow.py); when its engine step failed, each
    # sequence's first attempt fails as one that was in that step.
    error = RouterError("worker error (INTERNAL): engine step failed")
    start = _SharedStart(flow=None, sequences=[], placement=None)  # type: ignore[arg-type]
    start.failure = AttemptFailed(
        "prefill-0", MigrationReason.PREFILL_FAILED, error, migratable=True, engine_step_failed=True
    )

    async def first_attempt() -> None:
        async for _ in start.first_attempt(seq=None, attempt=None):  # type: ignore[arg-type]
            pass

    for _ in range(2):  # one per sequence, each its own exception
        with pytest.raises(AttemptFailed) as info:
            asyncio.run(first_attempt())
        assert info.value.engine_step_failed and info.value is not start.failure
