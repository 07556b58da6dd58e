"""`tandem-bench run|sweep` against a real in-process cluster, over both targets."""

from __future__ import annotations

import json

import pytest

from tandem.bench.cli import main
from tests.helpers.inproc_cluster import InprocCluster

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

INPUT_LEN, OUTPUT_LEN, NUM_REQUESTS = 16, 8, 8


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    cluster = InprocCluster(str(tiny_model_dir)).start()
    yield cluster
    cluster.stop()


def bench(*args: str) -> int:
    return main([*args, "--no-progress"])


def load_fixed(cluster, target: str, load: list[str], out, *extra: str) -> dict:
    args = [
        "run", "--target", target, "--workload", "fixed",
        "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
        "--num-requests", str(NUM_REQUESTS), "--out", str(out), *load, *extra,
    ]  # fmt: skip
    assert bench(*args) == 0
    cluster.assert_idle()
    return json.loads(out.read_text())


def check_run(results: dict, exact_arrivals: bool) -> None:
    summary = results["summary"]
    assert summary["num_requests"] == NUM_REQUESTS
    assert summary["num_succeeded"] == NUM_REQUESTS and summary["errors"] == {}
    assert summary["total_output_tokens"] == NUM_REQUESTS * OUTPUT_LEN
    assert summary["total_input_tokens"] == NUM_REQUESTS * INPUT_LEN
    assert summary["ttft_s"]["count"] == NUM_REQUESTS and summary["ttft_s"]["p50"] > 0
    assert summary["tpot_s"]["count"] == NUM_REQUESTS
    assert summary["slo_attainment"] == 1.0  # no targets: every success counts
    traces = results["traces"]
    assert sorted(t["req_id"] for t in traces) == sorted(f"short-{i}" for i in range(8))
    for t in traces:
        assert (t["error"], t["finish_reason"], t["num_output_tokens"]) == ("", "length", 8)
        times = t["token_times_s"]
        assert times == sorted(times) and t["send_s"] < times[0] <= t["end_s"]
        assert len(times) == OUTPUT_LEN if exact_arrivals else 1 <= len(times) <= OUTPUT_LEN


def test_run_over_grpc_closed_loop(cluster, tmp_path):
    target = f"grpc://{cluster.grpc_endpoint}"
    results = load_fixed(cluster, target, ["--concurrency", "4"], tmp_path / "grpc.json")
    check_run(results, exact_arrivals=True)
    assert results["server"]["vocab_size"] == 2048
    assert results["config"]["load"]["concurrency"] == 4


def test_run_over_http_open_loop_with_exact_arrivals(cluster, tmp_path):
    results = load_fixed(
        cluster,
        cluster.http_endpoint,
        ["--rate", "50", "--seed", "3"],
        tmp_path / "http.json",
        "--vocab-size", "2048", "--http-logprobs",
    )  # fmt: skip
    check_run(results, exact_arrivals=True)
    assert all(t["scheduled_s"] is not None for t in results["traces"])
    assert results["server"]["prompt_format"] == "ids"


def test_run_over_http_counts_tokens_from_usage(cluster, tmp_path):
    results = load_fixed(
        cluster, cluster.http_endpoint, ["--concurrency", "8"], tmp_path / "usage.json",
        "--vocab-size", "2048",
    )  # fmt: skip
    check_run(results, exact_arrivals=False)


@pytest.mark.parametrize("kind", ["grpc", "http"])
def test_text_prompts_are_counted_by_the_server(cluster, tmp_path, kind):
    target = f"grpc://{cluster.grpc_endpoint}" if kind == "grpc" else cluster.http_endpoint
    out = tmp_path / "text.json"
    args = [
        "run", "--target", target, "--prompt-format", "text", "--input-len", "12",
        "--output-len", "4", "--concurrency", "2", "--num-requests", "4", "--out", str(out),
    ]  # fmt: skip
    assert bench(*args) == 0
    cluster.assert_idle()
    results = json.loads(out.read_text())
    assert results["server"]["prompt_format"] == "text"
    assert results["summary"]["num_succeeded"] == 4
    # 12 words, as the server's tokenizer counted them (BOS included): not 12 exactly.
    prompt_lens = [t["prompt_len"] for t in results["traces"]]
    assert all(len_ > 12 for len_ in prompt_lens)
    assert results["summary"]["total_input_tokens"] == sum(prompt_lens)


def test_sweep_writes_points_and_a_plot(cluster, tmp_path):
    out, plot = tmp_path / "sweep.json", tmp_path / "frontier.png"
    args = [
        "sweep", "--target", f"grpc://{cluster.grpc_endpoint}", "--workload", "fixed",
        "--num-requests", "4", "--input-len", "36", "--output-len", "4", "--concurrency", "1,2",
        "--ttft-slo", "30", "--itl-slo", "30", "--out", str(out), "--plot", str(plot),
    ]  # fmt: skip
    assert bench(*args) == 0
    cluster.assert_idle()
    results = json.loads(out.read_text())
    assert [p["concurrency"] for p in results["points"]] == [1, 2]
    for point in results["points"]:
        assert point["summary"]["num_succeeded"] == 4
        assert point["summary"]["total_input_tokens"] == 4 * 36
        assert point["summary"]["slo_attainment"] == 1.0
    assert plot.stat().st_size > 10_000


def test_unreachable_target_is_a_clean_error(capsys):
    args = ["run", "--target", "grpc://127.0.0.1:1", "--concurrency", "1", "--num-requests", "1"]
    assert bench(*args) == 1
    assert "tandem-bench run: grpc://127.0.0.1:1" in capsys.readouterr().err


def test_mixed_workload_with_a_document_slo_over_strict_openai(cluster, tmp_path):
    """Chats plus documents, the body `transformers serve` accepts (no `ignore_eos`),
    documents judged on their own TTFT target and summarised under their tag."""
    out = tmp_path / "mixed.json"
    args = [
        "run", "--target", cluster.http_endpoint, "--workload", "mixed",
        "--input-len", "24", "--output-len", "6", "--long-fraction", "0.5",
        "--long-input-len", "200", "--long-output-len", "3", "--strict-openai",
        "--prompt-format", "text", "--rate", "20", "--num-requests", "10",
        "--ttft-slo", "60", "--long-ttft-slo", "120", "--itl-slo", "60", "--out", str(out),
    ]  # fmt: skip
    assert bench(*args) == 0
    cluster.assert_idle()
    results = json.loads(out.read_text())
    assert results["config"]["slo"]["long_ttft_s"] == 120
    assert results["summary"]["num_succeeded"] == 10
    assert results["summary"]["slo_attainment"] == 1.0
    by_tag = results["by_tag"]
    assert set(by_tag) == {"long", "short"}
    assert by_tag["long"]["num_requests"] + by_tag["short"]["num_requests"] == 10
    documents = [t for t in results["traces"] if t["tag"] == "long"]
    assert documents and all(t["prompt_len"] >= 150 for t in documents)
