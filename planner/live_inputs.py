"""What one live plan is computed from, smoothed over the last few intervals.

One interval of a few seconds holds few requests: its counter deltas are noisy (an
interval where no request finished has no output length at all) and so are the
router's online-corrected latency models. `InputWindow` keeps the counter readings and
the models of the last `size` intervals, so each plan reads the traffic of the whole
window (one `load_between` over it) and the mean of the window's models.
"""

from __future__ import annotations

from collections import deque
from dataclasses import astuple

from tandem.planner.observe import Counters, ObservedLoad, load_between
from tandem.planner.profile_model import LatencyLaws


def mean_laws(laws: list[LatencyLaws]) -> LatencyLaws:
    """Field-by-field mean of several latency laws."""
    columns = zip(*(astuple(law) for law in laws), strict=True)
    return LatencyLaws(*(sum(column) / len(laws) for column in columns))


def waiting_for_traffic(load: ObservedLoad, min_requests: int) -> str | None:
    """Why the window's traffic is too little to plan from (None: enough)."""
    if load.num_requests < min_requests or load.num_finished == 0:
        return (
            f"waiting for traffic ({load.num_requests} requests, "
            f"{load.num_finished} finished in the window)"
        )
    return None


class InputWindow:
    """Counter readings and latency models of the last `size` intervals."""

    def __init__(self, size: int, now_s: float, counters: Counters) -> None:
        if size < 1:
            raise ValueError(f"the input window must span >= 1 interval, got {size}")
        # size + 1 readings bound `size` intervals.
        self._readings: deque[tuple[float, Counters]] = deque([(now_s, counters)], size + 1)
        self._laws: deque[LatencyLaws] = deque(maxlen=size)

    def observe(self, now_s: float, counters: Counters) -> ObservedLoad:
        """Add this interval's reading; the traffic over the whole window."""
        self._readings.append((now_s, counters))
        start_s, first = self._readings[0]
        return load_between(first, counters, max(1e-6, now_s - start_s))

    def laws(self, latest: LatencyLaws) -> LatencyLaws:
        """Add this interval's models; their mean over the window."""
        self._laws.append(latest)
        return mean_laws(list(self._laws))
