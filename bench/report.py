"""The one report writer: tables, numbers, machine facts, results JSON, doc sections."""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tandem.engine.dtype import cpu_info

DOC_TITLE = "# Benchmarks"


def render_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool = True
) -> str:
    """A GitHub markdown table (first column left-aligned, the others right) or, with
    `markdown=False`, aligned plain-text columns; every row has one cell per header."""
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"row {list(row)} has {len(row)} cells, header {len(header)}")
    if markdown:
        lines = ["| " + " | ".join(header) + " |"]
        lines.append("|" + "|".join([":---"] + ["---:"] * (len(header) - 1)) + "|")
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        return "  ".join([first, *(c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))])

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def format_ms(seconds: float, digits: int = 2) -> str:
    """Seconds as milliseconds with the unit ("—" when unknown)."""
    return "—" if math.isnan(seconds) else f"{seconds * 1e3:.{digits}f} ms"


GENERATED = "<!-- generated -->"
END_GENERATED = "<!-- /generated -->"


def replace_section(doc: str, heading: str, body: str | Sequence[str]) -> str:
    """`doc` with the generated blocks of the section under `heading` set to `body` (one
    text per block), keeping the hand-written text between the blocks; when the section
    has no such blocks (or another number of them) the whole section becomes `body`.
    A missing section is appended; a missing document gets the title first."""
    if not heading.startswith("## "):
        raise ValueError(f"heading must start with '## ', got {heading!r}")
    blocks = [body] if isinstance(body, str) else list(body)
    generated = [
        line
        for block in blocks
        for line in (GENERATED, *block.strip("\n").splitlines(), END_GENERATED, "")
    ]
    lines = (doc if doc.strip() else f"{DOC_TITLE}\n").splitlines()
    if heading not in lines:
        section = [heading, "", *generated]
        return "\n".join([*lines, "", *section]).rstrip("\n") + "\n"
    start = lines.index(heading)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    old = lines[start + 1 : end]
    starts = [i for i, line in enumerate(old) if line == GENERATED]
    ends = [i for i, line in enumerate(old) if line == END_GENERATED]
    if len(starts) != len(blocks) or len(ends) != len(blocks):
        new = ["", *generated]
    else:  # keep what lies outside the blocks
        new, kept_from = [], 0
        for number, (block_start, block_end) in enumerate(zip(starts, ends, strict=True)):
            block = [GENERATED, *blocks[number].strip("\n").splitlines(), END_GENERATED]
            new += [*old[kept_from:block_start], *block]
            kept_from = block_end + 1
        new += old[kept_from:]
    return "\n".join([*lines[: start + 1], *new, *lines[end:]]).rstrip("\n") + "\n"


def write_section(path: Path, heading: str, body: str | Sequence[str]) -> None:
    """Read-modify-write one section right away (other runs write other sections)."""
    doc = path.read_text() if path.is_file() else ""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(replace_section(doc, heading, body))


def publish(out: str | None, heading: str, blocks: Sequence[str], write: bool = True) -> None:
    """Print a section's generated blocks and, unless `out` is empty or `write` false,
    write them into the document `out`."""
    print(f"{heading}\n\n" + "\n\n".join(blocks), flush=True)
    if out and write:
        write_section(Path(out), heading, blocks)


def run_block(full_command: str, command: str, wall_s: float, machine: str) -> str:
    """A section's first generated block: the command that reproduces it, this run, the
    machine."""
    return (
        f"Command (full run, from the repository root):\n\n```\n{full_command}\n```\n\n"
        f"This run: `{command}` ({wall_s / 60:.1f} min).\n\n{machine}"
    )


def write_json(path: Path, data: Any) -> None:
    """Raw results (dataclasses become dicts; NaN and infinities are written as null)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plain(data), indent=1, sort_keys=True) + "\n")


def plain(value: Any) -> Any:
    """`value` as JSON data: dataclasses become dicts, NaN and infinities None."""
    if hasattr(value, "__dataclass_fields__"):
        return plain(asdict(value))
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def cpu_model() -> str:
    return cpu_info().get("model name") or platform.processor() or platform.machine()


def machine_facts() -> dict[str, Any]:
    """What the results were measured on (recorded with every result file)."""
    import grpc

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "load_avg_1m_at_start": os.getloadavg()[0],
        "load_avg_at_start": list(os.getloadavg()),
        "python": platform.python_version(),
        "grpc": grpc.__version__,
        "started": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def machine_sentence(facts: dict[str, Any], load_end: Sequence[float]) -> str:
    """The **Machine.** line of a docs section, load averages at the start and the end."""
    start = facts["load_avg_at_start"]
    return (
        f"**Machine.** {facts['cpu']}, {facts['cores']} cores; Python {facts['python']}, "
        f"grpcio {facts['grpc']}; {facts['started']}. Load average (1/5/15 min, `uptime`) "
        f"at start {start[0]:.2f} / {start[1]:.2f} / {start[2]:.2f}, at end "
        f"{load_end[0]:.2f} / {load_end[1]:.2f} / {load_end[2]:.2f}."
    )
