"""The engine thread behind asyncio: streams, aborts, errors, shutdown, no leaked thread.

A real `Engine` on the tiny model runs on the `EngineLoop` thread; the tests are the
asyncio side (every wait bounded by a timeout).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest

from tandem.engine.config import EngineConfig
from tandem.engine.generate import generate
from tandem.engine.llm_engine import Engine
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured.spec import GuidedDecoding, GuidedKind
from tandem.worker.engine_loop import EngineLoop, EngineLoopClosed, EngineStepFailed
from tests.helpers.kv_budget import TEST_KV_CACHE_BYTES
from tests.helpers.prompts import make_prompts

pytestmark = pytest.mark.timeout(120)

THREAD = "engine-loop-under-test"
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# Far longer than any test waits for: only an abort or a shutdown ends it early.
LONG = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
PROMPTS = make_prompts(2048, (40, 7), seed=81)


def run(coro: Coroutine, timeout_s: float = 60.0) -> Any:
    async def bounded():
        async with asyncio.timeout(timeout_s):
            return await coro

    return asyncio.run(bounded())


def engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD]


def make_engine(model_dir) -> Engine:
    return Engine(
        EngineConfig(
            model=str(model_dir),
            max_model_len=1024,
            num_threads=1,
            kv_cache_memory_bytes=TEST_KV_CACHE_BYTES,
        )
    )


@pytest.fixture
def engine(tiny_model_dir) -> Engine:
    return make_engine(tiny_model_dir)


@pytest.fixture
def engine_loop(engine: Engine) -> Iterator[EngineLoop]:
    assert not engine_threads()
    loop = EngineLoop(lambda: engine, name=THREAD)
    loop.start()
    yield loop
    loop.stop()
    assert not engine_threads(), "the engine thread outlived stop()"


async def collect(stream) -> list:
    async with stream:
        return [out async for out in stream]


def test_streams_deliver_each_requests_tokens_in_order(engine):
    # The reference, on the same engine before its thread exists.
    expected = [out.token_ids for out in generate(engine, PROMPTS, GREEDY, "ref")]
    assert engine.is_idle()
    loop = EngineLoop(lambda: engine, name=THREAD)
    loop.start()
    try:

        async def main():
            streams = [await loop.generate(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
            assert loop.num_open_streams == 2
            outputs = await asyncio.gather(*(collect(s) for s in streams))
            assert loop.num_open_streams == 0
            return outputs

        outputs = run(main())
    finally:
        loop.stop()
    for i, outs in enumerate(outputs):
        assert {o.req_id for o in outs} == {f"r{i}"}
        assert [t for o in outs for t in o.new_token_ids] == expected[i]
        assert [o.finished for o in outs] == [False] * 11 + [True]
        assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 12
    assert engine.is_idle()


def test_closing_an_unfinished_stream_aborts_the_request(engine_loop):
    async def main():
        stream = await engine_loop.generate("long", PROMPTS[0], LONG)
        received = []
        async for out in stream:
            received.append(out)
            if len(received) == 3:
                break
        assert not any(out.finished for out in received)
        await stream.aclose()
        assert engine_loop.num_open_streams == 0
        # Commands run in order, so the abort that aclose() queued has run by now.
        return await engine_loop.call(lambda e: (e.is_idle(), e.stats().num_running))

    assert run(main()) == (True, 0)


def test_a_cancelled_consumer_aborts_its_request(engine_loop):
    async def main():
        started = asyncio.Event()

        async def consume():
            async with await engine_loop.generate("long", PROMPTS[0], LONG) as stream:
                async for _ in stream:
                    started.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine_loop.num_open_streams == 0
        return await engine_loop.call(lambda e: e.is_idle())

    assert run(main()) is True


def test_errors_reach_the_waiting_caller_and_the_loop_goes_on(engine_loop):
    async def main():
        with pytest.raises(ZeroDivisionError):
            await engine_loop.call(lambda e: 1 / 0)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await engine_loop.generate("bad", [1, 99_999], GREEDY)
        assert engine_loop.num_open_streams == 0  # the failed start left no stream
        # The id is free again, and the loop still serves.
        outs = await collect(await engine_loop.generate("bad", PROMPTS[1], GREEDY))
        assert len(outs) == 12 and outs[-1].finished
        stream = await engine_loop.generate("dup", PROMPTS[1], LONG)
        with pytest.raises(ValueError, match="already streaming"):
            await engine_loop.generate("dup", PROMPTS[1], LONG)
        await stream.aclose()
        return await engine_loop.call(lambda e: e.is_idle())

    assert run(main()) is True
    # A plain thread's call gets the engine's exception too.
    with pytest.raises(KeyError, match="no prefilled KV"):
        engine_loop.call_threadsafe(lambda e: e.export_kv("nobody"), timeout_s=10)


def fail_step(engine: Engine, number: int, first: Callable[[], object] = lambda: None) -> None:
    """Fault injection: the engine's real step, made to fail on its `number`th call
    (after running `first()` there)."""
    real_step, num_steps = engine.step, 0

    def failing_step():
        nonlocal num_steps
        num_steps += 1
        if num_steps == number:
            first()
            raise RuntimeError("injected step failure")
        return real_step()

    engine.step = failing_step


def test_an_engine_failure_fails_open_streams_and_closes_the_loop(engine):
    fail_step(engine, 3)
    loop = EngineLoop(lambda: engine, name=THREAD)
    loop.start()
    try:

        async def main():
            stream = await loop.generate("r", PROMPTS[0], LONG)
            received = []
            # The stream ends with the step's error, marked as one (the worker tells the
            # router so: worker/step_failure.py).
            with pytest.raises(EngineStepFailed, match="injected step failure") as info:
                async for out in stream:
                    received.append(out)
            await stream.aclose()
            assert isinstance(info.value.__cause__, RuntimeError)
            assert len(received) == 2
            with pytest.raises(EngineLoopClosed, match="engine failed"):
                await loop.call(lambda e: None)
            with pytest.raises(EngineLoopClosed, match="engine failed"):
                await loop.generate("r2", PROMPTS[1], GREEDY)

        run(main())
    finally:
        loop.stop()
    assert not engine_threads()
    assert engine.is_idle()  # the failed request was aborted, its blocks freed


def test_a_failure_between_steps_fails_open_streams_too(engine):
    """The engine thread's own work between steps (here a client's abort) raising ends
    every open stream with the error at once, as a failed step does; before, the thread
    died and the streams waited out their callers' deadlines."""
    real_abort = engine.abort

    def failing_abort(req_id: str) -> None:
        if req_id == "leaving":
            raise RuntimeError("injected abort failure")
        real_abort(req_id)

    engine.abort = failing_abort
    loop = EngineLoop(lambda: engine, name=THREAD)
    loop.start()
    try:

        async def main():
            staying = await loop.generate("staying", PROMPTS[0], LONG)
            leaving = await loop.generate("leaving", PROMPTS[1], LONG)
            await anext(aiter(staying))
            await leaving.aclose()  # its abort raises on the engine thread
            with pytest.raises(EngineLoopClosed, match="injected abort failure"):
                async with asyncio.timeout(10):
                    async for _ in staying:
                        pass
            await staying.aclose()
            with pytest.raises(EngineLoopClosed, match="engine failed"):
                await loop.call(lambda e: None)

        run(main())
    finally:
        loop.stop()
    assert not engine_threads()
    real_abort("leaving")  # the one whose abort failed; the open one was aborted
    assert engine.is_idle()


def test_stop_fails_pending_waits_joins_the_thread_and_refuses_new_work(engine_loop, engine):
    async def main():
        first = asyncio.Event()

        async def consume():
            async for _ in await engine_loop.generate("long", PROMPTS[0], LONG):
                first.set()

        consumer = asyncio.create_task(consume())
        await asyncio.wait_for(first.wait(), 30)
        # Stopped from another thread while the consumer waits for its next output.
        await asyncio.to_thread(engine_loop.stop, 10.0)
        assert not engine_threads()
        with pytest.raises(EngineLoopClosed, match="stopped"):
            await asyncio.wait_for(consumer, 10)
        with pytest.raises(EngineLoopClosed, match="not running"):
            await engine_loop.call(lambda e: None)
        with pytest.raises(EngineLoopClosed, match="not running"):
            await engine_loop.generate("late", PROMPTS[1], GREEDY)

    run(main())
    with pytest.raises(EngineLoopClosed):
        engine_loop.call_threadsafe(lambda e: None)
    engine_loop.stop()  # a second stop is a no-op
    assert engine.is_idle()  # the request in flight was aborted


def test_start_and_stop_leave_no_thread_behind(engine):
    before = {t.ident for t in threading.enumerate()}
    for i in range(3):
        loop = EngineLoop(lambda: engine, name=THREAD)
        loop.start()
        outs = run(collect_one(loop, f"r{i}"))
        assert outs[-1].finished
        loop.stop()
        assert not engine_threads()
    assert {t.ident for t in threading.enumerate()} == before


def compile_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("grammar-compile")]


def test_stop_ends_the_grammar_compile_threads_too(engine):
    """The engine's helper threads go with its loop: a guided request starts grammar
    compilation; after stop no compile thread is left (a reused engine starts anew)."""
    guided = dataclasses.replace(
        GREEDY, structured=GuidedDecoding(GuidedKind.REGEX, "[a-z]{1,4}"), ignore_eos=False
    )
    others = set(compile_threads())  # other engines' in this test process
    for i in range(2):
        loop = EngineLoop(lambda: engine, name=THREAD)
        loop.start()
        try:

            async def generate_one(loop: EngineLoop, req_id: str) -> list:
                return await collect(await loop.generate(req_id, PROMPTS[1], guided))

            assert run(generate_one(loop, f"g{i}"))[-1].finished
            assert set(compile_threads()) - others
        finally:
            loop.stop()
        deadline = time.monotonic() + 5.0
        while set(compile_threads()) - others and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not set(compile_threads()) - others, "compile threads outlived the loop's stop"


async def collect_one(loop: EngineLoop, req_id: str) -> list:
    return await collect(await loop.generate(req_id, PROMPTS[1], GREEDY))


def test_the_engine_is_built_on_its_own_thread(tiny_model_dir):
    # On CPU every thread that runs a parallel torch op keeps its own OpenMP team; the
    # engine thread must be the only one (see EngineLoop), so the model loads there too.
    built_on = []

    def build() -> Engine:
        built_on.append(threading.current_thread().name)
        return make_engine(tiny_model_dir)

    loop = EngineLoop(build, name=THREAD)
    with pytest.raises(EngineLoopClosed, match="not started"):
        loop.engine  # noqa: B018
    loop.start()
    try:
        assert built_on == [THREAD]
        assert run(collect_one(loop, "r"))[-1].finished
    finally:
        loop.stop()
    assert not engine_threads()


def test_a_failed_build_is_raised_by_start_and_leaves_no_thread(tmp_path):
    loop = EngineLoop(lambda: Engine(EngineConfig(model=str(tmp_path))), name=THREAD)
    with pytest.raises(EngineLoopClosed, match="engine build failed"):
        loop.start()
    assert not engine_threads()
    with pytest.raises(EngineLoopClosed):
        run(loop.call(lambda e: None))


def test_a_command_queued_behind_a_failing_step_fails_at_once(engine):
    # The second step waits until a command is queued behind it, then fails; that
    # command must not wait out its timeout (the step watchdog + 30 s).
    held, queued = threading.Event(), threading.Event()
    fail_step(engine, 2, first=lambda: (held.set(), queued.wait(30.0)))
    loop = EngineLoop(lambda: engine, name=THREAD)
    loop.start()
    try:

        async def main():
            stream = await loop.generate("r", PROMPTS[0], LONG)
            assert await asyncio.to_thread(held.wait, 10.0)
            waiter = asyncio.ensure_future(loop.call(lambda e: e.is_idle()))
            await asyncio.sleep(0.2)  # the call is queued behind the held step
            queued.set()
            started = time.monotonic()
            with pytest.raises(EngineLoopClosed, match="injected step failure"):
                await waiter
            assert time.monotonic() - started < 5.0
            with pytest.raises(RuntimeError, match="injected step failure"):
                async for _ in stream:
                    pass
            await stream.aclose()
            with pytest.raises(EngineLoopClosed, match="engine failed"):
                loop.stats()
            with pytest.raises(EngineLoopClosed, match="engine failed"):
                loop.check_health()

        run(main())
    finally:
        loop.stop()
    assert not engine_threads()


def test_stats_follow_each_command_and_step(engine_loop):
    async def main():
        assert engine_loop.stats().num_waiting == 0
        stream = await engine_loop.generate("r", PROMPTS[0], LONG)
        # Published before the call returned: the caller reads its own write.
        running = engine_loop.stats()
        assert running.num_waiting + running.num_running == 1
        await stream.aclose()  # aborts on the engine thread
        deadline = time.monotonic() + 5.0
        while engine_loop.stats().num_free_blocks != running.num_blocks:
            assert time.monotonic() < deadline, engine_loop.stats()
            await asyncio.sleep(0.01)
        engine_loop.check_health()

    run(main())


def test_the_step_watchdog_must_be_positive(engine):
    with pytest.raises(ValueError, match="step_watchdog_s must be > 0"):
        EngineLoop(lambda: engine, name=THREAD, step_watchdog_s=0)
