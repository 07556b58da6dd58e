"""`tandem plan` and `tandem profile` from the command line: output shapes and bad input."""

from __future__ import annotations

import json
import os

import pytest

from tandem.cluster.cli import main
from tandem.planner.profile_format import load_profile
from tandem.planner.profile_model import LatencyLaws
from tests.helpers.planner_profile import write_profile

SLOS = ["--ttft-slo", "1.0", "--tpot-slo", "0.05"]


@pytest.fixture
def profile(tmp_path):
    return str(write_profile(tmp_path / "profile.json"))


def plan(*args: str) -> int:
    return main(["plan", *args])


@pytest.mark.timeout(120)
def test_plan_json_and_plot(profile, tmp_path, capsys):
    png = tmp_path / "plan.png"
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(
        json.dumps({"arrival_s": i * 0.1, "prompt_tokens": 800, "output_tokens": 8}) + "\n"
        for i in range(60)
    ))  # fmt: skip
    assert plan("--profile", profile, "--workers", "2", *SLOS, "--trace", str(trace),
                "--json", "--plot", str(png)) == 0  # fmt: skip
    body = json.loads(capsys.readouterr().out)
    assert body["recommended"] == {"prefill": 1, "decode": 1}
    assert [(s["prefill"], s["decode"]) for s in body["splits"]] == [(1, 1)]
    assert body["colocated"]["colocated"] == 2
    assert body["splits"][0]["goodput_rps"] > 0
    assert body["splits"][0]["attainment"] >= 0.9
    assert png.stat().st_size > 1000


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--profile", "{missing}", "--workers", "2", *SLOS, "--isl", "10", "--osl", "5"],
         "no such profile"),
        (["--profile", "{foreign}", "--workers", "2", *SLOS, "--isl", "10", "--osl", "5"],
         "not a Tandem profile"),
        (["--profile", "{profile}", "--workers", "2", *SLOS, "--trace", "{bad_trace}"],
         "bad.jsonl:2"),
        (["--profile", "{profile}", "--workers", "2", "--ttft-slo", "0", "--tpot-slo", "0.1",
          "--isl", "10", "--osl", "5"], "--ttft-slo must be > 0"),
        (["--profile", "{profile}", "--workers", "2", "--ttft-slo", "1", "--tpot-slo", "-1",
          "--isl", "10", "--osl", "5"], "--tpot-slo must be > 0"),
        (["--profile", "{profile}", "--workers", "1", *SLOS, "--isl", "10", "--osl", "5"],
         "--workers must be >= 2"),
        (["--profile", "{profile}", "--workers", "2", *SLOS], "--isl and --osl, or --trace"),
        (["--profile", "{profile}", "--workers", "2", *SLOS, "--isl", "10", "--osl", "5",
          "--shared-cores", "0"], "--shared-cores must be > 0"),
    ],
)  # fmt: skip
def test_bad_input_names_the_culprit_and_exits_2(tmp_path, profile, capsys, args, message):
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"model": "something else"}))
    bad_trace = tmp_path / "bad.jsonl"
    bad_trace.write_text('{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 2}\nnot json\n')
    paths = {"missing": str(tmp_path / "nope.json"), "foreign": str(foreign),
             "profile": profile, "bad_trace": str(bad_trace)}  # fmt: skip
    assert plan(*(a.format(**paths) for a in args)) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_profile_refuses_a_missing_model(tmp_path, capsys):
    assert main(["profile", "--model", str(tmp_path), "--out", str(tmp_path / "p.json")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_profile_takes_every_core_unless_told(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """As `tandem serve`'s default thread policy gives each worker (torch's own default
    can be the physical cores only)."""
    asked: list[int | None] = []

    def measure(model, device, threads, quick):
        asked.append(threads)
        raise ValueError("measured nothing")

    monkeypatch.setattr("tandem.planner.profile.measure_profile", measure)
    out = str(tmp_path / "p.json")
    for threads in ([], ["--threads", "3"]):
        args = ["profile", "--model", str(tiny_model_dir), "--device", "cpu", "--out", out]
        assert main(args + threads) == 2
    assert asked == [os.cpu_count(), 3]
    assert "measured nothing" in capsys.readouterr().err


@pytest.mark.timeout(240)
def test_quick_profile_of_the_tiny_model(tiny_model_dir, tmp_path):
    out = tmp_path / "profile.json"
    assert main(["profile", "--model", str(tiny_model_dir), "--device", "cpu", "--threads", "1",
                 "--quick", "--out", str(out)]) == 0  # fmt: skip
    profile = load_profile(out)
    assert profile.hardware["device"] == "cpu" and profile.hardware["num_threads"] == 1
    assert {s.cached_tokens > 0 for s in profile.prefill} == {True, False}
    assert len({s.batch_size for s in profile.decode}) > 1
    assert profile.transfer and all(s.seconds > 0 for s in profile.transfer)
    laws = LatencyLaws.fit(profile)
    assert laws.prefill_s(512) > laws.prefill_s(32) > 0
    assert laws.decode_s(16, 8000) >= laws.decode_s(1, 64) > 0
