"""The decode worker's answer when a request cannot start: a full KV pool is
RESOURCE_EXHAUSTED (the router does not move it on), an engine that does not answer is
UNAVAILABLE (the router migrates the request); both were RESOURCE_EXHAUSTED."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from tandem.decode_worker.service import DecodeService
from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer.handle import KvHandle
from tandem.proto.cluster_auth import ClusterAuth
from tandem.proto.tandem.worker.v1 import worker_pb2 as pb
from tandem.telemetry.tracing import Tracing
from tandem.worker.convert import sampling_params_to_proto

pytestmark = pytest.mark.timeout(60)


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code


class Context:
    def invocation_metadata(self) -> tuple:
        return ()

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


class Engine:
    """Reserves nothing: its KV pool is full, or (`stuck`) its engine thread never
    answers, which `EngineLoop.call` reports as a TimeoutError."""

    def __init__(self, stuck: bool) -> None:
        self.stuck = stuck
        self.cancelled: list[str] = []

    def reserve_import(self, *_: Any) -> None:
        if self.stuck:
            raise TimeoutError("engine command not answered within 330 s")
        return None

    def cancel_import(self, req_id: str) -> None:
        self.cancelled.append(req_id)


class Loop:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def call(self, fn: Any, timeout_s: float | None = None) -> Any:
        return fn(self.engine)


def decode_request() -> pb.DecodeRequest:
    handle = KvHandle("prefill-0", "127.0.0.1:1", "r1", [1], 4, "fp", time.time() + 30)
    request = pb.DecodeRequest(
        request_id="r1", prompt_token_ids=[1, 2, 3], first_token_id=4,
        params=sampling_params_to_proto(SamplingParams(max_tokens=4)),
    )  # fmt: skip
    request.kv_handle.CopyFrom(handle.to_proto())
    return request


@pytest.mark.parametrize(
    ("stuck", "code"),
    [(False, grpc.StatusCode.RESOURCE_EXHAUSTED), (True, grpc.StatusCode.UNAVAILABLE)],
)
def test_a_request_that_cannot_start_gets_the_right_code(stuck: bool, code: grpc.StatusCode):
    async def run() -> None:
        engine = Engine(stuck)
        config = SimpleNamespace(admission_timeout_s=0.2, cluster_auth=ClusterAuth())
        service = DecodeService(config, Loop(engine), None, Tracing("t", "none"), None)
        try:
            with pytest.raises(Aborted) as aborted:
                async for _ in service.Decode(decode_request(), Context()):
                    pass
            assert aborted.value.code is code, aborted.value
            assert engine.cancelled == ["r1"]  # the reservation is undone either way
        finally:
            await service.close()

    asyncio.run(run())
