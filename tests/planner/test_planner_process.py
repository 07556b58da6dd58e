"""The live planner's planning process leaves Ctrl-C to the serving process that owns it
(a terminal sends SIGINT to the whole process group), and dies with it. Light imports:
the spawned process imports this module to find `interrupt_myself`."""

from __future__ import annotations

import concurrent.futures
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tandem.planner.live_plan import init_planning_process


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
