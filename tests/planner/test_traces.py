"""Trace readers: Tandem JSONL and the Azure LLM inference CSV; bad lines are named."""

from __future__ import annotations

import pytest

from tandem.planner.traces import TraceError, TraceRequest, read_trace, write_jsonl
from tandem.planner.workload import trace_workload


def test_jsonl_round_trip_sorted_and_relative(tmp_path):
    path = tmp_path / "t.jsonl"
    write_jsonl(path, [TraceRequest(5.0, 100, 10), TraceRequest(3.0, 50, 5)])
    trace = read_trace(path)
    assert trace.requests == (TraceRequest(0.0, 50, 5), TraceRequest(2.0, 100, 10))
    assert trace.rate_rps == pytest.approx(0.5)


def test_azure_csv_with_seven_fraction_digits(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "\n"
        "2023-11-16 18:15:50.1805900,396,109\n"
    )
    trace = read_trace(path)
    assert [r.prompt_tokens for r in trace.requests] == [374, 396]
    assert [r.output_tokens for r in trace.requests] == [44, 109]
    assert trace.requests[1].arrival_s == pytest.approx(3.5)


def test_trace_lengths_are_clipped_to_the_model(tmp_path):
    path = tmp_path / "t.jsonl"
    write_jsonl(path, [TraceRequest(0.0, 5000, 300)])
    workload = trace_workload(read_trace(path), max_model_len=1024)
    assert workload.requests[0].prompt_tokens + workload.requests[0].output_tokens <= 1024


@pytest.mark.parametrize(
    ("name", "text", "where"),
    [
        ("bad.jsonl", '{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 2}\n{oops\n', ":2:"),
        ("missing.jsonl", '{"arrival_s": 0, "prompt_tokens": 3}\n', "output_tokens"),
        ("neg.jsonl", '{"arrival_s": -1, "prompt_tokens": 3, "output_tokens": 2}\n', "arrival_s"),
        ("frac.jsonl", '{"arrival_s": 0, "prompt_tokens": 3.5, "output_tokens": 2}\n', ":1:"),
        ("zero.jsonl", '{"arrival_s": 0, "prompt_tokens": 0, "output_tokens": 2}\n', ":1:"),
        ("hdr.csv", "time,a,b\n1,2,3\n", ":1:"),
        ("row.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\n2,x,3\n", ":3:"),
        ("short.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n1,2\n", ":2:"),
        ("empty.jsonl", "\n", "no requests"),
        ("trace.txt", "1,2,3\n", "unknown trace format"),
    ],
)
def test_malformed_trace_names_file_and_line(tmp_path, name, text, where):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TraceError) as info:
        read_trace(path)
    assert str(path) in str(info.value)
    assert where in str(info.value)


def test_missing_trace_file(tmp_path):
    with pytest.raises(TraceError, match="no such trace file"):
        read_trace(tmp_path / "nope.jsonl")
