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

A step can be long (a 2048-token prefill chunk of a 1B model takes tens of seconds on a
laptop CPU), and commands wait for the step in progress. So what must answer at once
does not queue: the thread publishes a stats snapshot after every step and command
(`stats()`), and `check_health()` reads the thread's state, failing only when the
thread is gone or one step has run past `step_watchdog_s` (a hung kernel), as SGLang's
watchdog does.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from tandem.engine.llm_engine import Engine
from tandem.engine.outputs import EngineStats, RequestOutput
from tandem.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How often an idle loop wakes to expire KV leases.
_IDLE_WAKE_S = 0.05
# The longest one engine step may run before the worker counts as hung (SGLang's
# --watchdog-timeout default).
DEFAULT_STEP_WATCHDOG_S = 300.0
# How long a command may wait beyond the step in progress (which the watchdog bounds).
COMMAND_TIMEOUT_S = 30.0


class EngineLoopClosed(RuntimeError):
    """The engine loop stopped (shutdown or a fatal engine error)."""


class EngineStepFailed(EngineLoopClosed):
    """An engine step raised: every request open on the loop fails with this, and the
    loop is closed (worker/step_failure.py says how the worker reports it)."""


class EngineStalled(RuntimeError):
    """One engine step has run longer than the loop's step watchdog."""


@dataclass
class _Command:
    """Work for the engine thread; `fail` answers its waiter if the loop closes first."""

    run: Callable[[], object]
    fail: Callable[[BaseException], None]


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class EngineLoop:
    """One engine thread; thread-safe entry points for asyncio callers."""

    def __init__(
        self,
        build: Callable[[], Engine],
        name: str = "engine",
        step_watchdog_s: float = DEFAULT_STEP_WATCHDOG_S,
    ) -> None:
        """`build` makes the engine; it runs on the engine thread when `start()` is called."""
        if step_watchdog_s <= 0:
            raise ValueError(f"step_watchdog_s must be > 0, got {step_watchdog_s}")
        self._build = build
        self.step_watchdog_s = step_watchdog_s
        # Written by the engine thread only; read anywhere (one reference each).
        self._stats: EngineStats | None = None
        self._step_started: float | None = None
        self._engine: Engine | None = None
        self._built = threading.Event()
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._closed = False  # no command runs any more (under _lock)
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._error: BaseException | None = None

    def start(self, timeout_s: float = 600.0) -> None:
        """Start the thread and wait until it has built the engine (blocking: from asyncio,
        run it in an executor). Re-raises the build's error; TimeoutError past `timeout_s`.

        Until `stop`, the process stops the thread as it exits: on SIGTERM a Ray worker
        raises SystemExit, and an engine thread still inside a step when the interpreter
        finalized was unwound through torch's native frames (abort: "terminate called
        without an active exception", in every busy worker sent SIGTERM)."""
        atexit.register(self.stop)
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
        atexit.unregister(self.stop)
        if not self._thread.is_alive():
            return
        self._stopping.set()
        self._commands.put(_Command(_nothing, _ignore))  # wakes an idle thread
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("engine thread did not stop within %.1f s", timeout_s)

    @property
    def num_open_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    def stats(self) -> EngineStats:
        """The engine's state after its last step or command, without waiting for the
        step in progress (thread-safe)."""
        self._check_running()
        if self._stats is None:
            raise EngineLoopClosed("engine loop not started")
        return self._stats

    def step_running_s(self) -> float:
        """How long the step in progress has run (0 between steps)."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    def check_health(self) -> None:
        """Raise EngineLoopClosed if the engine thread is gone, EngineStalled if its step
        in progress has run past the watchdog; a long step within it is healthy."""
        self._check_running()
        running_s = self.step_running_s()
        if running_s > self.step_watchdog_s:
            raise EngineStalled(
                f"one engine step has run {running_s:.0f} s "
                f"(step watchdog {self.step_watchdog_s:.0f} s)"
            )

    def _command_timeout_s(self, timeout_s: float | None) -> float:
        return self.step_watchdog_s + COMMAND_TIMEOUT_S if timeout_s is None else timeout_s

    async def call(self, fn: Callable[[Engine], T], timeout_s: float | None = None) -> T:
        """Run `fn(engine)` on the engine thread between steps; return its result. The
        default timeout is the step in progress (at most the watchdog) plus
        COMMAND_TIMEOUT_S."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except Exception as exc:  # handed to the caller, never swallowed
                fail(exc)
            else:
                self._publish_stats()  # a caller's next stats() sees what it did
                loop.call_soon_threadsafe(_set_result, future, result)

        def fail(exc: BaseException) -> None:
            loop.call_soon_threadsafe(_set_exception, future, exc)

        self._put(_Command(run, fail))
        return await asyncio.wait_for(future, self._command_timeout_s(timeout_s))

    def call_threadsafe(self, fn: Callable[[Engine], T], timeout_s: float | None = None) -> T:
        """`call` for plain (non-asyncio) threads, e.g. a KV transfer socket thread."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except Exception as exc:  # handed to the caller, never swallowed
                future.set_exception(exc)
            else:
                self._publish_stats()  # as in `call`: the caller's next stats() sees it
                future.set_result(result)

        self._put(_Command(run, future.set_exception))
        return future.result(self._command_timeout_s(timeout_s))

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
            with self._lock:
                if not self._closed:  # else the engine already dropped every request
                    self._commands.put(_Command(lambda: self.engine.abort(req_id), _ignore))

    def _put(self, command: _Command) -> None:
        """Queue a command, or raise EngineLoopClosed; never strands one in a closed queue."""
        with self._lock:
            self._check_running()
            self._commands.put(command)

    def _check_running(self) -> None:
        if self._error is not None:
            raise EngineLoopClosed(f"engine failed: {self._error!r}")
        if self._closed or self._stopping.is_set() or not self._thread.is_alive():
            raise EngineLoopClosed("engine loop is not running")

    # ----- engine thread ------------------------------------------------------

    def _run(self) -> None:
        try:
            engine = self._engine = self._build()
        except Exception as exc:  # handed to start(), never swallowed
            logger.exception("engine build failed")
            self._error = exc
            return
        else:
            self._publish_stats()
        finally:
            self._built.set()
        try:
            self._serve(engine)
        except Exception as exc:  # outside a step (an abort, lease expiry, stats): as a step's
            logger.exception("engine thread failed; failing every open stream")
            self._error = exc
            self._fail_all(EngineLoopClosed(f"engine failed: {exc!r}"))
        finally:
            self._close_commands()
            engine.close()

    def _serve(self, engine: Engine) -> None:
        while not self._stopping.is_set():
            self._run_commands(block=not engine.has_unfinished_requests())
            if self._stopping.is_set():
                break
            if not engine.has_unfinished_requests():
                engine.expire_leases(engine.clock())
                self._publish_stats()
                continue
            self._step_started = time.monotonic()
            try:
                outputs = engine.step()
            except Exception as exc:
                logger.exception("engine step failed; failing every open stream")
                self._error = exc
                failure = EngineStepFailed(f"engine step failed: {exc!r}")
                failure.__cause__ = exc
                self._fail_all(failure)
                return
            finally:
                self._step_started = None
            self._publish_stats()
            self._dispatch(outputs)
        self._fail_all(EngineLoopClosed("engine loop stopped"))

    def _publish_stats(self) -> None:
        self._stats = self.engine.stats()

    def _run_commands(self, block: bool) -> None:
        try:
            command = (
                self._commands.get(timeout=_IDLE_WAKE_S) if block else self._commands.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            command.run()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        self._publish_stats()

    def _close_commands(self) -> None:
        """The thread is leaving: refuse new commands and fail the queued ones."""
        with self._lock:
            self._closed = True
        reason = (
            EngineLoopClosed(f"engine failed: {self._error!r}")
            if self._error is not None
            else EngineLoopClosed("engine loop stopped")
        )
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            with contextlib.suppress(RuntimeError):  # the waiter's event loop has closed
                command.fail(reason)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            targets = [(self._streams.get(out.req_id), out) for out in outputs]
        for stream, out in targets:
            if stream is not None and not _deliver(stream, out) and not out.finished:
                # Its reader's event loop has closed: nobody will read the rest.
                self._close_stream(out.req_id)
                self.engine.abort(out.req_id)

    def _fail_all(self, exc: BaseException) -> None:
        """End every open stream with `exc`, and drop its request from the engine (an
        abort that fails too is logged: the streams end all the same)."""
        with self._lock:
            streams = list(self._streams.items())
        for req_id, stream in streams:
            _deliver(stream, exc)
            try:
                self.engine.abort(req_id)
            except Exception:
                logger.exception("abort of %s failed while failing every stream", req_id)


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


def _deliver(stream: _Stream, item: RequestOutput | BaseException) -> bool:
    """Hand `item` to its stream's event loop; False when that loop has closed (a reader
    gone with its loop: a process exiting, a test's loop ended)."""
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
    except RuntimeError:
        return False
    return True


def _nothing() -> None:
    pass


def _ignore(exc: BaseException) -> None:
    pass


def _set_result(future: asyncio.Future, result: object) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
