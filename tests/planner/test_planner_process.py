"""The live planner's planning process leaves Ctrl-C to the serving process that owns it
(a terminal sends SIGINT to the whole process group). Light imports: the spawned
process imports this module to find `interrupt_myself`."""

from __future__ import annotations

import concurrent.futures
import multiprocessing as mp
import os
import signal
import time

import pytest

from tandem.planner.live_plan import ignore_interrupts


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
        max_workers=1, mp_context=context, initializer=ignore_interrupts
    ) as executor:
        assert executor.submit(interrupt_myself).result(timeout=30) == "still planning"
    # Without the initializer the call is interrupted (the pool hands the worker's
    # KeyboardInterrupt back; an idle worker would die printing its traceback).
    with (
        concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as executor,
        pytest.raises(KeyboardInterrupt),
    ):
        executor.submit(interrupt_myself).result(timeout=30)
