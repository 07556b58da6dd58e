"""Latency targets (SLOs) and priorities: what "good" means for one request.

The router assigns every request an SLO class at request-flow step 2. A class bundles
an `Slo` (TTFT and ITL targets, either may be absent) with a priority. `SloConfig`
holds the classes and the default; `SloConfig.resolve` turns a class name plus
per-request overrides into the `RequestSlo` the pair selector and admission use.

A request *attains* its SLO when its time to first token is within `ttft_s` and its
mean inter-token latency within `itl_s` (a missing target always holds). Goodput is the
rate of requests that attain their SLO.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from tandem.router.errors import InvalidRequest

# Priorities: larger is more important. `batch` is the floor: it only fills idle capacity.
BATCH_PRIORITY = 0
INTERACTIVE_PRIORITY = 10


def _check_target(name: str, value: float | None) -> None:
    if value is None:
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number of seconds or None, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be > 0 and finite, got {value}")


def _check_priority(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < BATCH_PRIORITY:
        raise ValueError(f"{name} must be an int >= {BATCH_PRIORITY}, got {value!r}")


@dataclass(frozen=True)
class Slo:
    """Latency targets of one request, in seconds; None = no target."""

    # Time to first token, measured from admission.
    ttft_s: float | None = None
    # Inter-token latency (mean gap between streamed tokens after the first).
    itl_s: float | None = None

    def __post_init__(self) -> None:
        _check_target("ttft_s", self.ttft_s)
        _check_target("itl_s", self.itl_s)

    @property
    def has_target(self) -> bool:
        return self.ttft_s is not None or self.itl_s is not None

    def attained(self, ttft_s: float, itl_s: float | None = None) -> bool:
        """Did a request with these measured latencies meet every target?"""
        if self.ttft_s is not None and ttft_s > self.ttft_s:
            return False
        return not (self.itl_s is not None and itl_s is not None and itl_s > self.itl_s)


@dataclass(frozen=True)
class SloClass:
    """A named SLO preset (`interactive`, `batch`, or a custom one)."""

    name: str
    slo: Slo
    # Larger is more important; admission never lets a lower priority displace a higher.
    priority: int

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name must be a non-empty string")
        _check_priority("priority", self.priority)


# Chat-like traffic: a person is waiting for the first token and reading the stream.
INTERACTIVE = SloClass("interactive", Slo(ttft_s=1.0, itl_s=0.1), INTERACTIVE_PRIORITY)
# Offline work (overnight summarisation): no latency target, fills idle capacity only.
BATCH = SloClass("batch", Slo(), BATCH_PRIORITY)


def default_classes() -> dict[str, SloClass]:
    return {INTERACTIVE.name: INTERACTIVE, BATCH.name: BATCH}


@dataclass(frozen=True)
class RequestSlo:
    """The SLO and priority resolved for one request."""

    slo: Slo
    priority: int
    # Class the request was assigned (labels metrics such as `tandem:slo_attainment`).
    class_name: str

    @property
    def ttft_s(self) -> float | None:
        return self.slo.ttft_s

    @property
    def itl_s(self) -> float | None:
        return self.slo.itl_s

    @property
    def is_best_effort(self) -> bool:
        """No latency target at all: admitted only into idle capacity."""
        return not self.slo.has_target


@dataclass
class SloConfig:
    """The router's SLO classes and the class a request gets when it names none."""

    default_class: str = INTERACTIVE.name
    classes: Mapping[str, SloClass] = field(default_factory=default_classes)

    def __post_init__(self) -> None:
        for key, cls in self.classes.items():
            if key != cls.name:
                raise ValueError(f"classes[{key!r}] is named {cls.name!r}; keys must match names")
        if self.default_class not in self.classes:
            known = ", ".join(sorted(self.classes))
            raise ValueError(f"default_class {self.default_class!r} is not one of: {known}")

    def resolve(
        self,
        slo_class: str | None = None,
        *,
        ttft_s: float | None = None,
        itl_s: float | None = None,
        priority: int | None = None,
    ) -> RequestSlo:
        """The request's SLO: its class's preset with any per-request override applied.

        An override of None keeps the class's value. Bad input is the client's fault,
        so it raises `InvalidRequest` (a `ValueError`) naming the offending field as the
        APIs name it (`ttft_slo_s`, `itl_slo_s`).
        """
        name = self.default_class if slo_class is None else slo_class
        preset = self.classes.get(name)
        if preset is None:
            known = ", ".join(sorted(self.classes))
            raise InvalidRequest(f"slo_class {name!r} is not one of: {known}", param="slo_class")
        try:
            for field, override in (("ttft_slo_s", ttft_s), ("itl_slo_s", itl_s)):
                if override is not None:
                    _check_target(field, override)
            slo = Slo(
                ttft_s=preset.slo.ttft_s if ttft_s is None else ttft_s,
                itl_s=preset.slo.itl_s if itl_s is None else itl_s,
            )
            if priority is not None:
                _check_priority("priority", priority)
        except ValueError as exc:
            param = str(exc).split(" ", 1)[0]
            raise InvalidRequest(str(exc), param=param) from exc
        return RequestSlo(slo, preset.priority if priority is None else priority, name)
