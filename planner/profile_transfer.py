"""KV transfer throughput for `tandem profile`: a real prefill-side service, a real pull.

A spawned process runs a `KvTransferService` (gRPC control + TCP data server, as a
prefill worker does) over a paged cache of the model's layout; this process pulls
`n`-token handles with a `KvTransferClient` (as a decode worker does).
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import statistics
import time
from typing import Any

import grpc
import torch

from tandem.engine.config import EngineConfig
from tandem.kv_transfer import KvHandle, KvLayout, KvTransferClient, KvTransferService
from tandem.planner.profile_format import TransferSample
from tandem.proto.tandem.worker.v1 import worker_pb2_grpc

_START_TIMEOUT_S = 120.0


def _serve_main(fingerprint: str, max_blocks: int, conn: Any) -> None:
    asyncio.run(_serve(KvLayout.from_fingerprint(fingerprint), max_blocks, conn))


async def _serve(layout: KvLayout, max_blocks: int, conn: Any) -> None:
    cache = torch.randn(layout.block_shape(max_blocks), dtype=layout.torch_dtype)

    def read_blocks(request_id: str) -> torch.Tensor:
        num_blocks = int(request_id.split("-")[1])
        return cache[:, :, :num_blocks].clone()  # a fresh copy, as export_kv makes

    service = KvTransferService(layout, read_blocks)
    server = grpc.aio.server()
    worker_pb2_grpc.add_KvTransferServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    conn.send(port)
    await asyncio.to_thread(conn.recv)  # "stop"
    await service.stop()
    await server.stop(1.0)


async def pull_times(
    config: EngineConfig, sizes: list[int], repeats: int, context: Any
) -> list[TransferSample]:
    layout = KvLayout.from_engine_config(config)
    max_blocks = math.ceil(max(sizes) / layout.block_size)
    parent, child = context.Pipe()
    proc: mp.Process = context.Process(
        target=_serve_main, args=(layout.fingerprint(), max_blocks, child), daemon=True
    )
    proc.start()
    client = KvTransferClient(layout, "profile-decode")
    try:
        if not await asyncio.to_thread(parent.poll, _START_TIMEOUT_S):
            raise RuntimeError(f"the KV service process did not start (exit {proc.exitcode})")
        port = parent.recv()
        samples = []
        for n in sizes:
            num_blocks = math.ceil(n / layout.block_size)
            handle = KvHandle("profile-prefill", f"127.0.0.1:{port}", f"pull-{num_blocks}",
                              list(range(num_blocks)), n, layout.fingerprint())  # fmt: skip
            times = []
            for round_ in range(repeats + 1):  # round 0 opens the channel, warms buffers
                start = time.perf_counter()
                await client.pull(handle)
                if round_:
                    times.append(time.perf_counter() - start)
            samples.append(TransferSample(n, layout.block_nbytes(num_blocks),
                                          statistics.median(times)))  # fmt: skip
        return samples
    finally:
        await client.close()
        parent.send("stop")
        await asyncio.to_thread(proc.join, 30)
        if proc.is_alive():
            proc.kill()
