"""The live planner's planning process leaves Ctrl-C to the serving process that owns it
(a terminal sends SIGINT to the whole process group), and dies with it. Light imports:
the spawned process imports this module to find `interrupt_myself`."""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures.process import BrokenProcessPool

import pytest

from tandem.planner.live_plan import init_planning_process
from tandem.planner.planning_process import PlanningProcess


def interrupt_myself() -> str:
    """Runs in the planner's process: Ctrl-C as a terminal sends it to the process group."""
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.2)  # the signal is delivered by now
    return "still planning"


@pytest.fixture
def python_sigint_handler():
    """Python's own Ctrl-C handling in this process, so the processes it spawns get it too
    (a SIGINT ignored here, as under a background shell job, would be inherited
    ignored, and the check below could not fail)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.timeout(60)
def test_the_planner_process_leaves_ctrl_c_to_the_server(python_sigint_handler):
    context = mp.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=1,
        mp_context=context,
        initializer=init_planning_process,
        initargs=(os.getpid(),),
    ) as executor:
        assert executor.submit(interrupt_myself).result(timeout=30) == "still planning"
    # Without the initializer the call is interrupted (the pool hands the worker's
    # KeyboardInterrupt back; an idle worker would die printing its traceback).
    with (
        concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as executor,
        pytest.raises(KeyboardInterrupt),
    ):
        executor.submit(interrupt_myself).result(timeout=30)


# A serving process: starts its planning process as the live planner does, prints
# that process's pid, then waits to be killed.
_SERVER = textwrap.dedent("""
    import concurrent.futures, multiprocessing as mp, os, sys, time
    from tandem.planner.live_plan import init_planning_process
    executor = concurrent.futures.ProcessPoolExecutor(
        max_workers=1, mp_context=mp.get_context("spawn"),
        initializer=init_planning_process, initargs=(os.getpid(),))
    print(executor.submit(os.getpid).result(timeout=60), flush=True)
    time.sleep(120)
""")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(90)
@pytest.mark.skipif(sys.platform != "linux", reason="parent-death signal: Linux only")
def test_the_planner_process_dies_with_a_killed_server():
    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        planner_pid = int(server.stdout.readline())
        assert alive(planner_pid)
        server.kill()  # as the OOM killer or `kill -9` would
        server.wait(timeout=30)
        deadline = time.monotonic() + 20
        while alive(planner_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(planner_pid), "the planning process outlived its server"
    finally:
        server.kill()


def sleep_then_pid(seconds: float) -> int:
    """Runs in the planner's process: a search that takes `seconds`."""
    time.sleep(seconds)
    return os.getpid()


def exit_now(code: int) -> int:
    """Runs in the planner's process: it dies mid-search (as the OOM killer would end it)."""
    os._exit(code)


@pytest.mark.timeout(120)
def test_a_search_past_its_deadline_costs_its_process_not_the_next_search():
    async def scenario() -> None:
        process = PlanningProcess()
        process.start()
        try:
            first = await process.run(sleep_then_pid, 0.0, timeout_s=60)
            with pytest.raises(TimeoutError):
                await process.run(sleep_then_pid, 300.0, timeout_s=1)
            deadline = time.monotonic() + 20
            while alive(first) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert not alive(first), "the overrunning search kept running"
            # The next search neither waits behind the old one nor fails.
            second = await process.run(sleep_then_pid, 0.0, timeout_s=60)
            assert second != first
        finally:
            process.stop()

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_a_planning_process_that_died_is_replaced_for_the_next_search():
    async def scenario() -> None:
        process = PlanningProcess()
        try:
            with pytest.raises(BrokenProcessPool):
                await process.run(exit_now, 3, timeout_s=60)
            assert await process.run(sleep_then_pid, 0.0, timeout_s=60) > 0
        finally:
            process.stop()
        process.stop()  # stopping twice is harmless

    asyncio.run(scenario())
