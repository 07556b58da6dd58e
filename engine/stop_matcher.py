"""Finds stop strings in text that arrives piece by piece, in time linear in the text.

For each stop string the matcher keeps how much of it the text read so far ends with
(a Knuth-Morris-Pratt automaton), so a new piece costs its own length times the number
of stop strings, never the length of the text before it or of the stops: 16 stop
strings of 2,000 characters cost the same per token as 16 of 5. That state also says
how much of the text's tail could still grow into a stop string, which a stream must
hold back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopMatch:
    """A stop string occurrence: text[start:end] == stop."""

    start: int
    end: int
    stop: str


class StopMatcher:
    """The stop strings' matching state over a text fed by `feed`."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        # _fallback[k][i]: for stop k, the length of the longest proper prefix of
        # stop[:i + 1] that is also its suffix (KMP's failure function).
        self._fallback = [_prefix_function(s) for s in self._stops]
        # _matched[k]: how many leading characters of stop k the text now ends with.
        self._matched = [0] * len(self._stops)
        self._length = 0

    def feed(self, piece: str, report: bool = True) -> StopMatch | None:
        """Read `piece` (appended to the text). With `report`, the first stop string
        occurrence that ends in it: the one that completes first, the longest of those
        that complete at the same character (so where generating character by character
        would have stopped, however the text was split); matching then stops. Without
        `report`, occurrences ending in `piece` are not reported, ever."""
        stops, fallback, matched = self._stops, self._fallback, self._matched
        for offset, char in enumerate(piece):
            found: StopMatch | None = None
            for k, stop in enumerate(stops):
                m = matched[k]
                while m and stop[m] != char:
                    m = fallback[k][m - 1]
                if stop[m] == char:
                    m += 1
                if m == len(stop):
                    end = self._length + offset + 1
                    if report and (found is None or len(stop) > found.end - found.start):
                        found = StopMatch(end - len(stop), end, stop)
                    m = fallback[k][m - 1]
                matched[k] = m
            if found is not None:
                self._length += offset + 1
                return found
        self._length += len(piece)
        return None

    def partial_length(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop
        string (what may still become one)."""
        return max(self._matched, default=0)


def _prefix_function(text: str) -> list[int]:
    result = [0] * len(text)
    for i in range(1, len(text)):
        k = result[i - 1]
        while k and text[i] != text[k]:
            k = result[k - 1]
        if text[i] == text[k]:
            k += 1
        result[i] = k
    return result
