"""Child processes of the router and SLO benchmarks, each with one owner that stops it.

- `ServerProcess`: runs an async `serve(arg)` in a spawned child (a router, fake
  workers, a whole Ray cluster) until `stop()`; the child stops gracefully on the stop
  message, on SIGTERM, and when the parent goes away (its pipe reads EOF).
- `run_job`: runs a function (a load generator) in a spawned child and returns its
  result, or kills the child when it overruns its timeout.

Either may pin the child to a set of cores (`os.sched_setaffinity`, where available),
so a router measured "on one core" does not share it with its load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import signal
import traceback
from collections.abc import Awaitable, Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger(__name__)

# serve(arg) -> (what the parent gets back, coroutine function that stops it all)
ServeFn = Callable[[Any], Awaitable[tuple[Any, Callable[[], Awaitable[None]]]]]

_STOP_TIMEOUT_S = 60.0


def pin_to_cores(cores: Sequence[int] | None) -> bool:
    """Pin this process (and threads it creates later) to `cores`; False if unsupported."""
    if not cores or not hasattr(os, "sched_setaffinity"):
        return False
    os.sched_setaffinity(0, set(cores))
    return True


def exit_on_sigterm() -> None:
    """Turn SIGTERM into `SystemExit` in the main thread, so `with` blocks and `finally`
    clauses stop the children (and their Ray instance) when the benchmark is killed."""

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (all its threads), None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # After the ")" that closes the command name, utime and stime are fields 12 and 13.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _server_main(serve: ServeFn, arg: Any, conn: Connection, cores: Sequence[int] | None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    pin_to_cores(cores)
    asyncio.run(_serve(serve, arg, conn))


async def _serve(serve: ServeFn, arg: Any, conn: Connection) -> None:
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop_requested.set)
    # Readable = a stop message, or EOF because the parent died: stop either way.
    loop.add_reader(conn.fileno(), stop_requested.set)
    stop: Callable[[], Awaitable[None]] | None = None
    try:
        info, stop = await serve(arg)
        conn.send(("ready", info))
        await stop_requested.wait()
    except Exception:
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
    finally:
        loop.remove_reader(conn.fileno())
        if stop is not None:
            await stop()
    with contextlib.suppress(OSError):
        conn.send(("stopped", None))


class ServerProcess:
    """Owns one spawned child that serves until `stop()` (use as a context manager)."""

    def __init__(
        self, name: str, serve: ServeFn, arg: Any, cores: Sequence[int] | None = None
    ) -> None:
        self.name = name
        self._serve = serve
        self._arg = arg
        self._cores = list(cores) if cores else None
        self._proc: mp.process.BaseProcess | None = None
        self._conn: Connection | None = None

    @property
    def pid(self) -> int:
        if self._proc is None or self._proc.pid is None:
            raise RuntimeError(f"{self.name} is not running")
        return self._proc.pid

    def start(self, timeout_s: float) -> Any:
        """Spawn the child and wait until it serves; returns what `serve` handed back."""
        ctx = mp.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe()
        self._conn = parent_conn
        self._proc = ctx.Process(
            target=_server_main,
            args=(self._serve, self._arg, child_conn, self._cores),
            name=self.name,
            daemon=True,
        )
        self._proc.start()
        child_conn.close()
        try:
            if not parent_conn.poll(timeout_s):
                raise TimeoutError(f"{self.name} did not start within {timeout_s:.0f} s")
            kind, info = parent_conn.recv()
        except BaseException:
            self.stop()
            raise
        if kind != "ready":
            self.stop()
            raise RuntimeError(f"{self.name} failed to start:\n{info}")
        return info

    def stop(self, timeout_s: float = _STOP_TIMEOUT_S) -> None:
        """Ask the child to stop, wait for it; terminate, then kill, if it overruns."""
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if proc is None or conn is None:
            return
        try:
            with contextlib.suppress(OSError):
                conn.send(("stop", None))
            with contextlib.suppress(OSError, EOFError):
                while conn.poll(timeout_s) and conn.recv()[0] != "stopped":
                    pass
            proc.join(timeout_s)
            if proc.is_alive():
                logger.warning("%s did not stop in %.0f s; terminating", self.name, timeout_s)
                proc.terminate()
                proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        finally:
            conn.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _job_main(
    fn: Callable[[Any], Any], arg: Any, conn: Connection, cores: Sequence[int] | None
) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    pin_to_cores(cores)
    try:
        result = ("ok", fn(arg))
    except Exception:
        result = ("error", traceback.format_exc())
    conn.send(result)


def run_job(
    fn: Callable[[Any], Any], arg: Any, *, timeout_s: float, cores: Sequence[int] | None = None
) -> Any:
    """`fn(arg)` in a spawned child (pinned to `cores`); its result, or an exception."""
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_job_main, args=(fn, arg, child_conn, cores), daemon=True)
    proc.start()
    child_conn.close()
    try:
        if not parent_conn.poll(timeout_s):
            raise TimeoutError(f"job {fn.__name__} did not finish within {timeout_s:.0f} s")
        kind, result = parent_conn.recv()
        if kind != "ok":
            raise RuntimeError(f"job {fn.__name__} failed:\n{result}")
        return result
    finally:
        parent_conn.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
