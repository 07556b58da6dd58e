"""Settings of the live planner (`tandem serve --planner off|observe|auto`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

DEFAULT_PLANNER_INTERVAL_S = 60.0


class PlannerMode(enum.StrEnum):
    # No planner.
    OFF = "off"
    # Recommend (metrics, /admin/pools, `tandem pools`), never act.
    OBSERVE = "observe"
    # Recommend and resize the pools through the pool controller, with hysteresis.
    AUTO = "auto"


@dataclass(frozen=True)
class PlannerConfig:
    mode: PlannerMode = PlannerMode.OBSERVE
    # Seconds between two plans (each looks at the traffic of the interval before it).
    interval_s: float = DEFAULT_PLANNER_INTERVAL_S
    # Worker budget the recommendation spends; None: the pools' size when serving starts.
    max_workers: int | None = None
    # Hysteresis of `auto`: at least this long between two changes (None: 3 intervals) ...
    min_change_interval_s: float | None = None
    # ... a change only when the recommended split's goodput beats the current one's by
    # more than this fraction (below it the plan recommends the current split) ...
    min_gain: float = 0.1
    # ... and only after this many plans in a row recommended it.
    confirmations: int = 2
    # Fewest requests the input window must have seen to plan from it.
    min_requests: int = 5
    # Each plan reads the traffic and the latency models of the last this many
    # intervals (one interval alone is too noisy: see `live_inputs`).
    window_intervals: int = 3
    # Requests per simulated run (the search uses more at high rates).
    num_sim_requests: int = 100

    def __post_init__(self) -> None:
        if not isinstance(self.mode, PlannerMode):
            raise ValueError(f"planner.mode must be one of off, observe, auto, got {self.mode!r}")
        if not self.interval_s > 0:
            raise ValueError(f"planner.interval_s must be > 0, got {self.interval_s}")
        if self.max_workers is not None and self.max_workers < 2:
            raise ValueError(
                f"planner.max_workers must be >= 2 (one per role), got {self.max_workers}"
            )
        if self.min_change_interval_s is not None and self.min_change_interval_s < 0:
            raise ValueError("planner.min_change_interval_s must be >= 0")
        if self.min_gain < 0:
            raise ValueError(f"planner.min_gain must be >= 0, got {self.min_gain}")
        for name in ("confirmations", "min_requests", "num_sim_requests", "window_intervals"):
            if getattr(self, name) < 1:
                raise ValueError(f"planner.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def change_interval_s(self) -> float:
        if self.min_change_interval_s is not None:
            return self.min_change_interval_s
        return 3 * self.interval_s
