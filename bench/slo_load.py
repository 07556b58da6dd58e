"""Load of the SLO benchmark: sequential requests, an open-loop Poisson trace, metrics.

Open loop means arrivals follow the trace whatever the server does (a slow server
does not slow the clients down), which is how overload really arrives. Every call
has a deadline and the whole trace an overall timeout.
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from collections.abc import Sequence

import grpc

from tandem.bench.router_load import StreamTiming, timed_generate
from tandem.proto.server_options import GRPC_OPTIONS
from tandem.proto.tandem.v1 import generation_pb2 as gen_pb
from tandem.proto.tandem.v1 import generation_pb2_grpc

# name{labels} value, one Prometheus sample per line
_SAMPLE = re.compile(r"^(?P<name>[^{\s]+)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$")


async def sequential(
    endpoint: str, requests: Sequence[gen_pb.GenerateRequest], timeout_s: float
) -> list[StreamTiming]:
    """The requests one after another (unloaded latency, warm-up)."""
    async with grpc.aio.insecure_channel(endpoint, options=GRPC_OPTIONS) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return [await timed_generate(stub, request, timeout_s) for request in requests]


async def open_loop(
    endpoint: str,
    requests: Sequence[gen_pb.GenerateRequest],
    arrivals_s: Sequence[float],
    request_timeout_s: float,
) -> tuple[float, list[StreamTiming]]:
    """Send `requests[i]` at offset `arrivals_s[i]`; (start time, timings in that order)."""
    if len(requests) != len(arrivals_s):
        raise ValueError(f"{len(requests)} requests for {len(arrivals_s)} arrivals")
    async with grpc.aio.insecure_channel(endpoint, options=GRPC_OPTIONS) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await asyncio.wait_for(channel.channel_ready(), 30)
        start = time.monotonic()
        tasks = []
        for offset, request in zip(arrivals_s, requests, strict=True):
            delay = start + offset - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(timed_generate(stub, request, request_timeout_s)))
        # Each call has its own deadline; this bounds the whole drain as well.
        timings = await asyncio.wait_for(asyncio.gather(*tasks), request_timeout_s + 30)
    return start, list(timings)


def scrape_counters(http_endpoint: str, prefixes: Sequence[str]) -> dict[str, float]:
    """The router's `/metrics` samples whose name starts with one of `prefixes`."""
    with urllib.request.urlopen(f"{http_endpoint}/metrics", timeout=10) as reply:
        return parse_samples(reply.read().decode(), prefixes)


def parse_samples(text: str, prefixes: Sequence[str]) -> dict[str, float]:
    """Prometheus text samples whose name starts with one of `prefixes`:
    'name{labels}' -> value, without the `model_name` label (one model per router)."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or not match["name"].startswith(tuple(prefixes)):
            continue
        labels = match["labels"] or ""
        kept = ",".join(p for p in labels.split(",") if p and not p.startswith("model_name="))
        samples[f"{match['name']}{{{kept}}}" if kept else match["name"]] = float(match["value"])
    return samples
