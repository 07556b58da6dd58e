"""Request traces the planner replays: arrival time, prompt length, output length.

Two formats, chosen by the file's suffix:

- Tandem JSONL (`.jsonl`, `.json`): one object per line,
  `{"arrival_s": 0.12, "prompt_tokens": 812, "output_tokens": 64}`.
- The public Azure LLM inference trace (`.csv`): header
  `TIMESTAMP,ContextTokens,GeneratedTokens`, TIMESTAMP a date-time
  (`2023-11-16 18:15:46.6805900`) or seconds; arrivals are taken relative to the first.

A line that cannot be read raises `TraceError` naming the file and the line, so
`tandem plan` can say exactly where to look. Blank lines are skipped.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_FRACTION = re.compile(r"\.(\d{6})\d+")


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file (and line)."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace."""

    # Seconds since the trace's first request.
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Trace:
    """A trace's requests, sorted by arrival."""

    path: str
    requests: tuple[TraceRequest, ...]

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    @property
    def rate_rps(self) -> float:
        """Mean arrival rate (requests / s); inf when every request arrives at once."""
        if len(self.requests) < 2 or self.duration_s <= 0:
            return math.inf
        return (len(self.requests) - 1) / self.duration_s


def read_trace(path: str | Path) -> Trace:
    """The trace at `path` (JSONL or Azure CSV); TraceError names the bad file or line."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    suffix = path.suffix.lower()
    if suffix == ".csv":
        requests = list(_read_azure(path))
    elif suffix in (".jsonl", ".json"):
        requests = list(_read_jsonl(path))
    else:
        raise TraceError(f"{path}: unknown trace format {suffix!r} (use .jsonl or an Azure .csv)")
    if not requests:
        raise TraceError(f"{path}: the trace has no requests")
    requests.sort(key=lambda r: r.arrival_s)
    start = requests[0].arrival_s
    shifted = tuple(
        TraceRequest(r.arrival_s - start, r.prompt_tokens, r.output_tokens) for r in requests
    )
    return Trace(str(path), shifted)


def _read_jsonl(path: Path) -> Iterator[TraceRequest]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise TraceError(f"{where}: not a JSON object ({exc})") from None
            if not isinstance(row, dict):
                raise TraceError(f"{where}: expected a JSON object, got {type(row).__name__}")
            yield _request(
                where,
                _field(where, row, "arrival_s", _seconds),
                _field(where, row, "prompt_tokens", _count),
                _field(where, row, "output_tokens", _count),
            )


def _read_azure(path: Path) -> Iterator[TraceRequest]:
    with path.open(encoding="utf-8", newline="") as handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if header is None or tuple(h.strip() for h in header[:3]) != AZURE_COLUMNS:
            raise TraceError(
                f"{path}:1: expected the Azure header {','.join(AZURE_COLUMNS)}, got {header}"
            )
        for row in reader:
            if not row or not any(cell.strip() for cell in row):
                continue
            where = f"{path}:{reader.line_num}"
            if len(row) < 3:
                raise TraceError(f"{where}: expected 3 columns, got {len(row)}")
            values = dict(zip(AZURE_COLUMNS, row, strict=False))
            yield _request(
                where,
                _field(where, values, "TIMESTAMP", _timestamp),
                _field(where, values, "ContextTokens", _count),
                _field(where, values, "GeneratedTokens", _count),
            )


def _request(where: str, arrival_s: float, prompt_tokens: int, output_tokens: int) -> TraceRequest:
    if prompt_tokens < 1 or output_tokens < 1:
        raise TraceError(f"{where}: prompt and output lengths must be >= 1 token")
    return TraceRequest(arrival_s, prompt_tokens, output_tokens)


def _field(where: str, row: dict[str, Any], name: str, parse: Any) -> Any:
    if name not in row:
        raise TraceError(f"{where}: missing field {name!r}")
    try:
        return parse(row[name])
    except (TypeError, ValueError) as exc:
        raise TraceError(f"{where}: bad {name} {row[name]!r} ({exc})") from None


def _seconds(value: Any) -> float:
    if isinstance(value, bool):
        raise TypeError("a boolean is not a time")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError("must be a finite number >= 0")
    return seconds


def _count(value: Any) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise TypeError("must be a whole number")
    return int(str(value).strip()) if isinstance(value, str) else int(value)


def _timestamp(value: str) -> float:
    text = value.strip()
    try:
        return _seconds(text)
    except ValueError:
        pass
    # Azure writes 7 fractional digits; datetime reads at most 6.
    return datetime.fromisoformat(_FRACTION.sub(r".\1", text)).timestamp()


def write_jsonl(path: str | Path, requests: Sequence[TraceRequest]) -> Path:
    """Write `requests` as a Tandem JSONL trace (what `read_trace` reads back)."""
    path = Path(path)
    with path.open("w", encoding="utf-8") as out:
        for r in requests:
            row = {"arrival_s": r.arrival_s, "prompt_tokens": r.prompt_tokens,
                   "output_tokens": r.output_tokens}  # fmt: skip
            out.write(json.dumps(row) + "\n")
    return path
