"""What `tandem-bench pools` does to a served cluster: steady greedy streams, kill -9 of
decode workers, scale-downs, each timed through the router's admin API."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import signal
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

from tandem.bench.loadgen.clients import GrpcClient
from tandem.bench.loadgen.traces import RequestTrace
from tandem.bench.loadgen.workloads import RequestSpec

logger = logging.getLogger(__name__)

# Longest wait for one pool change (a kill healed, a drain finished, a scale-up serving).
CHANGE_TIMEOUT_S = 180.0
View = dict[str, Any]


@dataclass(frozen=True)
class PoolEvent:
    """One kill (or drain) of a decode worker; times are seconds from `at_s`."""

    worker_id: str
    at_s: float  # perf_counter time of the kill -9 (or the scale-down call)
    took_s: float  # until the pool serves its target without it (drain: until it stopped)
    detected_s: float = float("nan")  # kill: until the controller listed it dead


def admin(http_url: str, path: str, body: dict[str, int] | None = None) -> View:
    """One admin call (GET, or POST with a JSON body); the pools JSON it answers."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    with urllib.request.urlopen(urllib.request.Request(f"{http_url}{path}", data, headers),
                                timeout=30) as reply:  # fmt: skip
        return dict(json.loads(reply.read()))


def at_target(view: View, without: str = "") -> bool:
    """Every role serves its target, nothing starts or drains, `without` is not serving."""
    states = {w["id"]: w["state"] for w in view["workers"]}
    if "starting" in states.values() or "draining" in states.values():
        return False
    serving = [w["role"] for w in view["workers"] if w["state"] == "serving"]
    counts_ok = all(serving.count(role) == n for role, n in view["targets"].items())
    return counts_ok and states.get(without) != "serving"


async def wait_for(http_url: str, condition, what: str) -> float:
    """Poll `/admin/pools` until `condition(view)`; the perf_counter time it held."""
    deadline = time.perf_counter() + CHANGE_TIMEOUT_S
    while True:
        view = await asyncio.to_thread(admin, http_url, "/admin/pools")
        if condition(view):
            return time.perf_counter()
        if time.perf_counter() > deadline:
            raise TimeoutError(f"pools: no {what} after {CHANGE_TIMEOUT_S:g} s: {view}")
        await asyncio.sleep(0.1)


async def steady_load(client: GrpcClient, prompts: list[tuple[int, ...]], max_tokens: int,
                      concurrency: int, stop: asyncio.Event) -> list[RequestTrace]:  # fmt: skip
    """Closed-loop greedy streams over `prompts` until `stop`; every trace. A request id
    names its prompt (`load-N-pI`), so a trace finds its reference run."""
    traces: list[RequestTrace] = []
    ids = itertools.count()

    async def loop() -> None:
        while not stop.is_set():
            n = next(ids)
            spec = RequestSpec(f"load-{n}-p{n % len(prompts)}", prompts[n % len(prompts)],
                               max_tokens)  # fmt: skip
            traces.append(await client.stream(spec))

    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return traces


async def kill_decode_workers(http_url: str, num_kills: int, settle_s: float) -> list[PoolEvent]:
    """kill -9 the busiest serving decode worker, time detection and healing; repeat."""
    kills = []
    for _ in range(num_kills):
        await wait_for(http_url, at_target, "pools at target")
        await asyncio.sleep(settle_s)  # streams well into their tokens on every worker
        view = await asyncio.to_thread(admin, http_url, "/admin/pools")
        decode = [w for w in view["workers"] if w["role"] == "decode" and w["state"] == "serving"]
        victim = max(decode, key=lambda w: (w["running"], w["id"]))
        os.kill(victim["pid"], signal.SIGKILL)
        killed, vid = time.perf_counter(), victim["id"]

        def dead(view: View, vid: str = vid) -> bool:
            return {w["id"]: w["state"] for w in view["workers"]}.get(vid, "dead") == "dead"

        detected = await wait_for(http_url, dead, f"{vid} found dead")
        healed = await wait_for(http_url, lambda v, w=vid: at_target(v, without=w), "healing")
        kills.append(PoolEvent(vid, killed, healed - killed, detected - killed))
        logger.info("killed %s: dead after %.2f s, healed after %.2f s", vid,
                    detected - killed, healed - killed)  # fmt: skip
    return kills


async def drain_decode_workers(http_url: str, num_drains: int, settle_s: float) -> list[PoolEvent]:
    """Scale decode down by one under load, time until the drained worker stops, scale
    back up; repeat."""
    drains = []
    for _ in range(num_drains):
        await wait_for(http_url, at_target, "pools at target")
        await asyncio.sleep(settle_s)
        before = await asyncio.to_thread(admin, http_url, "/admin/pools")
        targets = before["targets"]
        decode = {w["id"] for w in before["workers"]
                  if w["role"] == "decode" and w["state"] == "serving"}  # fmt: skip
        called = time.perf_counter()
        smaller = {**targets, "decode": targets["decode"] - 1}
        await asyncio.to_thread(admin, http_url, "/admin/scale", smaller)
        # The controller picks the worker to drain just after it answers the call.
        picked: list[str] = []

        def stopped(view: View, picked: list[str] = picked, decode: set[str] = decode) -> bool:
            states = {w["id"]: w["state"] for w in view["workers"]}
            picked[:] = picked or [i for i in decode if states.get(i) != "serving"]
            return bool(picked) and picked[0] not in states

        done = await wait_for(http_url, stopped, "a drained decode worker stopped")
        drains.append(PoolEvent(picked[0], called, done - called))
        logger.info("%s drained and stopped after %.2f s", picked[0], done - called)
        await asyncio.to_thread(admin, http_url, "/admin/scale", targets)
    await wait_for(http_url, at_target, "pools back at target")
    return drains
