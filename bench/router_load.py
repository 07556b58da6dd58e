"""Timed `Generate` calls and the closed-loop load generator of the router benchmark.

`timed_generate` streams one request and records when its first token and its end
arrived (or the gRPC status it failed with). `closed_loop` keeps `concurrency` such
requests in flight for a warm-up plus a measured window and reports the completions
inside the window, plus the CPU each watched process used meanwhile (a router that
is not near 100% of its core was not the bottleneck). It runs as a
`router_procs.run_job` in a process of its own.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass, field

import grpc

from tandem.bench.router_procs import process_cpu_s
from tandem.bench.router_report import LatencySummary
from tandem.proto.server_options import GRPC_OPTIONS
from tandem.proto.tandem.v1 import generation_pb2 as gen_pb
from tandem.proto.tandem.v1 import generation_pb2_grpc

# Common words; the presets' tokenizer makes about one token of each.
_WORD_TEXT = (
    "the of and to in is was for on are with as they be at one have this from or had by "
    "word but what some we can out other were all there when up use your how said an each "
    "she which do their time if will way about many then them write would like so these "
    "her long make thing see him two has look more day could go come did number sound no "
    "most people my over know water than call first who may down side been now find any "
    "new work part take get place made live where after back little only round man year"
)
_WORDS = _WORD_TEXT.split()


def distinct_prompts(count: int, num_words: int, seed: int) -> list[str]:
    """`count` short text prompts that share no prefix block (each starts with its own
    number), so the prefix cache cannot turn their prefill into a lookup."""
    rng = random.Random(seed)
    return [
        f"{seed}-{i}: " + " ".join(rng.choice(_WORDS) for _ in range(num_words))
        for i in range(count)
    ]


@dataclass(frozen=True)
class StreamTiming:
    """One `Generate` call, times from `time.monotonic()`."""

    start_s: float
    # When the first token arrived; None when none did.
    first_token_s: float | None
    end_s: float
    # Arrival time of every token (a message's tokens share its time).
    token_times_s: tuple[float, ...] = ()
    token_ids: tuple[int, ...] = ()
    finished: bool = False
    # gRPC status name when the call failed ("" when it finished).
    error: str = ""

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.start_s

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s


async def timed_generate(
    stub: generation_pb2_grpc.GenerationStub,
    request: gen_pb.GenerateRequest,
    timeout_s: float,
) -> StreamTiming:
    start = time.monotonic()
    times: list[float] = []
    ids: list[int] = []
    finished = False
    error = ""
    try:
        async for msg in stub.Generate(request, timeout=timeout_s):
            now = time.monotonic()
            times += [now] * len(msg.token_ids)
            ids += msg.token_ids
            if msg.finish_reason != gen_pb.FINISH_REASON_UNSPECIFIED:
                finished = True
    except grpc.aio.AioRpcError as exc:
        error = exc.code().name
    if not finished and not error:
        error = "NO_FINISH_REASON"
    return StreamTiming(
        start_s=start,
        first_token_s=times[0] if times else None,
        end_s=time.monotonic(),
        token_times_s=tuple(times),
        token_ids=tuple(ids),
        finished=finished,
        error=error,
    )


@dataclass(frozen=True)
class ClosedLoopArgs:
    endpoint: str
    concurrency: int
    warmup_s: float
    duration_s: float
    prompt: str
    max_tokens: int
    # name -> pid of the processes whose CPU use is reported (the load generator is added).
    watch_pids: dict[str, int] = field(default_factory=dict)
    request_timeout_s: float = 30.0


@dataclass(frozen=True)
class ClosedLoopResult:
    concurrency: int
    duration_s: float
    # Requests that finished inside the measured window.
    num_completed: int
    # Failed requests inside the window, by gRPC status.
    errors: dict[str, int]
    requests_per_s: float
    latency: LatencySummary
    ttft: LatencySummary
    # name -> CPU seconds used per second of the window (1.0 = one core fully busy).
    cpu_utilization: dict[str, float]


def closed_loop(args: ClosedLoopArgs) -> ClosedLoopResult:
    return asyncio.run(_closed_loop(args))


async def _closed_loop(args: ClosedLoopArgs) -> ClosedLoopResult:
    pids = {**args.watch_pids, "load generator": os.getpid()}
    request = gen_pb.GenerateRequest(
        prompt=args.prompt, max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True
    )
    loop = asyncio.get_running_loop()
    window_start = loop.time() + args.warmup_s
    window_end = window_start + args.duration_s
    timings: list[StreamTiming] = []

    async def client(stub: generation_pb2_grpc.GenerationStub) -> None:
        while time.monotonic() < window_end:
            timings.append(await timed_generate(stub, request, args.request_timeout_s))

    async def sample_cpu(at_s: float) -> dict[str, float | None]:
        await asyncio.sleep(max(0.0, at_s - loop.time()))
        return {name: process_cpu_s(pid) for name, pid in pids.items()}

    async with grpc.aio.insecure_channel(args.endpoint, options=GRPC_OPTIONS) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        cpu_start = asyncio.ensure_future(sample_cpu(window_start))
        cpu_end = asyncio.ensure_future(sample_cpu(window_end))
        timeout = args.warmup_s + args.duration_s + args.request_timeout_s + 10
        await asyncio.wait_for(
            asyncio.gather(*(client(stub) for _ in range(args.concurrency))), timeout
        )
        before, after = await cpu_start, await cpu_end
    # `loop.time()` and `time.monotonic()` share a clock on Linux; window by end time.
    inside = [t for t in timings if window_start <= t.end_s <= window_end]
    done = [t for t in inside if not t.error]
    errors: dict[str, int] = {}
    for t in inside:
        if t.error:
            errors[t.error] = errors.get(t.error, 0) + 1
    cpu = {
        name: (after[name] - before[name]) / args.duration_s
        for name in pids
        if before[name] is not None and after[name] is not None
    }
    return ClosedLoopResult(
        concurrency=args.concurrency,
        duration_s=args.duration_s,
        num_completed=len(done),
        errors=errors,
        requests_per_s=len(done) / args.duration_s,
        latency=LatencySummary.of([t.e2e_s for t in done]),
        ttft=LatencySummary.of([t.ttft_s for t in done if t.ttft_s is not None]),
        cpu_utilization=cpu,
    )
