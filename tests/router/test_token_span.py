"""Inter-token gaps as the decode model learns them: means over spans of tokens."""

from __future__ import annotations

import pytest

from tandem.router.policy import DecodeLatencyModel
from tandem.router.worker_calls import ITL_LAST_SPAN_MIN_TOKENS, ITL_SPAN_TOKENS, TokenSpan
from tests.helpers.grpc_calls import stream_tokens


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


def test_a_streams_last_span_teaches_once_it_holds_a_few_tokens():
    """Outputs shorter than a span teach too: the last message closes the span once it
    holds ITL_LAST_SPAN_MIN_TOKENS (a 6-token output: 5 gaps after its first token)."""
    span = TokenSpan(start_s=1.0)
    gaps = [span.add(1, 1.0 + 0.02 * i, last=i == 5) for i in range(1, 6)]
    assert gaps[:4] == [None] * 4
    assert gaps[4] == pytest.approx(0.02)
    short = TokenSpan(start_s=0.0)
    assert short.add(ITL_LAST_SPAN_MIN_TOKENS - 1, 0.1, last=True) is None


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


@pytest.mark.parametrize(("num_tokens", "lessons"), [(6, 1), (4, 0)])
def test_a_short_output_teaches_its_decode_worker_once(
    cluster, monkeypatch, num_tokens: int, lessons: int
):
    """Through the session cluster: 6 tokens (5 gaps after the first) teach the decode
    model one mean gap when the stream ends; 4 tokens (3 gaps) teach nothing."""
    policy = cluster.router.policy_runtime.policy
    taught: list[float] = []
    observe_itl = policy.observe_itl

    def spy(key: str, gap_s: float) -> None:
        taught.append(gap_s)
        observe_itl(key, gap_s)

    monkeypatch.setattr(policy, "observe_itl", spy)
    stream = stream_tokens(
        cluster.grpc_endpoint, f"short-{num_tokens}", list(range(5, 25)), max_tokens=num_tokens
    )
    tokens, _ = cluster.run(stream)
    assert len(tokens) == num_tokens
    assert len(taught) == lessons and all(gap > 0 for gap in taught)
