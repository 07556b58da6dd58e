"""A request whose batch breaks the engine is not moved from worker to worker.

A worker's engine step that raises fails every request open on it, and the router
migrates them (their worker is gone). A request present at two such failures is not moved
a third time: it may be what breaks the engine. Here one prompt makes every engine step
that holds it raise (fault injection into `Engine.step`), on three workers that prefill
locally: it takes down two of them, not all three, the client gets a 500 that says why,
and the third worker still serves. A prefill shared by n sequences counts for each.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Iterator

import openai
import pytest

from tandem.engine.llm_engine import Engine
from tandem.router.sequence_flow import MAX_ENGINE_STEP_FAILURES
from tandem.worker.config import WorkerRole
from tests.helpers.inproc_cluster import InprocCluster, inproc_router_config, openai_client
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


@pytest.fixture
def three_workers(tiny_model_dir) -> Iterator[InprocCluster]:
    roles = dict.fromkeys(WORKERS, WorkerRole.DECODE)
    cluster = InprocCluster(str(tiny_model_dir), roles=roles).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def client(three_workers: InprocCluster) -> Iterator[openai.OpenAI]:
    yield from openai_client(three_workers.http_endpoint)


def test_a_request_that_breaks_two_engines_is_not_moved_to_a_third(three_workers, client, poison):
    prompt, raised = poison
    model = three_workers.router.config.model_name
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
    migrations = three_workers.router.metrics.migrations
    assert sum(sample.value for metric in migrations.collect() for sample in metric.samples
               if sample.name.endswith("_total")) == MAX_ENGINE_STEP_FAILURES - 1  # fmt: skip
    three_workers.assert_idle(worker_ids={survivor})


@pytest.fixture
def disaggregated(tiny_model_dir) -> Iterator[InprocCluster]:
    """1 prefill + 1 decode worker; every prompt through the prefill worker."""
    model_dir = str(tiny_model_dir)
    router = dataclasses.replace(inproc_router_config(model_dir), max_local_prefill_tokens=0)
    cluster = InprocCluster(model_dir, router_config=router).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def disaggregated_client(disaggregated: InprocCluster) -> Iterator[openai.OpenAI]:
    yield from openai_client(disaggregated.http_endpoint)


def test_a_shared_prefill_that_breaks_its_engine_counts_for_every_sequence(
    disaggregated, disaggregated_client, poison
):
    # n = 2: one prefill on prefill-0 for both sequences. It breaks; each sequence moves to
    # decode-0 (prefilling locally), which it breaks too: its second failed step, so it
    # stops there (uncounted, the shared failure would let it look for a third worker).
    prompt, raised = poison
    model = disaggregated.router.config.model_name
    with pytest.raises(openai.InternalServerError) as info:
        disaggregated_client.completions.create(
            model=model, prompt=prompt, max_tokens=4, temperature=0.0, n=2
        )
    message = info.value.body["message"]
    assert f"engine step failed on {MAX_ENGINE_STEP_FAILURES} workers" in message, message
    assert set(raised) == {"prefill-0", "decode-0"}, raised
