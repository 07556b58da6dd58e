"""`tandem-bench pools`: migrated streams found in the router's log and measured at the
switch; the pool view that counts as "at target"."""

from __future__ import annotations

import pytest

from tandem.bench.loadgen.traces import RequestTrace
from tandem.bench.pools.bench import migrations
from tandem.bench.pools.scenario import at_target

LOG = (
    "2026-12-01 10:01:20,611 tandem.router.sequence_flow request load-7-p1: worker decode-0 "
    "failed (decode_failed: UNAVAILABLE: Socket closed; x); migrating after 3 tokens\n"
    "... request load-9-p0: worker decode-0 failed (worker_lost: gone); migrating after 0 tokens\n"
    "... request ref-p0: worker decode-0 failed (decode_failed: x); migrating after 9 tokens\n"
)


def trace(req_id: str, times: list[float], ids: list[int], error: str = "") -> RequestTrace:
    return RequestTrace(req_id, "short", 4, len(ids), 0.0, times[-1], times, len(ids), "length",
                        error, ids)  # fmt: skip


def test_migrations_are_measured_at_the_switch_and_checked_against_the_reference():
    reference = [[5, 6, 7], [1, 2, 3, 4, 5]]
    traces = [
        # ITL 0.1 s, then a 0.7 s gap after the 3rd token (the switch).
        trace("load-7-p1", [1.0, 1.1, 1.2, 1.9, 2.0], [1, 2, 3, 4, 5]),
        # Moved before its first token: its TTFT (1.5 s) against the median TTFT.
        trace("load-9-p0", [1.5, 1.6, 1.7], [5, 6, 8]),
        trace("load-10-p0", [0.5, 0.6, 0.7], [5, 6, 7]),
    ]
    by_id = {m.req_id: m for m in migrations(LOG, traces, reference)}
    assert set(by_id) == {"load-7-p1", "load-9-p0"}  # ref-p0 is not a load stream
    moved = by_id["load-7-p1"]
    assert moved.num_streamed == 3 and moved.same_text
    assert moved.stall_s == pytest.approx(0.7) and moved.usual_s == pytest.approx(0.1)
    unstarted = by_id["load-9-p0"]
    assert unstarted.stall_s == pytest.approx(1.5) and unstarted.usual_s == pytest.approx(1.0)
    assert not unstarted.same_text


def test_at_target_wants_every_role_serving_its_target_and_nothing_in_between():
    def view(*states: tuple[str, str, str]) -> dict:
        workers = [{"id": i, "role": r, "state": s} for i, r, s in states]
        return {"workers": workers, "targets": {"prefill": 1, "decode": 2}}

    base = [("p0", "prefill", "serving"), ("d0", "decode", "serving")]
    assert at_target(view(*base, ("d1", "decode", "serving"), ("d9", "decode", "dead")))
    assert not at_target(view(*base))
    assert not at_target(view(*base, ("d1", "decode", "starting")))
    assert not at_target(view(*base, ("d1", "decode", "serving"), ("d2", "decode", "draining")))
    assert not at_target(view(*base, ("d1", "decode", "serving")), without="d1")
