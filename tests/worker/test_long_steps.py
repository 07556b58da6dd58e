"""A long engine step (a big model's prefill chunk on a CPU) is not a hung worker.

A worker's health probe (`WorkerActor.load`), its `Stats` RPC and its `/metrics` answer
at once while a step runs; only a step past the step watchdog fails the probe, and the
probe passes again once the step ends. Found with a TinyLlama-1.1B-shaped model on a
2-core CPU: one 2048-token chunk outlasted three 5 s probes and the pool controller
killed the prefill worker mid-prefill, then the decode worker that took the request over.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import urllib.request

import pytest

from tandem.cluster.worker_actor import WorkerActor
from tandem.engine.sampling_params import SamplingParams
from tandem.worker.config import WorkerConfig, WorkerRole, WorkerSettings
from tandem.worker.engine_loop import EngineStalled
from tests.helpers.grpc_calls import worker_stats
from tests.helpers.inproc_cluster import inproc_engine_config
from tests.helpers.prompts import make_prompts

pytestmark = pytest.mark.timeout(120)

WATCHDOG_S = 2.0
# Each probe must answer well inside a step that runs past the watchdog.
PROBE_S = 0.5
PROMPT = make_prompts(2048, (40,), seed=3)[0]


class GatedStep:
    """Fault injection: the engine's real step, held at its start until `open()` (at
    most 30 s) the first time; later steps run freely."""

    def __init__(self, real_step) -> None:
        self.real_step = real_step
        self.started = threading.Event()
        self._gate = threading.Event()

    def __call__(self):
        if not self.started.is_set():
            self.started.set()
            self._gate.wait(30.0)
        return self.real_step()

    def open(self) -> None:
        self._gate.set()


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=PROBE_S) as reply:
        return reply.read().decode()


async def _within(awaitable, what: str):
    started = time.monotonic()
    result = await asyncio.wait_for(awaitable, PROBE_S)
    assert time.monotonic() - started < PROBE_S, what
    return result


def test_probes_answer_during_a_long_step_and_fail_only_past_the_watchdog(tiny_model_dir):
    engine = dataclasses.replace(
        inproc_engine_config(str(tiny_model_dir)), mode=WorkerRole.PREFILL.engine_mode
    )
    config = WorkerConfig(
        worker_id="p0",
        role=WorkerRole.PREFILL,
        engine=engine,
        settings=WorkerSettings(step_watchdog_s=WATCHDOG_S),
    )

    async def scenario() -> None:
        actor = WorkerActor(config)
        endpoint = await actor.start()
        try:
            assert actor.worker is not None and actor.worker.host.loop is not None
            loop = actor.worker.host.loop
            gated = GatedStep(loop.engine.step)
            loop.engine.step = gated
            params = SamplingParams(max_tokens=1, temperature=0.0)
            stream = await loop.generate("r", PROMPT, params)
            assert await asyncio.to_thread(gated.started.wait, 10.0)
            # Inside the step: every probe answers at once, from the last snapshot.
            load = await _within(actor.load(), "health probe")
            assert load.num_waiting + load.num_running == 1
            stats = await _within(worker_stats(endpoint, "prefill"), "Stats")
            assert stats.num_waiting + stats.num_running == 1
            metrics_url = actor.worker.metrics.endpoint + "/metrics"
            text = await _within(asyncio.to_thread(_get, metrics_url), "/metrics")
            assert 'tandem:num_requests_waiting{role="prefill",worker_id="p0"} 1.0' in text
            # Past the watchdog the probe fails, naming the step's length.
            while loop.step_running_s() <= WATCHDOG_S:
                await asyncio.sleep(0.05)
            with pytest.raises(EngineStalled, match=r"step watchdog 2 s"):
                await actor.load()
            # The step ends: the request finishes and the probe passes again.
            gated.open()
            async with stream:
                outputs = [out async for out in stream]
            assert outputs[-1].finished
            await loop.call(lambda e: e.release("r"))
            load = await _within(actor.load(), "health probe after the step")
            assert (load.num_running, load.num_waiting, load.num_held) == (0, 0, 0)
            assert load.num_free_blocks == load.num_blocks
        finally:
            await actor.stop()

    asyncio.run(scenario())
