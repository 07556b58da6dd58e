"""A clock that tests move by hand, for components that take `clock=`."""

from __future__ import annotations


class FakeClock:
    """Seconds, as `time.monotonic` gives them, but only `advance` (or `now =`) moves it.

    Reads from other threads (an engine thread, a worker) see plain float updates.
    """

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock only moves forward, got {seconds}")
        self.now += seconds
