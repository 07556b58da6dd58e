"""The serving steps of `tandem-bench gpu-check`: token equality of the engine with CUDA
graphs on and off, of a served 1 prefill + 1 decode cluster whose KV moves by `cuda_ipc`
(both workers on the one GPU), and KV pulls between two processes over `cuda_ipc`.

On the CPU (`--dry-run`) the same code runs with what the CPU allows: graphs `auto`
(off), the cluster and the pulls with `--kv-backend auto` (which picks tcp there).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import statistics
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import grpc
import torch

from tandem.bench.engine import hf_timers, measure
from tandem.bench.harness import free_port, running, tandem_spec
from tandem.engine.config import EngineConfig
from tandem.engine.generate import generate
from tandem.engine.llm_engine import Engine
from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer import CacheBlocks, KvHandle, KvLayout, KvTransferClient, KvTransferService
from tandem.proto.tandem.v1 import generation_pb2 as gen_pb
from tandem.proto.tandem.v1 import generation_pb2_grpc
from tandem.proto.tandem.worker.v1 import worker_pb2_grpc

logger = logging.getLogger(__name__)
PROMPT_LENS = (5, 40, 200)
CHILD_TIMEOUT_S = 120.0


@dataclass
class Equality:
    num_equal: int
    num_prompts: int
    # Decode steps that ran through the CUDA graphs' buffers (0 when graphs were off).
    num_graph_runs: int = 0

    @property
    def ok(self) -> bool:
        return self.num_equal == self.num_prompts


def prompts(vocab: int) -> list[list[int]]:
    return [measure.random_prompt(n, vocab, seed=n) for n in PROMPT_LENS]


def hf_greedy(model_dir: Path, device: str, max_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens for `prompts` (float32, on `device`)."""
    hf = hf_timers.load_hf_model(str(model_dir), torch.float32).to(device)  # type: ignore[arg-type]
    outputs = []
    for prompt in prompts(2048):
        ids = torch.tensor([prompt], device=device)
        out = hf.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                          do_sample=False, pad_token_id=0)  # fmt: skip
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def compare(got: list[list[int]], want: list[list[int]], graph_runs: int = 0) -> Equality:
    same = sum(list(g) == w for g, w in zip(got, want, strict=True))
    return Equality(same, len(want), graph_runs)


def engine_equality(
    model_dir: Path, device: str, max_tokens: int, cuda_graphs: str, want: list[list[int]]
) -> Equality:
    """The engine's greedy tokens (float32, auto attention backend) vs `want`."""
    config = EngineConfig(
        model=str(model_dir), dtype="float32", device=device, cuda_graphs=cuda_graphs
    )
    engine = Engine(config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    got = [o.token_ids for o in generate(engine, prompts(2048), params)]
    graphs = engine.runner.decode_graphs
    return compare(got, want, graphs.num_runs if graphs is not None else 0)


async def _generate(target: str, prompt: list[int], max_tokens: int) -> list[int]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = gen_pb.GenerateRequest(
            prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        )
        tokens: list[int] = []
        async for msg in stub.Generate(request, timeout=CHILD_TIMEOUT_S):
            tokens += msg.token_ids
        return tokens


def disagg_equality(
    model_dir: Path, device: str, kv_backend: str, max_tokens: int, log_dir: Path,
    want: list[list[int]],
) -> Equality:  # fmt: skip
    """`tandem serve --prefill 1 --decode 1 --kv-backend KV_BACKEND` (both workers on
    one GPU: half a GPU each) and its greedy tokens vs `want`."""
    flags = ["--prefill", "1", "--decode", "1", "--device", device, "--kv-backend", kv_backend]
    flags += ["--dtype", "float32", "--max-model-len", "512", "--threads", "1"]
    if device == "cuda":
        flags += ["--gpus-per-worker", "0.5"]
    spec = tandem_spec("tandem 1P+1D", str(model_dir), free_port(), free_port(), flags)
    assert spec.grpc_target is not None
    target = spec.grpc_target.removeprefix("grpc://")
    with running([spec], log_dir):

        async def all_prompts() -> list[list[int]]:
            return list(
                await asyncio.gather(*(_generate(target, p, max_tokens) for p in prompts(2048)))
            )

        got = asyncio.run(all_prompts())
    return compare(got, want)


def _cache(layout: KvLayout, num_blocks: int, device: str) -> torch.Tensor:
    """The same bits in both processes (drawn on the CPU from a fixed seed)."""
    gen = torch.Generator().manual_seed(7)
    cache = torch.randn(layout.block_shape(num_blocks), generator=gen)
    return cache.to(layout.torch_dtype).to(device)


def _serve_kv(layout: KvLayout, num_blocks: int, device: str, conn: Connection) -> None:
    """Child process: a prefill side holding request "r" = every block in reverse order."""

    async def serve() -> None:
        cache = _cache(layout, num_blocks, device)
        ids = list(reversed(range(num_blocks)))
        service = KvTransferService(
            layout, lambda _: CacheBlocks(cache, ids), kv_cache=cache, device=device
        )
        server = grpc.aio.server()
        worker_pb2_grpc.add_KvTransferServicer_to_server(service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        conn.send(port)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop
        await service.stop()
        await server.stop(None)

    asyncio.run(serve())


async def _pull_times(
    layout: KvLayout, port: int, num_blocks: int, backend: str, device: str
) -> tuple[list[float], bool]:
    ids = list(reversed(range(num_blocks)))
    handle = KvHandle("p", f"127.0.0.1:{port}", "r", ids, num_blocks * layout.block_size,
                      layout.fingerprint())  # fmt: skip
    client = KvTransferClient(
        layout, "gpu-check-decode", backend=backend, device=device if device != "cpu" else None
    )
    try:
        first = await client.pull(handle)  # warm-up: channel, mapping, buffers
        exact = torch.equal(first.cpu(), _cache(layout, num_blocks, "cpu")[:, :, ids])
        times = await timed_pulls(client, handle)
    finally:
        await client.close()
    return times, exact


async def timed_pulls(client: KvTransferClient, handle: KvHandle, repeats: int = 5) -> list[float]:
    """Seconds of each of `repeats` pulls of `handle`, one after another."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        await client.pull(handle)
        times.append(time.perf_counter() - start)
    return times


def two_process_kv_gbps(
    layout: KvLayout, num_tokens: int, device: str, backend: str
) -> tuple[float, bool]:
    """(GB/s, bit-exact) of pulls of `num_tokens` tokens' KV from a prefill service in
    another process, over `backend`."""
    num_blocks = -(-num_tokens // layout.block_size)
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve_kv, args=(layout, num_blocks, device, child), daemon=True)
    proc.start()
    try:
        if not parent.poll(CHILD_TIMEOUT_S):
            raise RuntimeError("the KV prefill process did not start in time")
        port = parent.recv()
        times, exact = asyncio.run(_pull_times(layout, port, num_blocks, backend, device))
    finally:
        with contextlib.suppress(OSError):  # the child is gone already
            parent.send("stop")
        proc.join(CHILD_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
    return layout.block_nbytes(num_blocks) / statistics.median(times) / 1e9, exact
