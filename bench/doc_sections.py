"""Sections of docs/benchmarks.md: every benchmark rewrites its own `## ` section and
keeps the others byte for byte (several benchmarks, run at different times, share it)."""

from __future__ import annotations

from pathlib import Path

DOC_TITLE = "# Benchmarks"


def replace_section(doc: str, heading: str, body: str) -> str:
    """`doc` with the section under `heading` (up to the next `## `) set to `body`;
    appended when absent; a missing document gets the title first."""
    if not heading.startswith("## "):
        raise ValueError(f"heading must start with '## ', got {heading!r}")
    if not doc.strip():
        doc = f"{DOC_TITLE}\n"
    lines = doc.splitlines()
    section = [heading, "", *body.strip("\n").splitlines(), ""]
    try:
        start = lines.index(heading)
    except ValueError:
        return "\n".join([*lines, "", *section]).rstrip("\n") + "\n"
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join([*lines[:start], *section, *lines[end:]]).rstrip("\n") + "\n"


def write_section(path: Path, heading: str, body: str) -> None:
    """Read-modify-write one section right away (other runs write other sections)."""
    doc = path.read_text() if path.is_file() else ""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(replace_section(doc, heading, body))
