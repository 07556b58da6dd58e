"""KV transfer benchmark: tcp pulls on loopback against raw socket throughput.

"production" is what workers do: the prefill side serves pinned held blocks through
`prefill_worker.server.serve_held_kv` (an engine's `KvPins` over a paged cache) and the
decode side receives straight into pinned reserved blocks through
`decode_worker.service.pull_into_pinned`. The other variants isolate parts of it and
"export" is the path workers took before (copy on the prefill side, receive into a
buffer, copy into the cache).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import multiprocessing as mp
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import torch

from tandem.bench.kv_transfer.table import Row, render
from tandem.bench.report import machine_facts, publish
from tandem.decode_worker.service import pull_into_pinned
from tandem.engine.config import EngineConfig
from tandem.engine.kv_pins import KvPins
from tandem.kv_transfer import CacheBlocks, KvHandle, KvLayout, KvTransferClient, KvTransferService
from tandem.kv_transfer.tcp_server import tune_socket
from tandem.kv_transfer.wire import byte_view, recv_exact, send_payload
from tandem.prefill_worker.server import serve_held_kv
from tandem.proto.tandem.worker.v1 import worker_pb2_grpc

logger = logging.getLogger(__name__)

SECTION_HEADING = "## KV transfer"
PROMPT_TOKENS = (1024, 8192, 32768)


def _serve_main(fingerprint: str, max_blocks: int, conn: mp.connection.Connection) -> None:
    asyncio.run(_serve(KvLayout.from_fingerprint(fingerprint), max_blocks, conn))


async def _serve(layout: KvLayout, max_blocks: int, conn: mp.connection.Connection) -> None:
    # A paged cache with spare blocks; requests own a shuffled subset, as in a real pool.
    cache = torch.randn(layout.block_shape(max_blocks + 64), dtype=layout.torch_dtype)
    block_ids = torch.randperm(max_blocks + 64)[:max_blocks].tolist()
    pins = KvPins(cache)  # as a prefill engine holds each prefilled request's blocks
    for num_tokens in PROMPT_TOKENS:
        num_blocks = math.ceil(num_tokens / layout.block_size)
        pins.open(f"held-{num_blocks}", block_ids[:num_blocks])
        pins.open(f"run-{num_blocks}", list(range(num_blocks)))  # a fresh pool's allocation

    def read_blocks(request_id: str) -> torch.Tensor | CacheBlocks:
        kind, num_blocks = request_id.split("-")
        if kind in ("held", "run"):
            return serve_held_kv(pins.acquire, request_id)
        ids = block_ids[: int(num_blocks)]
        return cache.index_select(2, torch.tensor(ids))  # a fresh copy, as export_kv makes

    service = KvTransferService(layout, read_blocks)
    server = grpc.aio.server()
    worker_pb2_grpc.add_KvTransferServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    raw = socket.create_server(("127.0.0.1", 0))
    payload = torch.empty(layout.block_nbytes(max_blocks), dtype=torch.uint8).fill_(7)
    threading.Thread(target=_raw_server, args=(raw, payload), daemon=True).start()
    conn.send((port, raw.getsockname()[1], cache.index_select(2, torch.tensor(block_ids[:8]))))
    await asyncio.to_thread(conn.recv)  # "stop"
    raw.close()
    await service.stop()
    await server.stop(None)


def _raw_server(listener: socket.socket, payload: torch.Tensor) -> None:
    sock, _ = listener.accept()
    tune_socket(sock, None)
    view, size_buf = byte_view(payload), bytearray(8)
    with sock, contextlib.suppress(ConnectionError):  # the client closed: done
        while True:
            recv_exact(sock, memoryview(size_buf))
            send_payload(sock, [view[: int.from_bytes(size_buf, "big")]])


def rounds(repeats: int, num_tokens: int) -> int:
    """Measured rounds at a prompt length: `repeats`, times 8192 / tokens below 8k."""
    return repeats * max(1, 8192 // num_tokens)


async def measure_transfers(layout: KvLayout, repeats: int) -> list[Row]:
    max_blocks = math.ceil(max(PROMPT_TOKENS) / layout.block_size)
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(
        target=_serve_main, args=(layout.fingerprint(), max_blocks, child)
    )
    proc.start()
    if not await asyncio.to_thread(parent.poll, 120):
        proc.kill()
        raise RuntimeError(f"prefill-side process did not start (exit code {proc.exitcode})")
    port, raw_port, first_blocks = parent.recv()
    raw = socket.create_connection(("127.0.0.1", raw_port))
    tune_socket(raw, 60.0)
    raw_buf = torch.empty(layout.block_nbytes(max_blocks), dtype=torch.uint8)
    client = KvTransferClient(layout, "bench-decode", max_pooled_bytes=2 << 30)
    fresh_client = KvTransferClient(layout, "bench-decode-fresh", max_pooled_bytes=0)
    # The decode side's paged cache (touched, like an engine's), shuffled reserved blocks.
    decode_cache = torch.zeros(layout.block_shape(max_blocks + 64), dtype=layout.torch_dtype)
    reserved = torch.randperm(max_blocks + 64)[:max_blocks].tolist()
    decode_pins = KvPins(decode_cache)  # as a decode engine reserves an import's blocks
    rows = []
    try:
        for num_tokens in PROMPT_TOKENS:
            num_blocks = math.ceil(num_tokens / layout.block_size)
            row = Row(num_tokens, layout.block_nbytes(num_blocks))
            ids, fp = list(range(num_blocks)), layout.fingerprint()
            held = KvHandle("bench", f"127.0.0.1:{port}", f"held-{num_blocks}", ids, num_tokens, fp)
            export = dataclasses.replace(held, request_id=f"export-{num_blocks}")
            got = (await client.pull(held))[:, :, : first_blocks.shape[2]].clone()
            into_ids = reserved[:num_blocks]
            decode_pins.open(held.request_id, into_ids)

            run = dataclasses.replace(held, request_id=f"run-{num_blocks}")
            decode_pins.open(run.request_id, list(range(num_blocks)))

            async def production(handle: KvHandle = held) -> None:
                pinned = decode_pins.acquire(handle.request_id)
                await pull_into_pinned(client, handle, pinned)

            async def export_then_write(
                handle: KvHandle = export, into_ids: list[int] = into_ids
            ) -> None:
                blocks = await client.pull(handle)
                index = torch.tensor(into_ids)
                await asyncio.to_thread(decode_cache.index_copy_, 2, index, blocks)

            fns: dict[str, Callable[[], Awaitable[object]]] = {
                "raw": functools.partial(asyncio.to_thread, _raw_pull, raw, raw_buf, row.nbytes),
                "production": production,
                "adjacent": functools.partial(production, run),
                "pull": functools.partial(client.pull, held),
                "fresh": functools.partial(fresh_client.pull, held),
                "export": export_then_write,
            }
            # Round 0 warms up buffers and the channel. Short pulls get more rounds (their
            # per-pull costs make them noisier); all sizes take about as long.
            for round_ in range(rounds(repeats, num_tokens) + 1):
                for name, fn in fns.items():
                    start = time.perf_counter()
                    await fn()
                    if round_:
                        row.times_s.setdefault(name, []).append(time.perf_counter() - start)
            await production()  # last: what the decode cache holds now
            cached = decode_cache[:, :, into_ids[: first_blocks.shape[2]]]
            if not (torch.equal(got, first_blocks) and torch.equal(cached, first_blocks)):
                raise RuntimeError("pulled blocks differ from the served ones")
            if decode_pins.num_pinned:
                raise RuntimeError("a pull left its reserved blocks pinned")
            logger.info("%d tokens: %s", num_tokens, {n: f"{row.gbps(n):.2f}" for n in fns})
            rows.append(row)
    finally:
        await client.close()
        await fresh_client.close()
        raw.close()
        parent.send("stop")
        await asyncio.to_thread(proc.join, 60)
    return rows


def _raw_pull(sock: socket.socket, buf: torch.Tensor, nbytes: int) -> None:
    sock.sendall(nbytes.to_bytes(8, "big"))
    recv_exact(sock, byte_view(buf)[:nbytes])


def measure_prefill(model_dir: Path) -> dict[int, float]:
    """Seconds to prefill prompts of 1k tokens and of the longest length the model takes."""
    from tandem.engine.llm_engine import Engine
    from tandem.engine.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32"))
    max_len = min(8192, (engine.config.max_model_len or 8193) - 1)
    vocab = engine.model_config.vocab_size
    times: dict[int, float] = {}
    for n in sorted({1024, max_len}):
        for seed in range(2):  # best of two distinct prompts: the machine is shared
            gen = torch.Generator().manual_seed(seed)
            prompt = torch.randint(10, vocab, (n,), generator=gen).tolist()
            start = time.perf_counter()
            engine.add_request(f"p{n}-{seed}", prompt, SamplingParams(max_tokens=1))
            while engine.has_unfinished_requests():
                engine.step()
            times[n] = min(times.get(n, math.inf), time.perf_counter() - start)
    return times


def prefill_model(measured: dict[int, float]) -> Callable[[int], float]:
    """Measured times; longer prompts at the longest measured length's tokens/s (attention
    grows faster than linearly, so this underestimates their prefill time)."""
    longest = max(measured)
    return lambda n: measured.get(n, n * measured[longest] / longest)


def main(args: argparse.Namespace) -> int:
    args.layout = KvLayout("tandem-small", "float32", 16, 12, 4, 64)
    if (args.model / "config.json").is_file():
        config = EngineConfig(model=str(args.model), dtype="float32")
        args.layout = KvLayout.from_engine_config(config)
    facts = machine_facts()
    rows = asyncio.run(measure_transfers(args.layout, args.repeats))
    load_end = list(os.getloadavg())
    if args.prefill_tokens_per_s:
        rate = args.prefill_tokens_per_s
        args.prefill_note = f"`--prefill-tokens-per-s {rate:g}`: prefill s = tokens / {rate:g}."
        prefill, args.measured = prefill_model({1: 1 / rate}), PROMPT_TOKENS
    else:
        args.measured = measured = measure_prefill(args.model)
        prefill = prefill_model(measured)
        shown = ", ".join(f"{n:,} tokens {t:.2f} s" for n, t in sorted(measured.items()))
        args.prefill_note = (
            f"measured with `engine.llm_engine.Engine` (CPU, fp32, default chunked prefill, "
            f"max_tokens=1, best of 2 prompts): {shown}. Longer prompts (past the model's "
            f"max_model_len) are not measured: their time is extrapolated at the "
            f"{max(measured):,}-token rate ({max(measured) / measured[max(measured)]:.0f} "
            "tokens/s), which underestimates it (attention grows faster than linearly), so "
            "their transfer / prefill is an upper bound."
        )
    block = render(
        args.command, facts, load_end, args.layout, args.repeats, rows, prefill, args.measured,
        args.prefill_note,
    )  # fmt: skip
    publish(args.out, SECTION_HEADING, [block])
    return 0
