"""The engine benchmark's pure helpers on synthetic numbers, and its prefix-hit step on the
tiny model (no timing is asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.bench.cli import parse_args
from tandem.bench.engine.bench import make_plan
from tandem.bench.engine.measure import (
    CpuSnapshot,
    PrefixHit,
    RepeatPolicy,
    build_engine,
    busy_seconds,
    decode_max_tokens,
    foreign_cores,
    median,
    random_prompt,
    repeat_interleaved,
    top_ops,
)
from tandem.bench.engine.report import (
    SECTION_HEADING,
    BenchReport,
    DtypeResult,
    ModelShape,
    OpTime,
    Profile,
    Row,
    decode_roofline,
    floor_target,
    format_table,
    format_time,
    prefill_roofline,
    render_section,
    roofline,
)
from tandem.bench.report import replace_section
from tandem.engine.config import ModelConfig

SMALL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 32000,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
}


@pytest.fixture
def small_shape() -> ModelShape:
    return ModelShape.from_model_config(ModelConfig.from_dict(SMALL_CONFIG))


ROW_NAMES = {"decode": "decode b1", "prefill": "prefill 512", "prefix hit": "prefix hit 16"}
ROW_TOKENS = {"decode": 1, "prefill": 512, "prefix hit": 16}
ROW_CONTEXTS = {"decode": "129–148", "prefill": "", "prefix hit": "1,008 cached"}


def make_row(engine_s: float, floor_s: float, hf_s: float, kind: str = "decode") -> Row:
    return Row(
        name=ROW_NAMES[kind],
        kind=kind,
        num_tokens=ROW_TOKENS[kind],
        engine_s=engine_s,
        transformers_s=hf_s,
        floor_s=floor_s,
        roofline_s=0.010,
        roofline_bound="memory",
        floor_target=floor_target(kind, 1),
        context=ROW_CONTEXTS[kind],
        foreign_cores=0.9,
    )


def make_report(rows: list[Row], quick: bool = False) -> BenchReport:
    machine = {
        "cpu": "Test CPU", "cores": 2, "cpu_capability": "AVX2", "bf16_instructions": [],
        "torch": "2.x", "transformers": "5.x", "python": "3.11", "threads": 2,
        "started": "2025-01-01 00:00 UTC", "load_avg_1m_at_start": 3.0,
    }  # fmt: skip
    report = BenchReport("tandem-bench engine", quick, machine, 15e9, "sdpa")
    report.results = [
        DtypeResult("float32", 80e9, rows, "cpu"),
        DtypeResult("float32", 80e9, rows, "torch"),
        DtypeResult("bfloat16", 10e9, rows),
    ]
    report.profiles = [
        Profile(
            "float32",
            "decode b1",
            3,
            0.05,
            0.04,
            0.03,
            [OpTime("aten::mm", 0.03, 75.0), OpTime("aten::index", 0.006, 15.0)],
        )
    ]
    return report


def test_median_of_odd_and_even_counts_and_empty_raises():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 2.0, 3.0]) == 2.5
    with pytest.raises(ValueError):
        median([])


def test_small_preset_matmul_params(small_shape):
    qkv = 768 * (768 + 2 * 256)
    o, gate_up, down = 768 * 768, 768 * 4096, 2048 * 768
    assert small_shape.layer_matmul_params == qkv + o + gate_up + down
    assert small_shape.matmul_params == 12 * (qkv + o + gate_up + down) + 768 * 32000
    assert small_shape.kv_elements_per_token == 2 * 12 * 4 * 64


def test_flops_count_two_per_multiply_add(small_shape):
    layers = small_shape.num_layers * small_shape.layer_matmul_params
    assert small_shape.matmul_flops(4, 1) == 2 * layers * 4 + 2 * small_shape.lm_head_params
    per_pair = 4 * 12 * 12 * 64
    assert small_shape.attention_flops(1, 10, causal=False) == per_pair * 11
    # Causal from position 0: 3 queries see 1, 2 and 3 keys.
    assert small_shape.attention_flops(3, 0, causal=True) == per_pair * 6


def test_roofline_takes_the_slower_bound():
    memory = roofline(num_bytes=2e9, flops=1e9, bandwidth=1e9, peak_flops=1e10)
    assert memory.time_s == pytest.approx(2.0)
    assert memory.bound == "memory"
    compute = roofline(num_bytes=1e6, flops=1e12, bandwidth=1e9, peak_flops=1e11)
    assert compute.time_s == pytest.approx(10.0)
    assert compute.bound == "compute"
    with pytest.raises(ValueError):
        roofline(1.0, 1.0, 0.0, 1.0)


def test_decode_roofline_reads_weights_once_plus_each_sequences_kv(small_shape):
    one = decode_roofline(small_shape, 1, 100, 4, bandwidth=1e10, peak_flops=1e11)
    eight = decode_roofline(small_shape, 8, 100, 4, bandwidth=1e10, peak_flops=1e11)
    kv_per_seq = 100 * small_shape.kv_elements_per_token * 4
    assert one.num_bytes == small_shape.matmul_params * 4 + kv_per_seq
    assert eight.num_bytes - one.num_bytes == pytest.approx(7 * kv_per_seq)
    assert one.bound == "memory"


def test_prefill_roofline_is_compute_bound_for_512_tokens(small_shape):
    bound = prefill_roofline(small_shape, 512, 4, bandwidth=1.5e10, peak_flops=8e10)
    assert bound.bound == "compute"
    assert bound.flops > 2 * small_shape.num_layers * small_shape.layer_matmul_params * 512


def test_floor_targets():
    assert floor_target("decode", 1) == 1.1
    assert floor_target("decode", 32) == 1.1
    assert floor_target("prefill", 512) == 1.2
    assert floor_target("prefix hit", 16) is None
    assert floor_target("long decode", 1) is None


def test_prefix_hit_row_has_no_floor_target_only_the_transformers_one():
    row = make_row(0.030, 0.010, 0.040, kind="prefix hit")
    assert row.engine_over_floor == pytest.approx(3.0)
    assert row.floor_met and row.transformers_met
    line = format_table([row]).splitlines()[2]
    assert "floor: no target; ≤ HF: met" in line and "(ctx 1,008 cached)" in line
    assert not make_row(0.050, 0.010, 0.040, kind="prefix hit").transformers_met


def test_prefill_roofline_after_a_cached_prefix_reads_its_kv_and_attends_it(small_shape):
    fresh = prefill_roofline(small_shape, 16, 4, bandwidth=1.5e10, peak_flops=8e10)
    hit = prefill_roofline(small_shape, 16, 4, 1.5e10, 8e10, context_len=1008)
    assert hit.num_bytes - fresh.num_bytes == small_shape.kv_elements_per_token * 1008 * 4
    assert hit.flops - fresh.flops == pytest.approx(
        small_shape.attention_flops(16, 1008, True) - small_shape.attention_flops(16, 0, True)
    )


def test_row_ratios_and_targets():
    row = make_row(engine_s=0.0105, floor_s=0.010, hf_s=0.015)
    assert row.engine_over_floor == pytest.approx(1.05)
    assert row.engine_over_transformers == pytest.approx(0.7)
    assert row.floor_met and row.transformers_met
    slow = make_row(engine_s=0.020, floor_s=0.010, hf_s=0.015)
    assert not slow.floor_met and not slow.transformers_met


def test_format_time_picks_a_unit():
    assert format_time(2.5) == "2.50 s"
    assert format_time(0.0123) == "12.3 ms"
    assert format_time(0.000456) == "456 µs"


def test_table_has_one_line_per_row_and_marks_misses():
    rows = [make_row(0.0105, 0.010, 0.015), make_row(0.020, 0.010, 0.015, kind="prefill")]
    table = format_table(rows).splitlines()
    assert len(table) == 2 + len(rows)
    assert table[0].count("|") == 11
    assert "(ctx 129–148)" in table[2] and "**missed**" not in table[2]
    assert "**missed**" in table[3]


def test_replace_section_creates_replaces_and_keeps_other_sections():
    created = replace_section("", SECTION_HEADING, "first")
    assert created.startswith("# Benchmarks\n")
    assert "## Engine\n\n<!-- generated -->\nfirst\n<!-- /generated -->\n" in created
    doc = "# Benchmarks\n\n## Router\n\nrouter text\n\n## Engine\n\nold\n\n## KV\n\nkv text\n"
    updated = replace_section(doc, SECTION_HEADING, "new\n\n### float32\n\ntable")
    assert "old" not in updated
    assert updated.count("## Engine") == 1
    assert "## Router\n\nrouter text" in updated and "## KV\n\nkv text" in updated
    assert updated.index("## Router") < updated.index("## Engine") < updated.index("## KV")
    # Subsections do not end the section, so a second replace leaves no debris.
    again = replace_section(updated, SECTION_HEADING, "newer")
    assert "table" not in again and "## KV\n\nkv text" in again


def test_top_ops_ranks_by_self_time():
    self_times = {"aten::mm": 60.0, "aten::index": 30.0, "aten::add": 10.0}
    ops = top_ops(self_times, 2)
    assert [op.op for op in ops] == ["aten::mm", "aten::index"]
    assert ops[0].percent == pytest.approx(60.0)
    assert ops[0].self_s == pytest.approx(60e-6)
    assert top_ops({}, 3) == []


def test_repeat_interleaved_runs_rounds_within_policy():
    calls: list[str] = []

    def timer(name: str):
        def run_once() -> float:
            calls.append(name)
            return 1.0

        return run_once

    timers = {"a": timer("a"), "b": timer("b")}
    samples = repeat_interleaved(timers, RepeatPolicy(1, 2, 4, budget_s=1e9))
    assert samples == {"a": [1.0] * 4, "b": [1.0] * 4}
    assert calls[:4] == ["a", "b", "a", "b"]
    calls.clear()
    samples = repeat_interleaved(timers, RepeatPolicy(0, 2, 4, budget_s=1e-12))
    assert len(samples["a"]) == 2 and len(calls) == 4


def test_repeat_policy_rejects_bad_bounds():
    with pytest.raises(ValueError):
        RepeatPolicy(0, 3, 2, 1.0)
    with pytest.raises(ValueError):
        RepeatPolicy(0, 1, 2, 0.0)


def test_rendered_section_has_run_machine_tables_and_profiles():
    report = make_report([make_row(0.020, 0.010, 0.015)], quick=True)
    run, tables = render_section(report)
    assert "quick smoke run" in run
    assert "Test CPU" in run and "15.0 GB/s" in run
    assert "### float32 · attention backend `cpu`" in tables and "### bfloat16\n" in tables
    assert "### float32 · attention backend `torch`" in tables
    assert run.count("float32 80.0 GFLOP/s") == 1  # one peak per dtype
    assert "### Profiles of missed targets" in tables and "`aten::mm`" in tables
    assert "10.0 ms outside ops" in tables  # 50 ms wall - 40 ms in ops


def test_quick_plan_is_smaller_than_full():
    quick = make_plan(parse_args(["engine", "--quick"]))
    full = make_plan(parse_args(["engine"]))
    assert quick.runs == (("float32", "auto"),) and quick.batch_sizes == (1, 8)
    assert full.batch_sizes == (1, 8, 32)
    # Both dtypes with the serving backend and with the torch reference backend.
    assert full.runs == (
        ("float32", "auto"), ("float32", "torch"), ("bfloat16", "auto"), ("bfloat16", "torch"),
    )  # fmt: skip
    only = make_plan(parse_args(["engine", "--dtype", "bfloat16"]))
    assert only.runs == (("bfloat16", "auto"),)
    assert quick.decode.max_runs <= full.decode.max_runs
    assert full.decode_seq_len > full.prompt_len + full.decode.max_runs
    # The long-context decode row's prompt leaves room for its steps in the model's positions.
    assert full.long_prompt_len_for(4096) == full.long_prompt_len == 3840
    assert full.long_prompt_len_for(2048) + decode_max_tokens(full.decode) < 2048


def test_busy_seconds_and_foreign_cores():
    stat = "cpu  100 5 50 1000 20 3 2 10 0 0\ncpu0 50 2 25 500 10 1 1 5 0 0\n"
    # user + nice + system + irq + softirq + steal, idle and iowait excluded.
    assert busy_seconds(stat, ticks_per_s=100) == pytest.approx(1.70)
    with pytest.raises(ValueError):
        busy_seconds("intr 1 2 3\n", 100)
    start = CpuSnapshot(busy_s=10.0, own_s=4.0, wall_s=100.0)
    end = CpuSnapshot(busy_s=14.0, own_s=6.0, wall_s=102.0)
    assert foreign_cores(start, end) == pytest.approx(1.0)  # (4 - 2) CPU-s over 2 s
    assert foreign_cores(end, start) == 0.0


def test_prefix_hit_steps_find_the_whole_prefix_cached_and_leave_the_engine_idle(
    tiny_model_dir: Path,
):
    engine = build_engine(
        str(tiny_model_dir), "float32", 1, 32, 2, 64 + 8, "auto", enable_prefix_caching=True
    )
    prefix = random_prompt(64, engine.model_config.vocab_size, seed=3)
    hit = PrefixHit(engine, prefix, 8)
    assert all(hit.step() > 0 for _ in range(3))  # each checks its request hit all 64 tokens
    assert engine.is_idle()


def test_prefix_hit_refuses_an_engine_without_prefix_caching_or_a_partial_block(
    tiny_model_dir: Path,
):
    engine = build_engine(str(tiny_model_dir), "float32", 1, 32, 2, 64 + 8, "auto")
    with pytest.raises(ValueError, match="prefix caching"):
        PrefixHit(engine, list(range(5, 69)), 8)
    cached = build_engine(
        str(tiny_model_dir), "float32", 1, 32, 2, 64 + 8, "auto", enable_prefix_caching=True
    )
    with pytest.raises(ValueError, match="whole blocks"):
        PrefixHit(cached, list(range(5, 65)), 8)
