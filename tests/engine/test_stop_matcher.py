"""StopMatcher against the definitions, on random texts fed in random pieces."""

from __future__ import annotations

import random

import pytest

from tandem.engine.stop_matcher import StopMatch, StopMatcher


def first_occurrence(text: str, new_from: int, stops: list[str]) -> StopMatch | None:
    """The occurrence ending after `new_from` that ends first, the longest at that end."""
    found = [
        StopMatch(start, start + len(stop), stop)
        for stop in stops
        for start in range(len(text) - len(stop) + 1)
        if text.startswith(stop, start) and start + len(stop) > new_from
    ]
    return min(found, key=lambda m: (m.end, m.start), default=None)


def partial_length(text: str, stops: list[str]) -> int:
    """The longest tail of `text` that is a proper prefix of a stop string."""
    return max(
        (n for stop in stops for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0
    )


@pytest.mark.parametrize("alphabet", ["ab", "abc"])
def test_matches_the_definitions(alphabet: str):
    rng = random.Random(len(alphabet))
    num_found = 0
    for _ in range(3000):
        stops = [
            "".join(rng.choices(alphabet, k=rng.randint(1, 6))) for _ in range(rng.randint(1, 4))
        ]
        matcher, text = StopMatcher(stops), ""
        for _ in range(12):
            piece = "".join(rng.choices(alphabet, k=rng.randint(0, 5)))
            report = rng.random() < 0.8  # as below min_tokens: occurrences are not reported
            new_from, text = len(text), text + piece
            expected = first_occurrence(text, new_from, stops) if report else None
            found = matcher.feed(piece, report)
            if expected is not None:
                assert found is not None and (found.start, found.end) == (
                    expected.start,
                    expected.end,
                )
                assert found.stop == text[found.start : found.end]
                num_found += 1
                break
            assert found is None, (stops, text)
            assert matcher.partial_length() == partial_length(text, stops), (stops, text)
    assert num_found > 1000


def test_an_occurrence_in_an_unreported_piece_is_never_reported():
    matcher = StopMatcher(["xy"])
    assert matcher.feed("axy", report=False) is None
    assert matcher.feed("z") is None
    assert matcher.feed("xy") == StopMatch(4, 6, "xy")


def test_the_longest_of_the_stops_completing_first_wins():
    assert StopMatcher(["c", "abc", "bc"]).feed("zabcd") == StopMatch(1, 4, "abc")
    assert StopMatcher(["abcd", "bc"]).feed("abcd") == StopMatch(1, 3, "bc")
