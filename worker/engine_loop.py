"""Runs an `Engine` on its own thread for asyncio servers.

The engine is synchronous and single-threaded; gRPC servers are asyncio. This loop
is the only thread that touches the engine: servers submit commands (`call`) and
request streams (`generate`, `submit`), and receive each step's outputs through
per-request asyncio queues. Cancelling a stream (client gone, deadline) aborts the
request on the engine thread, so its blocks are freed.

The engine is also *built* on that thread (model load, warm-up). On CPU a thread that
once ran a parallel torch op keeps its own OpenMP team for life; with a second team
alive in the process (say, the thread that loaded the model), every GEMM of the engine
thread ran 25-100% slower (decode steps 32 -> 40 ms at batch 1 in a served worker).
One thread for all torch work keeps one team.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from tandem.engine.llm_engine import Engine
from tandem.engine.outputs import RequestOutput
from tandem.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How often an idle loop wakes to expire KV leases.
_IDLE_WAKE_S = 0.05


class EngineLoopClosed(RuntimeError):
    """The engine loop stopped (shutdown or a fatal engine error)."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class EngineLoop:
    """One engine thread; thread-safe entry points for asyncio callers."""

    def __init__(self, build: Callable[[], Engine], name: str = "engine") -> None:
        """`build` makes the engine; it runs on the engine thread when `start()` is called."""
        self._build = build
        self._engine: Engine | None = None
        self._built = threading.Event()
        self._commands: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._error: BaseException | None = None

    def start(self, timeout_s: float = 600.0) -> None:
        """Start the thread and wait until it has built the engine (blocking: from asyncio,
        run it in an executor). Re-raises the build's error; TimeoutError past `timeout_s`."""
        self._thread.start()
        if not self._built.wait(timeout_s):
            self.stop()
            raise TimeoutError(f"engine not built within {timeout_s:.0f} s")
        if self._engine is None:
            self._thread.join(timeout_s)
            raise EngineLoopClosed(f"engine build failed: {self._error!r}") from self._error

    @property
    def engine(self) -> Engine:
        """The engine (after `start()`); touch it only on the engine thread, or through
        its thread-safe parts (see `Engine`)."""
        if self._engine is None:
            raise EngineLoopClosed("engine loop not started")
        return self._engine

    def stop(self, timeout_s: float = 10.0) -> None:
        """Abort everything in flight and join the thread."""
        if not self._thread.is_alive():
            return
        self._stopping.set()
        self._commands.put(lambda: None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("engine thread did not stop within %.1f s", timeout_s)

    @property
    def num_open_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    async def call(self, fn: Callable[[Engine], T], timeout_s: float = 30.0) -> T:
        """Run `fn(engine)` on the engine thread between steps; return its result."""
        self._check_running()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def command() -> None:
            try:
                result = fn(self.engine)
            except Exception as exc:  # handed to the caller, never swallowed
                loop.call_soon_threadsafe(_set_exception, future, exc)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)

        self._commands.put(command)
        return await asyncio.wait_for(future, timeout_s)

    def call_threadsafe(self, fn: Callable[[Engine], T], timeout_s: float = 30.0) -> T:
        """`call` for plain (non-asyncio) threads, e.g. a KV transfer socket thread."""
        self._check_running()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def command() -> None:
            try:
                future.set_result(fn(self.engine))
            except Exception as exc:  # handed to the caller, never swallowed
                future.set_exception(exc)

        self._commands.put(command)
        return future.result(timeout_s)

    async def generate(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        local_prefill: bool = False,
    ) -> RequestStream:
        """Add a request; the returned stream owns it (raises ValueError on bad input).
        `local_prefill` lets a decode-only engine prefill it (see `Engine.add_request`)."""
        return await self.submit(
            req_id,
            lambda e: e.add_request(req_id, prompt_token_ids, params, local_prefill=local_prefill),
        )

    async def submit(self, req_id: str, start: Callable[[Engine], object]) -> RequestStream:
        """Run `start(engine)` (which puts `req_id` into the engine, e.g. `add_request` or
        `commit_import`) with the request's output stream registered first."""
        queue = self._open_stream(req_id)
        try:
            await self.call(start)
        except BaseException:
            # A timed-out start may still land later: make sure it is dropped.
            self.close_stream(req_id, abort=True)
            raise
        return RequestStream(self, req_id, queue)

    def _open_stream(self, req_id: str) -> asyncio.Queue:
        self._check_running()
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if req_id in self._streams:
                raise ValueError(f"request id {req_id!r} is already streaming")
            self._streams[req_id] = stream
        return stream.queue

    def _close_stream(self, req_id: str) -> None:
        with self._lock:
            self._streams.pop(req_id, None)

    def close_stream(self, req_id: str, abort: bool) -> None:
        """Stop delivering outputs of `req_id`; with `abort`, drop it from the engine."""
        self._close_stream(req_id)
        if abort:
            self._commands.put(lambda: self.engine.abort(req_id))

    def _check_running(self) -> None:
        if self._error is not None:
            raise EngineLoopClosed(f"engine failed: {self._error!r}")
        if self._stopping.is_set() or not self._thread.is_alive():
            raise EngineLoopClosed("engine loop is not running")

    # ----- engine thread ------------------------------------------------------

    def _run(self) -> None:
        try:
            engine = self._engine = self._build()
        except Exception as exc:  # handed to start(), never swallowed
            logger.exception("engine build failed")
            self._error = exc
            return
        finally:
            self._built.set()
        while not self._stopping.is_set():
            self._run_commands(block=not engine.has_unfinished_requests())
            if self._stopping.is_set():
                break
            if not engine.has_unfinished_requests():
                engine.expire_leases(engine.clock())
                continue
            try:
                outputs = engine.step()
            except Exception as exc:
                logger.exception("engine step failed; failing every open stream")
                self._error = exc
                self._fail_all(exc)
                return
            self._dispatch(outputs)
        self._fail_all(EngineLoopClosed("engine loop stopped"))

    def _run_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_WAKE_S) if block else None
        except queue.Empty:
            return
        while True:
            if command is not None:
                command()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            targets = [(self._streams.get(out.req_id), out) for out in outputs]
        for stream, out in targets:
            if stream is not None:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            streams = list(self._streams.items())
        for req_id, stream in streams:
            self.engine.abort(req_id)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)


class RequestStream:
    """The outputs of one request; the owner must `aclose()` it (also on error/cancel).

    Closing a stream whose request has not finished aborts the request in the engine.
    """

    def __init__(self, loop: EngineLoop, req_id: str, queue: asyncio.Queue) -> None:
        self.req_id = req_id
        self._loop = loop
        self._queue = queue
        self._finished = False
        self._closed = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        while not self._finished and not self._closed:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self._finished = True  # the engine already dropped the request
                raise item
            self._finished = item.finished
            yield item

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.close_stream(self.req_id, abort=not self._finished)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def _set_result(future: asyncio.Future, result: object) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
