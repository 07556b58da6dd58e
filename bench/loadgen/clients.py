"""Streaming clients, one per target kind, behind one interface."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Protocol

import grpc

from tandem.bench.loadgen.traces import RequestTrace
from tandem.bench.loadgen.workloads import RequestSpec
from tandem.proto.server_options import GRPC_OPTIONS
from tandem.proto.tandem.v1 import generation_pb2 as gen_pb
from tandem.proto.tandem.v1 import generation_pb2_grpc

logger = logging.getLogger(__name__)

PROMPT_FORMATS = ("ids", "text")

_GRPC_FINISH = {
    gen_pb.FINISH_REASON_STOP: "stop",
    gen_pb.FINISH_REASON_LENGTH: "length",
    gen_pb.FINISH_REASON_ABORT: "abort",
}


@dataclass(frozen=True)
class ClientConfig:
    target: str  # grpc://HOST:PORT (Tandem Generate) or http(s)://HOST:PORT (OpenAI)
    model: str = ""  # served model name; "" = the first model the server lists
    prompt_format: str = "ids"  # "ids" (token ids) or "text" (`RequestSpec.prompt_text`)
    temperature: float = 0.0
    request_timeout_s: float = 600.0  # per request; past it: "timeout"/DEADLINE_EXCEEDED
    # HTTP only: send only OpenAI's own request fields (no `ignore_eos`), for servers that
    # refuse unknown ones (`transformers serve`); outputs may then end early at EOS.
    strict_openai: bool = False

    def __post_init__(self) -> None:
        if not self.target.startswith(("grpc://", "http://", "https://")):
            raise ValueError(f"target must be grpc:// or http(s)://HOST:PORT, got {self.target!r}")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}")
        if self.request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be > 0")

    @property
    def kind(self) -> str:
        """ "grpc" or "http"."""
        return "grpc" if self.target.startswith("grpc://") else "http"


@dataclass(frozen=True)
class ServerInfo:
    """What `start()` learned about the server."""

    model: str
    max_model_len: int | None  # None when the server does not say
    vocab_size: int | None
    prompt_format: str


class Client(Protocol):
    async def start(self) -> ServerInfo: ...

    async def stream(self, spec: RequestSpec) -> RequestTrace: ...

    async def close(self) -> None: ...


def make_client(config: ClientConfig) -> Client:
    if config.kind == "grpc":
        return GrpcClient(config)
    from tandem.bench.loadgen.http_client import HttpClient

    return HttpClient(config)


class GrpcClient:
    """Tandem's public gRPC API; token ids come per message, so arrivals are exact."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self.endpoint = config.target.removeprefix("grpc://").rstrip("/")
        self._channel: grpc.aio.Channel | None = None
        self._stub: generation_pb2_grpc.GenerationStub | None = None
        self._prompt_format = config.prompt_format
        self._model = config.model

    async def start(self) -> ServerInfo:
        self._channel = grpc.aio.insecure_channel(self.endpoint, options=GRPC_OPTIONS)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        try:
            reply = await self._stub.ListModels(gen_pb.ListModelsRequest(), timeout=30)
        except grpc.aio.AioRpcError as exc:
            message = f"{self.config.target}: {exc.code().name}: {exc.details()}"
            raise ConnectionError(message) from exc
        if not reply.models:
            raise RuntimeError(f"{self.config.target} serves no model")
        card = next((m for m in reply.models if m.id == self._model), reply.models[0])
        if self._model and card.id != self._model:
            raise RuntimeError(f"{self.config.target} does not serve {self._model!r}")
        self._model = card.id
        return ServerInfo(
            card.id, card.max_model_len or None, card.vocab_size or None, self._prompt_format
        )

    def _request(self, spec: RequestSpec) -> gen_pb.GenerateRequest:
        request = gen_pb.GenerateRequest(
            model=self._model, max_tokens=spec.max_tokens, temperature=self.config.temperature,
            ignore_eos=spec.ignore_eos, request_id=spec.req_id,
        )  # fmt: skip
        if self._prompt_format == "text":
            request.prompt = spec.prompt_text
        else:
            request.prompt_token_ids.extend(spec.prompt_ids)
        return request

    async def stream(self, spec: RequestSpec) -> RequestTrace:
        if self._stub is None:
            raise RuntimeError("start() the client first")
        times: list[float] = []
        token_ids: list[int] = []
        num_output_tokens: int | None = None
        num_prompt_tokens = spec.prompt_len
        finish_reason = error = ""
        send_s = time.perf_counter()
        try:
            call = self._stub.Generate(self._request(spec), timeout=self.config.request_timeout_s)
            async for message in call:
                now = time.perf_counter()
                times += [now] * len(message.token_ids)
                token_ids += message.token_ids
                if message.finish_reason != gen_pb.FINISH_REASON_UNSPECIFIED:
                    finish_reason = _GRPC_FINISH.get(message.finish_reason, "")
                if message.HasField("usage"):
                    num_output_tokens = message.usage.completion_tokens
                    num_prompt_tokens = message.usage.prompt_tokens or num_prompt_tokens
        except grpc.aio.AioRpcError as exc:
            error = f"{exc.code().name}: {exc.details()}"
        if not error and not finish_reason:
            error = "stream ended without a finish reason"
        num_output = len(times) if num_output_tokens is None else num_output_tokens
        return RequestTrace(
            spec.req_id, spec.tag, num_prompt_tokens, spec.max_tokens, send_s,
            time.perf_counter(), times, num_output, finish_reason, error, token_ids,
        )  # fmt: skip

    async def close(self) -> None:
        if self._channel is not None:
            await asyncio.wait_for(self._channel.close(), timeout=10)
            self._channel = None
