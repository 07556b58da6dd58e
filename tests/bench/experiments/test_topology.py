"""The topology suite: what it starts, and how it turns rounds into ratios."""

from __future__ import annotations

import dataclasses
import os

import pytest

from tandem.bench.experiments import topology
from tandem.bench.harness import session_cpu_s
from tandem.bench.loadgen.metrics import summarize
from tandem.cluster.cli import build_parser, cluster_config_from_args
from tandem.engine import dtype as dtype_module


def test_the_default_system_is_make_serve_and_variants_add_flags_and_env(tiny_model_dir):
    default, spin = topology.tandem_specs(str(tiny_model_dir), ["spin-wait"])
    serve_at = default.argv.index("serve")
    # Nothing but the model and the ports: every other setting is `make serve`'s default.
    assert default.argv[serve_at + 1 :: 2] == ("--model", "--grpc-port", "--http-port")
    assert spin.env["GOMP_SPINCOUNT"] == "300000"
    peer = topology.peer_spec(str(tiny_model_dir), "bfloat16")
    assert peer.argv[-2:] == ("--dtype", "bfloat16") and "--continuous-batching" in peer.argv
    plain = topology.plain_peer_spec(str(tiny_model_dir), "bfloat16")
    assert plain.argv[-2:] == ("--dtype", "bfloat16")
    assert not any(a.startswith(("--continuous", "--cb-")) for a in plain.argv)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [({"amx_bf16"}, "bfloat16"), ({"avx512_bf16"}, "bfloat16"), ({"avx512f"}, "float32")],
)
def test_the_peer_gets_the_dtype_make_serve_runs(tiny_model_dir, monkeypatch, flags, expected):
    monkeypatch.setattr(dtype_module, "cpu_flags", lambda: frozenset(flags))
    serve = build_parser().parse_args(["serve", "--model", str(tiny_model_dir)])
    assert cluster_config_from_args(serve).engine.resolved_dtype == expected
    assert topology.serve_dtype(str(tiny_model_dir)) == expected


def _run(tps: float) -> topology.LevelRun:
    summary = dataclasses.replace(summarize([], duration_s=1.0), output_throughput_tps=tps)
    return topology.LevelRun(summary, cpu_s_per_token=0.01)


def test_rows_give_the_ratio_of_medians_and_each_rounds_ratio():
    results = {
        "tandem": {8: [_run(120.0), _run(90.0), _run(150.0)]},
        topology.PEER_LABEL: {8: [_run(100.0), _run(100.0), _run(100.0)]},
    }
    (mine, peer) = topology.render_rows(results, topology.PEER_LABEL)
    assert mine[:4] == ["tandem · c=8", "120.0", "**1.20x**", "1.20, 0.90, 1.50"]
    assert peer[2] == "-"


def test_rows_add_the_ratio_to_the_plain_peer_when_measured():
    results = {
        "tandem": {8: [_run(120.0)]},
        topology.PEER_LABEL: {8: [_run(100.0)]},
        topology.PLAIN_PEER_LABEL: {8: [_run(60.0)]},
    }
    mine, peer, plain = topology.render_rows(results, topology.PEER_LABEL)
    assert mine[4] == "2.00x" and peer[4] == "-" and plain[4] == "-"


def test_session_cpu_s_counts_this_session():
    if not os.path.exists("/proc/self/stat"):
        pytest.skip("no /proc")
    assert session_cpu_s(os.getsid(0)) > 0.0
    assert session_cpu_s(2**22 + 7) == 0.0
