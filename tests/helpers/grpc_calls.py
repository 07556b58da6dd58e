"""Test clients: public `Generate` streams and worker `Stats` idle checks."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from tandem.proto.cluster_auth import ClusterAuth, internal_channel, metadata_interceptors
from tandem.proto.tandem.v1 import generation_pb2 as gen_pb
from tandem.proto.tandem.v1 import generation_pb2_grpc
from tandem.proto.tandem.worker.v1 import worker_pb2 as pb
from tandem.proto.tandem.worker.v1 import worker_pb2_grpc

# The API key of the test routers that have one (the shared in-process cluster's).
TEST_API_KEY = "sk-tandem-test"
BEARER = ("authorization", f"Bearer {TEST_API_KEY}")


def public_channel(endpoint: str) -> grpc.aio.Channel:
    """A channel to a router's public gRPC port that sends the test API key on every call
    (a router without a key ignores it)."""
    return grpc.aio.insecure_channel(endpoint, interceptors=metadata_interceptors(*BEARER))


class _BearerSync(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """The test API key on every call of a blocking channel."""

    @staticmethod
    def _details(details: Any) -> Any:
        return details._replace(metadata=[*(details.metadata or ()), BEARER])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


def public_channel_sync(endpoint: str) -> grpc.Channel:
    """`public_channel`, blocking."""
    return grpc.intercept_channel(grpc.insecure_channel(endpoint), _BearerSync())


async def generate_tokens(
    endpoint: str, prompts: list[list[int]], max_tokens: int, timeout_s: float = 120.0
) -> list[list[int]]:
    """Greedy-generate every prompt concurrently over `Generate`; token ids per prompt."""
    async with public_channel(endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(prompt: list[int]) -> list[int]:
            request = gen_pb.GenerateRequest(
                prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0.0
            )
            tokens: list[int] = []
            finished = False
            async for msg in stub.Generate(request, timeout=timeout_s):
                tokens += msg.token_ids
                if msg.finish_reason != gen_pb.FINISH_REASON_UNSPECIFIED:
                    finished = True
                    assert msg.usage.prompt_tokens == len(prompt)
                    assert msg.usage.completion_tokens == len(tokens)
            assert finished, "stream ended without a finish reason"
            return tokens

        return list(await asyncio.gather(*(one(p) for p in prompts)))


async def stream_tokens(
    endpoint: str,
    req_id: str,
    prompt: list[int],
    progress: dict[str, int] | None = None,
    max_tokens: int = 160,
    **sampling: Any,
) -> tuple[list[int], str]:
    """Greedy-generate one stream over `Generate` (EOS ignored); (token ids, text).
    `progress[req_id]` follows the tokens received so far; `sampling`: more
    `GenerateRequest` fields (penalties, logit_bias, ...)."""
    async with public_channel(endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = gen_pb.GenerateRequest(
            request_id=req_id,
            prompt_token_ids=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            **sampling,
        )
        tokens: list[int] = []
        text = ""
        finished = False
        async for msg in stub.Generate(request, timeout=180):
            tokens += msg.token_ids
            text += msg.text
            if progress is not None:
                progress[req_id] = len(tokens)
            if msg.finish_reason != gen_pb.FINISH_REASON_UNSPECIFIED:
                finished = True
                assert msg.usage.completion_tokens == len(tokens)
                assert msg.usage.prompt_tokens == len(prompt)
        assert finished, "stream ended without a finish reason"
        return tokens, text


async def wait_streaming(
    progress: dict[str, int], req_ids: list[str], min_tokens: int = 4, timeout_s: float = 60.0
) -> None:
    """Until every stream in `req_ids` has `min_tokens` in `progress` (see `stream_tokens`)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not all(progress.get(rid, 0) >= min_tokens for rid in req_ids):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"streams did not start: {progress}")
        await asyncio.sleep(0.005)


async def start_streams(
    endpoint: str,
    req_ids: list[str],
    prompts: list[list[int]],
    sampling: list[dict[str, Any]] | None = None,
) -> list[asyncio.Future]:
    """One `stream_tokens` per (id, prompt), returned once every stream is under way;
    `sampling[i]`: more `GenerateRequest` fields of stream i."""
    progress: dict[str, int] = {}
    extra = sampling or [{} for _ in req_ids]
    tasks = [
        asyncio.ensure_future(stream_tokens(endpoint, rid, p, progress, **fields))
        for rid, p, fields in zip(req_ids, prompts, extra, strict=True)
    ]
    await wait_streaming(progress, req_ids)
    return tasks


async def worker_stats(
    endpoint: str, role: str, auth: ClusterAuth | None = None
) -> pb.StatsResponse:
    """A worker's `Stats` (with the cluster token of `auth`, when the workers want one)."""
    async with internal_channel(endpoint, auth or ClusterAuth(), options=()) as channel:
        if role == "prefill":
            stub = worker_pb2_grpc.PrefillWorkerStub(channel)
        else:
            stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        return await stub.Stats(pb.StatsRequest(), timeout=10)


async def assert_workers_idle(
    workers: list[tuple[str, str]],
    max_channels: int,
    timeout_s: float = 5.0,
    auth: ClusterAuth | None = None,
) -> None:
    """Every (endpoint, role) back to idle: all blocks free, nothing held or streaming.

    Transfer channels are reused across requests, so a decode worker may keep at most
    one per prefill worker (`max_channels`), never one per request.
    """
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        stats = [await worker_stats(endpoint, role, auth) for endpoint, role in workers]
        problems = [_busy(s, max_channels) for s in stats]
        if not any(problems):
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("; ".join(p for p in problems if p))
        await asyncio.sleep(0.1)


def _busy(s: pb.StatsResponse, max_channels: int) -> str:
    issues = []
    if s.num_free_blocks != s.num_blocks:
        issues.append(f"{s.num_blocks - s.num_free_blocks} blocks in use")
    for name in ("num_waiting", "num_running", "num_held", "num_importing", "num_open_streams"):
        if getattr(s, name):
            issues.append(f"{name}={getattr(s, name)}")
    if s.num_open_channels > max_channels:
        issues.append(f"{s.num_open_channels} channels open")
    return f"{s.worker_id}: {', '.join(issues)}" if issues else ""
