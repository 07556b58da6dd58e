"""The `cuda_ipc` backend on CPU: which backend a worker pair gets (and the refusals),
the IPC description's encoding and GPU lookup, the prefill side's pins, the start-up
errors of impossible choices, and `auto` negotiating tcp over real gRPC for CPU
workers. Mapping a cache across processes needs a GPU (`tandem-bench gpu-check`)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest
import torch

from tandem.cluster.cli import CliError, build_parser, cluster_config_from_args
from tandem.kv_transfer import CacheBlocks, KvTransferClient, KvTransferError
from tandem.kv_transfer.cuda_ipc import (
    BackendRefused,
    CudaIpcCache,
    Placement,
    choose_channel_backend,
    local_device_index,
)
from tandem.kv_transfer.cuda_ipc_channel import CudaIpcServerChannel
from tandem.kv_transfer.service import KvTransferService
from tandem.proto.cluster_auth import ClusterAuth, internal_channel
from tandem.proto.tandem.worker.v1 import worker_pb2, worker_pb2_grpc
from tandem.worker.config import KvBackend, WorkerSettings, check_kv_backend, resolve_kv_backend
from tests.helpers.clock import FakeClock
from tests.helpers.kv_transfer_harness import TINY, FakeEngine, bits, prefill_server, random_cache

pytestmark = pytest.mark.timeout(60)

GPU_A = Placement("node-1/boot", 100, "GPU-aaaa")
SAME_GPU_OTHER_PROCESS = replace(GPU_A, pid=200)
OTHER_GPU_SAME_NODE = Placement("node-1/boot", 300, "GPU-bbbb")
OTHER_NODE = Placement("node-2/boot", 100, "GPU-cccc")
CPU = Placement("node-1/boot", 400, "")


@pytest.mark.parametrize(
    ("requested", "decode", "prefill", "want"),
    [
        ("auto", SAME_GPU_OTHER_PROCESS, GPU_A, "cuda_ipc"),
        ("auto", OTHER_GPU_SAME_NODE, GPU_A, "cuda_ipc"),
        ("auto", OTHER_NODE, GPU_A, "nccl"),
        ("auto", CPU, GPU_A, "tcp"),
        ("auto", GPU_A, GPU_A, "tcp"),  # one process: no IPC to itself
        ("tcp", OTHER_NODE, GPU_A, "tcp"),
        ("cuda_ipc", SAME_GPU_OTHER_PROCESS, GPU_A, "cuda_ipc"),
        ("nccl", OTHER_GPU_SAME_NODE, GPU_A, "nccl"),
        ("nccl", OTHER_NODE, GPU_A, "nccl"),
    ],
)
def test_backend_choice(requested: str, decode: Placement, prefill: Placement, want: str) -> None:
    assert choose_channel_backend(requested, decode, prefill, nccl_offered=True) == want


@pytest.mark.parametrize(
    ("requested", "decode", "nccl_offered", "reason"),
    [
        ("cuda_ipc", OTHER_NODE, True, "needs both workers on one node"),
        ("cuda_ipc", GPU_A, True, "two processes"),
        ("cuda_ipc", CPU, True, "needs GPU engines on both workers"),
        ("nccl", SAME_GPU_OTHER_PROCESS, True, "NCCL refuses two ranks on one device"),
        ("nccl", CPU, True, "needs GPU engines"),
        ("nccl", OTHER_NODE, False, "NCCL is unavailable on the decode worker"),
        ("auto", OTHER_NODE, False, "NCCL is unavailable on the decode worker"),
        ("rdma", OTHER_NODE, True, "unknown KV backend"),
    ],
)
def test_impossible_choices_are_refused(
    requested: str, decode: Placement, nccl_offered: bool, reason: str
) -> None:
    with pytest.raises(BackendRefused, match=reason):
        choose_channel_backend(requested, decode, GPU_A, nccl_offered)


def test_ipc_description_round_trip_and_device_lookup() -> None:
    desc = CudaIpcCache(
        "GPU-aaaa", "00ff", 4096, 512, "abcd", 8, "", False, (2, 2, 3, 4, 2, 8), (1,) * 6, 4,
        "bfloat16",
    )  # fmt: skip
    assert CudaIpcCache.from_bytes(desc.to_bytes()) == desc
    with pytest.raises(ValueError, match="not a CUDA IPC cache description"):
        CudaIpcCache.from_bytes(b'{"gpu_uuid": "x"}')
    with pytest.raises(ValueError, match="only a CUDA tensor"):
        CudaIpcCache.export(torch.zeros(2))
    assert local_device_index("GPU-bbbb", ["GPU-aaaa", "GPU-bbbb"]) == 1
    with pytest.raises(KvTransferError, match="not visible to this decode worker"):
        local_device_index("GPU-cccc", ["GPU-aaaa"])


def test_pins_last_until_finish_expiry_or_close() -> None:
    clock = FakeClock()
    channel = CudaIpcServerChannel("ch", timeout_s=5.0, clock=clock)
    unpinned: list[str] = []

    def blocks(name: str, ids: list[int]) -> CacheBlocks:
        return CacheBlocks(torch.zeros(1), ids, on_done=lambda: unpinned.append(name))

    assert channel.pin("a", blocks("a", [3, 1])) == [3, 1]
    channel.pin("b", blocks("b", [2]))
    channel.pin("c", blocks("c", [4]))
    assert channel.finish("a") and not channel.finish("a")
    assert unpinned == ["a"]
    clock.advance(5.0)
    channel.pin("d", blocks("d", [5]))
    assert channel.expire() == 2 and sorted(unpinned) == ["a", "b", "c"]
    channel.pin("d", blocks("d2", [5]))  # a repeated pull replaces (and unpins) the first
    assert unpinned[-1] == "d" and channel.num_pinned == 1
    channel.close()
    assert unpinned[-1] == "d2" and channel.num_pinned == 0


def test_the_service_unpins_a_pull_whose_finish_never_comes() -> None:
    """A decode worker killed between its Pull and FinishPull pulls on that channel no
    more, so no later Pull expires its pin: the service's own expiry (every half
    timeout, from the first cuda_ipc channel until stop) unpins it."""
    service = KvTransferService(TINY, read_blocks=lambda request_id: None, timeout_s=0.2)
    unpinned: list[str] = []

    async def scenario() -> None:
        channel = CudaIpcServerChannel("ch", timeout_s=0.2)
        service._ipc["ch"] = channel  # what OpenChannel adds (it needs a CUDA cache)
        service._opened("ch")
        channel.pin("r", CacheBlocks(torch.zeros(1), [3], on_done=lambda: unpinned.append("r")))
        async with asyncio.timeout(5.0):
            while channel.num_pinned:
                await asyncio.sleep(0.05)
        await service.stop()

    asyncio.run(scenario())
    assert unpinned == ["r"]
    assert service._sweeper is None


def test_the_service_closes_the_channels_of_a_gone_decode_worker() -> None:
    """A decode worker killed, or lost with its node, never closes its channels (a live
    one closes those idle for a minute): the service closes each cuda_ipc channel no
    call has used for `idle_close_s`, not one a call used since (here FinishPull, over
    gRPC) nor one with a pull pinned (until that pin ends). A Pull on a closed channel
    then fails with FAILED_PRECONDITION, on which the decode side opens a new one. (NCCL
    channels are closed the same way; they need GPUs.)"""
    idle_close_s = 0.5
    unpinned: list[str] = []

    async def scenario() -> None:
        async with prefill_server(TINY, lambda request_id: None, timeout_s=60.0,
                                  idle_close_s=idle_close_s) as prefill:  # fmt: skip
            service = prefill.service
            for channel_id in ("gone", "used", "pinned"):
                # What OpenChannel adds (it needs a CUDA cache).
                service._ipc[channel_id] = CudaIpcServerChannel(channel_id, timeout_s=60.0)
                service._opened(channel_id)
            service._ipc["pinned"].pin(
                "r", CacheBlocks(torch.zeros(1), [3], on_done=lambda: unpinned.append("r"))
            )
            assert service.close_idle_channels() == 0
            assert service.stats().num_open_channels == 3
            await asyncio.sleep(idle_close_s + 0.1)
            async with internal_channel(prefill.endpoint, ClusterAuth(), options=()) as channel:
                stub = worker_pb2_grpc.KvTransferStub(channel)
                finish = worker_pb2.FinishPullRequest(channel_id="used", request_id="x")
                await stub.FinishPull(finish, timeout=5.0)
                assert service.close_idle_channels() == 1
                assert sorted(service._ipc) == ["pinned", "used"] and unpinned == []
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    pull = worker_pb2.PullRequest(channel_id="gone", request_id="r")
                    await stub.Pull(pull, timeout=5.0)
            assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "no open NCCL or cuda_ipc channel 'gone'" in str(refused.value.details())
            service._ipc["pinned"].finish("r")
            await asyncio.sleep(idle_close_s + 0.1)
            assert service.close_idle_channels() == 2
            assert service.stats().num_open_channels == 0

    asyncio.run(asyncio.wait_for(scenario(), 30))
    assert unpinned == ["r"]


def test_start_up_errors_for_impossible_choices(tiny_model_dir: object) -> None:
    with pytest.raises(ValueError, match="kv_backend cuda_ipc needs GPU engines"):
        check_kv_backend(KvBackend.CUDA_IPC, "cpu")
    with pytest.raises(ValueError, match="kv_backend must be one of auto, tcp"):
        WorkerSettings(kv_backend="rdma")  # type: ignore[arg-type]
    assert resolve_kv_backend(KvBackend.AUTO, "cpu") is KvBackend.TCP
    assert resolve_kv_backend(None, "cuda:0") is KvBackend.AUTO
    assert resolve_kv_backend(KvBackend.CUDA_IPC, "cuda") is KvBackend.CUDA_IPC
    for backend in ("cuda_ipc", "nccl"):
        args = build_parser().parse_args(
            ["serve", "--model", str(tiny_model_dir), "--device", "cpu", "--kv-backend", backend]
        )
        with pytest.raises(CliError, match=f"--kv-backend {backend} moves KV between GPUs"):
            cluster_config_from_args(args)


def test_cpu_workers_negotiate_tcp_and_refuse_gpu_backends() -> None:
    engine = FakeEngine(random_cache(TINY, 16), {"r": [3, 7, 1]})

    async def run() -> None:
        async with prefill_server(TINY, engine.read_blocks) as prefill:
            handle = prefill.handle(TINY, "r", [3, 7, 1])
            auto = KvTransferClient(TINY, "decode-auto", backend="auto")
            ipc = KvTransferClient(TINY, "decode-ipc", backend="cuda_ipc")
            try:
                got = await auto.pull(handle)
                assert torch.equal(bits(got), bits(engine.expected("r")))
                with pytest.raises(KvTransferError, match="needs GPU engines on both workers"):
                    await ipc.pull(handle)
            finally:
                await auto.close()
                await ipc.close()
            assert prefill.service.stats().num_open_channels == 0

    asyncio.run(asyncio.wait_for(run(), 30))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_ipc_pulls_between_two_processes_are_bit_exact() -> None:
    from tandem.bench.gpu_serving import two_process_kv_gbps

    _, exact = two_process_kv_gbps(TINY, num_tokens=200, device="cuda", backend="cuda_ipc")
    assert exact
