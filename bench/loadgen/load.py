"""Load drivers: who sends which request when."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from tqdm import tqdm

from tandem.bench.loadgen.clients import Client, ClientConfig, GrpcClient
from tandem.bench.loadgen.traces import RequestTrace
from tandem.bench.loadgen.workloads import RequestSpec, Workload

logger = logging.getLogger(__name__)

RUN_TIMEOUT_ERROR = "cancelled: run timeout"


@dataclass(frozen=True)
class LoadConfig:
    # Closed loop: requests kept in flight. Exactly one of concurrency / rate_rps.
    concurrency: int | None = None
    rate_rps: float | None = None  # open loop: mean Poisson arrival rate, requests per second
    num_requests: int | None = None  # requests to send; at least one of num_requests / duration_s
    duration_s: float | None = None  # stop sending new requests this long after the start
    timeout_s: float = 3600.0  # bound on the whole run, waiting for in-flight requests included
    seed: int = 0  # seed of the Poisson schedule
    progress: bool = True  # a tqdm progress bar on stderr

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate_rps is None):
            raise ValueError("give exactly one of concurrency (closed loop) and rate_rps (open)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.rate_rps is not None and self.rate_rps <= 0:
            raise ValueError(f"rate_rps must be > 0, got {self.rate_rps}")
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("give num_requests, duration_s or both")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


@dataclass(frozen=True)
class Injection:
    """An extra request sent `at_s` seconds after the run starts (e.g. a long prompt)."""

    at_s: float
    spec: RequestSpec


@dataclass(frozen=True)
class LoadResult:
    # Every request sent, in completion order; times relative to the run's start.
    traces: list[RequestTrace]
    duration_s: float  # from the start to the last request's end


def poisson_schedule(
    rate_rps: float, seed: int, num_requests: int | None = None, duration_s: float | None = None
) -> list[float]:
    """Send offsets (s from the start) of a Poisson process at `rate_rps`: exponential
    gaps, the first one counted from 0; up to `num_requests` arrivals and/or those
    before `duration_s`."""
    if rate_rps <= 0:
        raise ValueError(f"rate_rps must be > 0, got {rate_rps}")
    if num_requests is None and duration_s is None:
        raise ValueError("give num_requests, duration_s or both")
    rng = np.random.default_rng(seed)
    offsets: list[float] = []
    now = 0.0
    while num_requests is None or len(offsets) < num_requests:
        now += float(rng.exponential(1.0 / rate_rps))
        if duration_s is not None and now >= duration_s:
            break
        offsets.append(now)
    return offsets


async def run_load(
    client: Client,
    workload: Workload,
    config: LoadConfig,
    injections: Sequence[Injection] = (),
) -> LoadResult:
    """Drive `client` with `workload` as `config` says; `client` must be started."""
    run = _Run(client, config, time.perf_counter())
    drivers: list[Coroutine[Any, Any, None]] = [run.inject(i) for i in injections]
    if config.concurrency is not None:
        indices = itertools.count()
        drivers += [run.closed_worker(workload, indices) for _ in range(config.concurrency)]
        total = None if config.num_requests is None else config.num_requests + len(injections)
    else:
        assert config.rate_rps is not None  # LoadConfig holds exactly one of the two
        schedule = poisson_schedule(
            config.rate_rps, config.seed, config.num_requests, config.duration_s
        )
        drivers.append(run.open_loop(workload, schedule))
        total = len(schedule) + len(injections)
    with tqdm(total=total, unit="req", disable=not config.progress, dynamic_ncols=True) as bar:
        run.bar = bar
        driver_tasks = [asyncio.create_task(d) for d in drivers]
        try:
            await asyncio.wait_for(run.finish(driver_tasks), timeout=config.timeout_s)
        except TimeoutError:
            logger.warning("run timeout (%.0fs): cancelling open requests", config.timeout_s)
            await run.cancel(driver_tasks)
    traces = [t.shifted(run.start_s) for t in run.traces]
    duration_s = max((t.end_s for t in traces), default=time.perf_counter() - run.start_s)
    return LoadResult(traces=traces, duration_s=max(duration_s, 1e-9))


async def grpc_load(
    target: str, workload: Workload, config: LoadConfig, request_timeout_s: float = 120.0
) -> LoadResult:
    """`run_load` with a gRPC client of its own (text prompts), closed afterwards."""
    client_config = ClientConfig(target, prompt_format="text", request_timeout_s=request_timeout_s)
    client = GrpcClient(client_config)
    await client.start()
    try:
        return await run_load(client, workload, config)
    finally:
        await client.close()


class _Run:
    """One run's state: the request tasks it started and the traces they left."""

    def __init__(self, client: Client, config: LoadConfig, start_s: float) -> None:
        self.client = client
        self.config = config
        self.start_s = start_s
        self.traces: list[RequestTrace] = []
        self.requests: set[asyncio.Task[None]] = set()
        self.bar: tqdm | None = None

    def _sending_stopped(self) -> bool:
        limit = self.config.duration_s
        return limit is not None and time.perf_counter() - self.start_s >= limit

    def send(self, spec: RequestSpec, scheduled_s: float | None = None) -> asyncio.Task[None]:
        task = asyncio.create_task(self._send(spec, scheduled_s))
        self.requests.add(task)
        task.add_done_callback(self.requests.discard)
        return task

    async def _send(self, spec: RequestSpec, scheduled_s: float | None) -> None:
        send_s = time.perf_counter()
        try:
            trace = await self.client.stream(spec)
        except asyncio.CancelledError:
            self._record(_failed(spec, send_s, RUN_TIMEOUT_ERROR), scheduled_s)
            raise
        except Exception as exc:  # a client bug must not stop the run; it shows as an error
            logger.exception("request %s raised", spec.req_id)
            trace = _failed(spec, send_s, f"{type(exc).__name__}: {exc}")
        self._record(trace, scheduled_s)

    def _record(self, trace: RequestTrace, scheduled_s: float | None) -> None:
        if scheduled_s is not None:
            trace = replace(trace, scheduled_s=scheduled_s)
        self.traces.append(trace)
        if self.bar is not None:
            self.bar.update(1)
            num_failed = sum(not t.ok for t in self.traces)
            if num_failed:
                self.bar.set_postfix(failed=num_failed, refresh=False)

    async def closed_worker(self, workload: Workload, indices: itertools.count) -> None:
        limit = self.config.num_requests
        while not self._sending_stopped():
            index = next(indices)
            if limit is not None and index >= limit:
                return
            await self.send(workload.request(index))

    async def open_loop(self, workload: Workload, schedule: Sequence[float]) -> None:
        for index, offset in enumerate(schedule):
            due_s = self.start_s + offset
            await asyncio.sleep(max(0.0, due_s - time.perf_counter()))
            self.send(workload.request(index), scheduled_s=due_s)

    async def inject(self, injection: Injection) -> None:
        await asyncio.sleep(max(0.0, self.start_s + injection.at_s - time.perf_counter()))
        await self.send(injection.spec)

    async def finish(self, drivers: list[asyncio.Task[None]]) -> None:
        await asyncio.gather(*drivers)
        while self.requests:  # open-loop requests outlive their driver
            await asyncio.gather(*list(self.requests))

    async def cancel(self, drivers: list[asyncio.Task[None]]) -> None:
        pending = [*drivers, *self.requests]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


def _failed(spec: RequestSpec, send_s: float, error: str) -> RequestTrace:
    end_s = time.perf_counter()
    return RequestTrace(
        spec.req_id, spec.tag, spec.prompt_len, spec.max_tokens, send_s, end_s, error=error
    )
