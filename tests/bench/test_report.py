"""The report writer on synthetic numbers: tables, milliseconds, JSON, doc sections."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from tandem.bench.report import (
    format_ms,
    machine_facts,
    machine_sentence,
    render_table,
    replace_section,
    write_json,
    write_section,
)


def test_format_ms():
    assert format_ms(0.0123) == "12.30 ms"
    assert format_ms(0.5, 0) == "500 ms"
    assert format_ms(float("nan")) == "—"


def test_render_table_markdown_and_plain():
    table = render_table(["a", "b"], [["1", "2"], ["3", "4"]])
    assert table.splitlines() == ["| a | b |", "|:---|---:|", "| 1 | 2 |", "| 3 | 4 |"]
    plain = render_table(["name", "n"], [["x", "10"]], markdown=False)
    assert plain.splitlines() == ["name   n", "----  --", "x     10"]
    with pytest.raises(ValueError):
        render_table(["a", "b"], [["1"]])


DOC = """# Benchmarks

## Engine

engine text

## Router overhead

old router text

## KV transfer

kv text
"""


def test_replace_section_keeps_other_sections():
    out = replace_section(DOC, "## Router overhead", "new router text")
    assert "old router text" not in out
    assert "new router text" in out
    assert out.index("## Engine") < out.index("new router text") < out.index("## KV transfer")
    assert "engine text" in out and "kv text" in out
    # Idempotent: the same body again changes nothing.
    assert replace_section(out, "## Router overhead", "new router text") == out


def test_replace_section_appends_or_starts_a_document():
    out = replace_section(DOC, "## SLO admission under overload", "slo text")
    assert out.rstrip().endswith("slo text\n<!-- /generated -->")
    assert "kv text" in out
    fresh = replace_section("", "## Router overhead", "body")
    assert fresh.startswith("# Benchmarks\n")
    with pytest.raises(ValueError):
        replace_section(DOC, "Router overhead", "body")


def test_replace_section_keeps_hand_written_text_between_generated_blocks():
    out = replace_section(DOC, "## Router overhead", ["table one", "table two"])
    between = "<!-- /generated -->\n\n<!-- generated -->"
    doc = out.replace(between, "<!-- /generated -->\nhand note\n<!-- generated -->")
    again = replace_section(doc, "## Router overhead", ["new one", "new two"])
    assert "hand note" in again and "table one" not in again and "table two" not in again
    assert again.index("new one") < again.index("hand note") < again.index("new two")
    assert "kv text" in again
    # Another number of blocks: the whole section is rewritten.
    assert "hand note" not in replace_section(doc, "## Router overhead", "only")


def test_write_section_creates_then_rewrites_one_section(tmp_path):
    path = tmp_path / "docs" / "benchmarks.md"
    write_section(path, "## Engine", "first")
    write_section(path, "## KV transfer", "kv")
    write_section(path, "## Engine", "second")
    text = path.read_text()
    assert text.startswith("# Benchmarks\n")
    assert "second" in text and "first" not in text and "kv" in text


@dataclass(frozen=True)
class _Sample:
    value: float
    values: tuple[float, ...]


def test_write_json_turns_nan_into_null(tmp_path):
    path = tmp_path / "out" / "r.json"
    write_json(path, {"sample": _Sample(float("nan"), (1.0, float("inf")))})
    assert json.loads(path.read_text()) == {"sample": {"value": None, "values": [1.0, None]}}


def test_machine_sentence_names_the_machine_and_both_load_averages():
    facts = machine_facts()
    assert facts["cores"] >= 1 and facts["started"].endswith("UTC")
    facts["load_avg_at_start"] = [1.0, 2.0, 3.0]
    text = machine_sentence(facts, (4.0, 5.0, 6.0))
    assert text.startswith("**Machine.**")
    assert "1.00 / 2.00 / 3.00" in text and "4.00 / 5.00 / 6.00" in text
