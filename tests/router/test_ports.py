"""A port another process holds: one clear error naming it and the flag that moves it;
`tandem serve` says so before it starts Ray, and a router whose bind fails stops what it
had started."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import pytest

from tandem.bench.harness import free_port
from tandem.cluster import serve as serve_module
from tandem.cluster.cli import main
from tandem.decode_worker.server import DecodeWorker
from tandem.engine.config import EngineConfig
from tandem.router.config import RouterConfig
from tandem.router.ports import Listen, PortInUse, check_free
from tandem.router.server import Router
from tandem.router.worker_pool import WorkerEndpoint
from tandem.worker.config import WorkerConfig, WorkerRole
from tests.helpers.kv_budget import TEST_KV_CACHE_BYTES

pytestmark = pytest.mark.timeout(120)

HOST = "127.0.0.1"


@contextlib.contextmanager
def held_port() -> Iterator[int]:
    """A port another server listens on, for the block."""
    with socket.socket() as holder:
        holder.bind((HOST, 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_a_held_port_is_named_with_its_flag_and_free_ones_pass():
    message = r"HTTP port \d+ on 127.0.0.1 is not free .*; .* --http-port"
    with held_port() as port, pytest.raises(PortInUse, match=message):
        check_free([Listen("gRPC", "--grpc-port", HOST, free_port()),
                    Listen("HTTP", "--http-port", HOST, port)])  # fmt: skip
    check_free([Listen("HTTP", "--http-port", HOST, port), Listen("gRPC", "--grpc-port", HOST, 0)])


def test_serve_refuses_a_held_port_before_starting_anything(tiny_model_dir, capsys, monkeypatch):
    def no_cluster(*args, **kwargs):
        raise AssertionError("the cluster (Ray, workers) was started")

    monkeypatch.setattr(serve_module, "LocalCluster", no_cluster)
    with held_port() as port:
        code = main(["serve", "--model", str(tiny_model_dir), "--host", HOST,
                     "--http-port", str(port), "--grpc-port", "0"])  # fmt: skip
    assert code == 1
    err = capsys.readouterr().err
    assert f"tandem serve: HTTP port {port} on {HOST} is not free" in err
    assert "Traceback" not in err


def test_a_router_whose_bind_fails_stops_what_it_started(tiny_model_dir):
    async def scenario() -> None:
        engine = EngineConfig(
            model=str(tiny_model_dir),
            mode=WorkerRole.DECODE.engine_mode,
            num_threads=1,
            max_model_len=256,
            kv_cache_memory_bytes=TEST_KV_CACHE_BYTES,
        )
        worker = DecodeWorker(WorkerConfig(worker_id="d0", role=WorkerRole.DECODE, engine=engine))
        endpoint = await worker.start()
        try:
            grpc_port = free_port()
            with held_port() as http_port:
                config = RouterConfig(model_dir=str(tiny_model_dir), host=HOST,
                                      grpc_port=grpc_port, http_port=http_port,
                                      warmup_profile=False)  # fmt: skip
                router = Router(config, [WorkerEndpoint("d0", WorkerRole.DECODE, endpoint)])
                with pytest.raises(PortInUse, match=f"HTTP port {http_port} on {HOST}"):
                    await router.start()
            # The gRPC server it had started is stopped: its port is free again.
            check_free([Listen("gRPC", "--grpc-port", HOST, grpc_port)])
            await router.stop()  # the owner's stop after a failed start: nothing left to do
        finally:
            await worker.stop()

    asyncio.run(scenario())
