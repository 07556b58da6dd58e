"""What the engine benchmark times (the engine, `transformers` through hf_timers.py, bare
matmuls) and how: interleaved repeats, other processes' load, the profiler, the hardware
ceilings."""

from __future__ import annotations

import itertools
import os
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from transformers import PreTrainedModel

from tandem.bench.engine import report
from tandem.bench.engine.hf_timers import hf_decode_timer, hf_prefill_timer, hf_prefix_hit_timer
from tandem.bench.engine.timing import time_call
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import Engine
from tandem.engine.model.llama import LlamaForCausalLM
from tandem.engine.outputs import RequestOutput
from tandem.engine.sampling_params import SamplingParams

# Ids 0-4 are the dummy tokenizer's special tokens; prompts stay clear of them.
_FIRST_PLAIN_TOKEN = 5
_BLOCK_SIZE = 16


@dataclass(frozen=True)
class RepeatPolicy:
    """How often one measurement repeats (warm-up runs are not recorded)."""

    num_warmup: int
    min_runs: int
    max_runs: int
    budget_s: float  # stop after `min_runs` once this much wall time (set-up included) has passed

    def __post_init__(self) -> None:
        if self.num_warmup < 0 or not 1 <= self.min_runs <= self.max_runs or self.budget_s <= 0:
            raise ValueError(f"bad repeat policy {self}")


def median(values: list[float]) -> float:
    return float(statistics.median(values))  # StatisticsError (a ValueError) when empty


def repeat_interleaved(
    timers: dict[str, Callable[[], float]], policy: RepeatPolicy
) -> dict[str, list[float]]:
    """Seconds each timer returns, taken in rounds: interleaving keeps the samples compared
    close in time, so load from other processes skews them alike."""
    for _ in range(policy.num_warmup):
        for timer in timers.values():
            timer()
    samples: dict[str, list[float]] = {name: [] for name in timers}
    start = time.perf_counter()
    for num_rounds in range(1, policy.max_runs + 1):
        for name, timer in timers.items():
            samples[name].append(timer())
        spent = time.perf_counter() - start
        if num_rounds >= policy.min_runs and spent >= policy.budget_s:
            break
    return samples


def top_ops(self_times_us: dict[str, float], num_ops: int) -> list[report.OpTime]:
    """The `num_ops` largest self times, with their share of the total."""
    total = sum(self_times_us.values())
    ranked = sorted(self_times_us.items(), key=lambda item: item[1], reverse=True)
    share = 100.0 / total if total else 0.0
    return [report.OpTime(op, us / 1e6, us * share) for op, us in ranked[:num_ops]]


def profile_self_times(fn: Callable[[], object]) -> tuple[dict[str, float], float]:
    """(self CPU microseconds per op, wall seconds) of one call of `fn` under the profiler."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall_s = time_call(fn)
    return {evt.key: float(evt.self_cpu_time_total) for evt in prof.key_averages()}, wall_s


_PROC_STAT = Path("/proc/stat")
# /proc/stat "cpu" columns counted as busy: user nice system (idle iowait) irq softirq steal.
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)


@dataclass(frozen=True)
class CpuSnapshot:
    """Machine-wide busy CPU seconds, this process's CPU seconds, and when."""

    busy_s: float
    own_s: float
    wall_s: float


def busy_seconds(proc_stat_text: str, ticks_per_s: float) -> float:
    """Busy CPU seconds of all cores from the aggregate `cpu` line of /proc/stat."""
    for line in proc_stat_text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            values = [int(v) for v in fields[1:]]
            return sum(values[i] for i in _BUSY_COLUMNS if i < len(values)) / ticks_per_s
    raise ValueError("no aggregate 'cpu' line in /proc/stat text")


def snapshot() -> CpuSnapshot:
    own_s = os.times().user + os.times().system
    if not _PROC_STAT.is_file():
        return CpuSnapshot(own_s, own_s, time.monotonic())
    busy_s = busy_seconds(_PROC_STAT.read_text(), os.sysconf("SC_CLK_TCK"))
    return CpuSnapshot(busy_s, own_s, time.monotonic())


def foreign_cores(start: CpuSnapshot, end: CpuSnapshot) -> float:
    """Average cores other processes kept busy between two snapshots."""
    elapsed = end.wall_s - start.wall_s
    foreign = (end.busy_s - start.busy_s) - (end.own_s - start.own_s)
    return max(0.0, foreign / elapsed) if elapsed > 0 else 0.0


def wait_until_quiet(max_cores: float, timeout_s: float, probe_s: float = 1.0) -> float:
    """Probe until others use at most `max_cores` (or `timeout_s` passes); the last reading."""
    deadline = time.monotonic() + timeout_s
    while True:
        start = snapshot()
        time.sleep(probe_s)
        load = foreign_cores(start, snapshot())
        if load <= max_cores or time.monotonic() >= deadline:
            return load


def torch_facts(num_threads: int) -> dict[str, Any]:
    """What the engine's times depend on beyond `bench.report.machine_facts()`."""
    import transformers

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    flags = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    bf16 = {"avx512_bf16", "amx_bf16", "avx_ne_convert"}
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "bf16_instructions": sorted(set(flags.split()) & bf16), "torch": torch.__version__,
        "transformers": transformers.__version__, "threads": num_threads,
    }  # fmt: skip


def measure_bandwidth(num_bytes: int = 1 << 30, num_runs: int = 5) -> float:
    """Bytes/s of summing a `num_bytes` float32 tensor (best of `num_runs`)."""
    data = torch.ones(num_bytes // 4, dtype=torch.float32)
    data.sum()  # fault the pages in before timing
    best = min(time_call(data.sum) for _ in range(num_runs))
    return num_bytes / best


def measure_peak_flops(dtype: torch.dtype, size: int = 2048, num_runs: int = 3) -> float:
    """FLOP/s of a square `size` GEMM in `dtype` (best of `num_runs`); `F.linear`, the layout
    of every model projection (without bf16 instructions `a @ b` takes a far slower path)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(size, size, generator=gen).to(dtype)
    weight = torch.randn(size, size, generator=gen).to(dtype)
    with torch.inference_mode():
        F.linear(x, weight)
        best = min(time_call(lambda: F.linear(x, weight)) for _ in range(num_runs))
    return 2.0 * size**3 / best


def random_prompt(num_tokens: int, vocab_size: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(_FIRST_PLAIN_TOKEN, vocab_size) for _ in range(num_tokens)]


def build_engine(
    model_dir: str, dtype: str, num_threads: int, prefill_len: int, max_batch_size: int,
    decode_seq_len: int, attention_backend: str = "auto", enable_prefix_caching: bool = False,
) -> Engine:  # fmt: skip
    """An engine sized for the benchmark: one-step prefill of `prefill_len`, prefix caching
    off unless asked for (the prefix-hit row's engine)."""
    blocks_per_seq = -(-decode_seq_len // _BLOCK_SIZE)
    num_blocks = max(max_batch_size * blocks_per_seq, -(-(prefill_len + 1) // _BLOCK_SIZE))
    config = EngineConfig(
        model=model_dir, dtype=dtype, num_threads=num_threads, block_size=_BLOCK_SIZE,
        num_blocks=num_blocks, max_num_seqs=max_batch_size,
        max_num_batched_tokens=max(prefill_len, max_batch_size),
        max_model_len=max(prefill_len, decode_seq_len) + 1,
        enable_prefix_caching=enable_prefix_caching, attention_backend=attention_backend,
    )  # fmt: skip
    return Engine(config)


def _expect_tokens(outputs: list[RequestOutput], num_expected: int, what: str) -> None:
    if len(outputs) != num_expected:
        raise RuntimeError(f"{what} step produced {len(outputs)} tokens, expected {num_expected}")


def expect_idle(engine: Engine) -> None:
    if not engine.is_idle():
        raise RuntimeError("engine still holds requests or blocks after a measurement")


def prefill_timer(engine: Engine, prompt: list[int]) -> Callable[[], float]:
    """Times the step that prefills a fresh request of `prompt` and samples its one token."""
    counter = itertools.count()
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def run_once() -> float:
        req_id = f"prefill-{next(counter)}"
        engine.add_request(req_id, prompt, params)
        elapsed = time_call(lambda: _expect_tokens(engine.step(), 1, "prefill"))
        if engine.has_unfinished_requests():
            engine.abort(req_id)
        return elapsed

    return run_once


class PrefixHit:
    """Steps that prefill `num_new` fresh tokens after `prefix`, which the engine's prefix
    cache holds (as a chat's next turn finds its history), and sample one token."""

    def __init__(self, engine: Engine, prefix: list[int], num_new: int) -> None:
        if not engine.config.enable_prefix_caching or len(prefix) % engine.config.block_size:
            raise ValueError("a prefix hit needs prefix caching and a prefix of whole blocks")
        self.engine, self.prefix, self.num_new = engine, prefix, num_new
        self._counter = itertools.count()
        self._params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        # Caches the prefix (a prompt longer than a step's token budget takes several steps).
        engine.add_request("prefix-hit-warm", [*prefix, _FIRST_PLAIN_TOKEN], self._params)
        for _ in range(-(-len(prefix) // engine.config.max_num_batched_tokens) + 1):
            engine.step()
        expect_idle(engine)

    def step(self) -> float:
        """Seconds of one such step (its request checked to have hit the whole prefix)."""
        run = next(self._counter)
        req_id = f"prefix-hit-{run}"
        vocab = self.engine.model_config.vocab_size
        prompt = [*self.prefix, *random_prompt(self.num_new, vocab, seed=1_000 + run)]
        self.engine.add_request(req_id, prompt, self._params)
        outputs: list[RequestOutput] = []
        elapsed = time_call(lambda: outputs.extend(self.engine.step()))
        _expect_tokens(outputs, 1, "prefix hit")
        if outputs[0].num_cached_tokens != len(self.prefix):
            raise RuntimeError(
                f"the prefix-hit step found {outputs[0].num_cached_tokens} of the prefix's "
                f"{len(self.prefix)} tokens cached"
            )
        if self.engine.has_unfinished_requests():
            self.engine.abort(req_id)
        return elapsed


class DecodeBatch:
    """A running batch of imported requests; `step()` times one engine step of it."""

    def __init__(self, engine: Engine, batch_size: int) -> None:
        self.engine = engine
        self.batch_size = batch_size

    def step(self) -> float:
        return time_call(lambda: _expect_tokens(self.engine.step(), self.batch_size, "decode"))

    def next_context_len(self) -> int:
        """Keys the next step attends to per sequence (its tokens so far)."""
        return max(req.num_tokens for req in self.engine.scheduler.running)


@contextmanager
def decode_batch(
    engine: Engine, batch_size: int, prompt_len: int, max_tokens: int
) -> Iterator[DecodeBatch]:
    """`batch_size` requests decoding from their first token; aborted on exit."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    req_ids: list[str] = []
    try:
        for i in range(batch_size):
            req_id = f"decode-b{batch_size}-{i}"
            prompt = random_prompt(prompt_len, vocab, seed=i)
            if engine.reserve_import(req_id, prompt, prompt[0], params) is None:
                raise RuntimeError(f"KV pool too small for a decode batch of {batch_size}")
            req_ids.append(req_id)
            engine.commit_import(req_id)
        yield DecodeBatch(engine, batch_size)
    finally:
        for req_id in req_ids:
            engine.abort(req_id)
    expect_idle(engine)


def profile_prefill(engine: Engine, prompt: list[int]) -> tuple[dict[str, float], float]:
    """One prefill step under the profiler (after one unprofiled warm-up)."""
    run_once = prefill_timer(engine, prompt)
    run_once()
    result = profile_self_times(run_once)
    expect_idle(engine)
    return result


def profile_decode(
    engine: Engine, batch_size: int, prompt_len: int, num_steps: int
) -> tuple[dict[str, float], float]:
    """`num_steps` decode steps under the profiler (after one unprofiled warm-up step)."""
    with decode_batch(engine, batch_size, prompt_len, num_steps + 2) as batch:
        batch.step()
        return profile_self_times(lambda: [batch.step() for _ in range(num_steps)])


def matmul_floor_timer(
    model: LlamaForCausalLM, num_rows: int, num_logit_rows: int
) -> Callable[[], float]:
    """Times one pass of the model's weight matmuls alone, in model order, through the
    model's own linear layers (so by the path the engine takes: `F.linear`, or the
    packed kernel where the loader packed the weights)."""
    layers: list[Any] = list(model.layers)  # nn.ModuleList items are typed as plain Modules
    projections: list[Any] = [
        projection
        for layer in layers
        for projection in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                           layer.mlp.gate_up_proj, layer.mlp.down_proj)
    ]  # fmt: skip
    lm_head = model.lm_head
    dtype = model.norm.weight.dtype
    gen = torch.Generator().manual_seed(0)
    inputs = {
        p.in_features: torch.randn(num_rows, p.in_features, generator=gen).to(dtype)
        for p in projections
    }
    head_input = torch.randn(num_logit_rows, lm_head.in_features, generator=gen).to(dtype)

    def one_pass() -> None:
        for projection in projections:
            projection(inputs[projection.in_features])
        lm_head(head_input)

    def run_once() -> float:
        with torch.inference_mode():
            return time_call(one_pass)

    return run_once


NUM_PROFILE_STEPS = 3
NUM_PROFILE_OPS = 8


@dataclass(frozen=True)
class Subjects:
    """What one dtype's rows are measured on, and the ceilings they are held to."""

    engine: Engine
    hf_model: PreTrainedModel
    shape: report.ModelShape
    elem_size: int
    bandwidth: float  # bytes/s
    peak_flops: float  # FLOP/s in this dtype


def decode_max_tokens(policy: RepeatPolicy) -> int:
    """Output tokens a decode row's requests need: every warm-up and timed step, plus slack."""
    return policy.num_warmup + policy.max_runs + 2


# A row's roofline and the context its timed steps attended to.
Bound = tuple[report.Roofline, str]


def _measure(
    subjects: Subjects, timers: dict[str, Callable[[], float]], policy: RepeatPolicy,
    name: str, kind: str, num_tokens: int, roofline: Callable[[float, int], Bound],
) -> report.Row:  # fmt: skip
    """Interleaved samples of the three timers, as a row held to `roofline(peak, runs)`."""
    start = snapshot()
    times = repeat_interleaved(timers, policy)
    load = foreign_cores(start, snapshot())
    # The measured GEMM peak, or the rate the model's own matmuls reached if higher: a
    # square GEMM is not always the fastest shape (bf16 on AVX2 especially).
    decodes = kind in report.DECODE_KINDS
    floor_flops = subjects.shape.matmul_flops(num_tokens, num_tokens if decodes else 1)
    peak = max(subjects.peak_flops, floor_flops / min(times["floor"]))
    bound, context = roofline(peak, len(times["engine"]))
    return report.Row(
        name, kind, num_tokens, median(times["engine"]), median(times["transformers"]),
        median(times["floor"]), bound.time_s, bound.bound, report.floor_target(kind, num_tokens),
        context, load, times,
    )  # fmt: skip


def prefill_row(subjects: Subjects, prompt: list[int], policy: RepeatPolicy) -> report.Row:
    engine, num_tokens = subjects.engine, len(prompt)
    timers = {
        "engine": prefill_timer(engine, prompt),
        "transformers": hf_prefill_timer(subjects.hf_model, prompt),
        "floor": matmul_floor_timer(engine.runner.model, num_tokens, 1),
    }
    ceilings = (subjects.elem_size, subjects.bandwidth)
    row = _measure(
        subjects, timers, policy, f"prefill {num_tokens}", "prefill", num_tokens,
        lambda peak, _: (report.prefill_roofline(subjects.shape, num_tokens, *ceilings, peak), ""),
    )  # fmt: skip
    expect_idle(engine)
    return row


def prefix_hit_row(subjects: Subjects, prefix_hit: PrefixHit, policy: RepeatPolicy) -> report.Row:
    """The prefix-hit row; `prefix_hit` has an engine of its own (prefix caching on)."""
    engine, num_new, prefix_len = prefix_hit.engine, prefix_hit.num_new, len(prefix_hit.prefix)
    new_tokens = random_prompt(num_new, subjects.shape.vocab_size, seed=999)
    timers = {
        "engine": prefix_hit.step,
        "transformers": hf_prefix_hit_timer(subjects.hf_model, prefix_len, new_tokens),
        "floor": matmul_floor_timer(engine.runner.model, num_new, 1),
    }
    ceilings = (subjects.elem_size, subjects.bandwidth)
    row = _measure(
        subjects, timers, policy, f"prefix hit {num_new}", "prefix hit", num_new,
        lambda peak, _: (
            report.prefill_roofline(subjects.shape, num_new, *ceilings, peak, prefix_len),
            f"{prefix_len:,} cached",
        ),
    )  # fmt: skip
    expect_idle(engine)
    return row


def profile_prefix_hit(prefix_hit: PrefixHit, dtype: str, row_name: str) -> report.Profile:
    """One prefix-hit step under the profiler."""
    self_times_us, wall_s = profile_self_times(prefix_hit.step)
    expect_idle(prefix_hit.engine)
    return profile_of_steps(dtype, row_name, 1, self_times_us, wall_s)


def decode_row(
    subjects: Subjects, batch_size: int, prompt_len: int, policy: RepeatPolicy,
    kind: str = "decode",
) -> report.Row:  # fmt: skip
    """Decode steps of `batch_size` sequences after `prompt_len`-token prompts; `kind`
    "long decode" for a context of thousands of keys (no floor target)."""
    engine = subjects.engine
    with decode_batch(engine, batch_size, prompt_len, decode_max_tokens(policy)) as batch:

        def roofline(peak: float, runs: int) -> Bound:
            """Keys attended to per sequence, from the first timed step to the last."""
            last = batch.next_context_len() - 1
            first = last - runs + 1
            context = (first + last) // 2
            bound = report.decode_roofline(
                subjects.shape, batch_size, context, subjects.elem_size, subjects.bandwidth, peak
            )
            return bound, f"{first:,}–{last:,}"

        timers = {
            "engine": batch.step,
            "transformers": hf_decode_timer(
                subjects.hf_model,
                random_prompt(batch_size, subjects.shape.vocab_size, seed=1),
                prompt_len,
            ),
            "floor": matmul_floor_timer(engine.runner.model, batch_size, batch_size),
        }
        name = f"{kind} b{batch_size}"
        return _measure(subjects, timers, policy, name, kind, batch_size, roofline)


def profile_missed(
    engine: Engine, dtype: str, rows: list[report.Row], prompt: list[int], prompt_len: int
) -> list[report.Profile]:
    """Engine profiles of every row that misses a target (`prompt` is the prefill's)."""
    profiles = []
    for row in rows:
        if row.floor_met and row.transformers_met:
            continue
        if row.kind == "prefill":
            num_steps, (self_times_us, wall_s) = 1, profile_prefill(engine, prompt)
        else:
            num_steps = NUM_PROFILE_STEPS
            self_times_us, wall_s = profile_decode(engine, row.num_tokens, prompt_len, num_steps)
        profiles.append(profile_of_steps(dtype, row.name, num_steps, self_times_us, wall_s))
    return profiles


def profile_of_steps(
    dtype: str, row_name: str, num_steps: int, self_times_us: dict[str, float], wall_s: float
) -> report.Profile:
    """A row's profile from `num_steps` steps' op self times and wall time, per step."""
    per_step_us = {op: us / num_steps for op, us in self_times_us.items()}
    matmul_us = sum(us for op, us in per_step_us.items() if op in report.MATMUL_OPS)
    return report.Profile(
        dtype, row_name, num_steps, wall_s / num_steps, sum(per_step_us.values()) / 1e6,
        matmul_us / 1e6, top_ops(per_step_us, NUM_PROFILE_OPS),
    )  # fmt: skip
