"""Ray's start tried again after a node start timeout (cluster/ray_start.py)."""

from __future__ import annotations

import pytest

from tandem.cluster.ray_start import START_ATTEMPTS, RayStartError, start_with_retries

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
