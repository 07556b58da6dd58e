"""Inter-token gaps as the decode model learns them: means over spans of tokens."""

from __future__ import annotations

import pytest

from tandem.router.policy import DecodeLatencyModel
from tandem.router.worker_calls import ITL_SPAN_TOKENS, TokenSpan


def bursty_arrivals(step_s: float, num_steps: int) -> list[float]:
    """One token a step, read by the router two messages at a time (a busy event loop):
    every second gap is ~0."""
    return [(i + i % 2) * step_s for i in range(1, num_steps + 1)]


def test_a_span_reports_its_mean_gap_once_it_holds_enough_tokens():
    span = TokenSpan(start_s=10.0)
    gaps = [span.add(1, 10.0 + t) for t in bursty_arrivals(0.03, 3 * ITL_SPAN_TOKENS)]
    reported = [g for g in gaps if g is not None]
    assert gaps[: ITL_SPAN_TOKENS - 1] == [None] * (ITL_SPAN_TOKENS - 1)
    assert reported == pytest.approx([0.03] * 3)


def test_a_message_of_several_tokens_counts_each():
    span = TokenSpan(start_s=0.0)
    assert span.add(ITL_SPAN_TOKENS - 1, 0.7) is None
    assert span.add(2, 0.9) == pytest.approx(0.1)


def test_spans_keep_the_decode_model_from_learning_free_steps():
    """Fed every message's gap, the ~0 gaps of bursts taught the model a decode step of
    ~0.1 ms (the planner then credited a decode worker with thousands of tokens a second);
    fed the spans' means it predicts the 30 ms step it saw."""
    arrivals = bursty_arrivals(0.03, 200)
    per_message, spanned = DecodeLatencyModel(), DecodeLatencyModel()
    span, last = TokenSpan(0.0), 0.0
    for t in arrivals:
        per_message.observe(4, 400, max(0.0, t - last))
        last = t
        if (gap := span.add(1, t)) is not None:
            spanned.observe(4, 400, gap)
    assert spanned.predict(4, 400) == pytest.approx(0.03, rel=0.05)
    assert per_message.predict(4, 400) < 0.01
