"""Ray's start tried again after a node start timeout, a Ray address nothing answers at
refused at once, and loopback addresses joined in Ray's single-machine mode
(cluster/ray_start.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import ray._private.ray_constants as ray_constants

from tandem.bench.harness import free_port
from tandem.cluster.ray_start import (
    START_ATTEMPTS,
    RayStartError,
    is_loopback_address,
    single_machine_ray,
    start_with_retries,
)

# `tandem` as a fresh process (no Ray initialized by other tests).
CLI = "import sys; from tandem.cluster.cli import main; sys.exit(main(sys.argv[1:]))"

TIMEOUT = "The current node timed out during startup."  # what Ray raises


class FlakyStart:
    """Raises each of `errors` in turn, then returns "started"; counts the undos."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.starts = 0
        self.undos = 0

    def start(self) -> str:
        self.starts += 1
        if self.errors:
            raise self.errors.pop(0)
        return "started"

    def undo(self) -> None:
        self.undos += 1


def test_a_start_that_times_out_is_undone_and_tried_again():
    flaky = FlakyStart(Exception(TIMEOUT))
    assert start_with_retries(flaky.start, flaky.undo) == "started"
    assert (flaky.starts, flaky.undos) == (2, 1)


def test_other_start_errors_are_undone_and_raised_at_once():
    flaky = FlakyStart(ValueError("bad resources"))
    with pytest.raises(ValueError, match="bad resources"):
        start_with_retries(flaky.start, flaky.undo)
    assert (flaky.starts, flaky.undos) == (1, 1)


def test_timeouts_on_every_try_raise_with_each_reason():
    flaky = FlakyStart(*(Exception(f"{TIMEOUT} ({i})") for i in range(START_ATTEMPTS)))
    with pytest.raises(RayStartError, match=f"did not start in {START_ATTEMPTS} tries") as info:
        start_with_retries(flaky.start, flaky.undo)
    assert all(f"({i})" in str(info.value) for i in range(START_ATTEMPTS))
    assert flaky.starts == flaky.undos == START_ATTEMPTS


@pytest.mark.parametrize(
    "command",
    [["pools"], ["scale", "--prefill", "1", "--decode", "1", "--timeout", "5"], ["router"],
     ["drain", "--this-node"]],
)  # fmt: skip
def test_a_ray_address_nothing_answers_at_is_one_line_at_once(command):
    """`ray.init` retries an address nobody listens at for minutes, deaf to `--timeout`
    and SIGTERM: the commands refuse it at once (exit 1, one line)."""
    address = f"127.0.0.1:{free_port()}"
    # A hang ends in TimeoutExpired (the process is killed).
    done = subprocess.run(
        [sys.executable, "-c", CLI, *command, "--ray-address", address],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"tandem {command[0]}: no Ray cluster answers at {address}: [Errno 111] Connection refused"
    ]


@pytest.mark.parametrize(
    ("address", "loopback"),
    [("127.0.0.1:6379", True), ("localhost:6379", True), ("[::1]:6379", True),
     ("ray://127.0.0.1:10001", True), ("10.0.0.5:6379", False), ("ray-head:6379", False),
     ("auto", False)],
)  # fmt: skip
def test_a_loopback_ray_address_is_joined_in_single_machine_mode(address, loopback):
    """A local instance's GCS listens on loopback only; Ray replaces a loopback address by
    the machine's outward one unless the joining process is in single-machine mode."""
    assert is_loopback_address(address) is loopback


def test_single_machine_mode_is_undone_after_the_start():
    variable = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR
    before = (os.environ.get(variable), ray_constants.ENABLE_RAY_CLUSTER)
    with single_machine_ray():
        assert os.environ[variable] == "0"
        assert ray_constants.ENABLE_RAY_CLUSTER is False
    assert (os.environ.get(variable), ray_constants.ENABLE_RAY_CLUSTER) == before
