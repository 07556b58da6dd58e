"""Added latency of the router: the same requests via the router and straight to the workers.

The router path is one `Generate` stream. The direct path is what the router does for
a disaggregated request, issued by the client itself: `PrefillWorker.Prefill` (first
token + KvHandle), then `DecodeWorker.Decode` with the handle (the decode worker pulls
the KV and releases it). Both paths use the same worker pair; the router is set to
always disaggregate. Requests alternate between the paths (and which goes first), so
drift in machine load hits both alike; differences are taken per pair.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import grpc

from tandem.bench.router_cluster import ClusterInfo
from tandem.bench.router_load import StreamTiming, timed_generate
from tandem.bench.router_report import LatencySummary, paired_differences
from tandem.engine.sampling_params import SamplingParams
from tandem.proto.server_options import GRPC_OPTIONS
from tandem.proto.tandem.v1 import generation_pb2 as gen_pb
from tandem.proto.tandem.v1 import generation_pb2_grpc
from tandem.proto.tandem.worker.v1 import worker_pb2 as pb
from tandem.proto.tandem.worker.v1 import worker_pb2_grpc
from tandem.worker.convert import sampling_params_to_proto

_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class OverheadResult:
    num_requests: int
    num_prompt_tokens: int
    max_tokens: int
    router_e2e: LatencySummary
    direct_e2e: LatencySummary
    router_ttft: LatencySummary
    direct_ttft: LatencySummary
    # Per pair: router minus direct.
    added_e2e: LatencySummary
    added_ttft: LatencySummary
    # Both paths produced the same greedy tokens for every request.
    outputs_match: bool


async def direct_generate(
    prefill: worker_pb2_grpc.PrefillWorkerStub,
    decode: worker_pb2_grpc.DecodeWorkerStub,
    prompt_ids: list[int],
    params: pb.SamplingParams,
) -> StreamTiming:
    """Prefill then Decode with the handle, as `RequestFlow` does for a disaggregated pair."""
    req_id = uuid.uuid4().hex
    start = time.monotonic()
    reply = await prefill.Prefill(
        pb.PrefillRequest(request_id=req_id, prompt_token_ids=prompt_ids, params=params),
        timeout=_TIMEOUT_S,
    )
    first_at = time.monotonic()
    times, ids = [first_at], [reply.first_token_id]
    finished = reply.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    if not finished:
        request = pb.DecodeRequest(
            request_id=req_id,
            prompt_token_ids=prompt_ids,
            params=params,
            kv_handle=reply.kv_handle,
            first_token_id=reply.first_token_id,
        )
        async for msg in decode.Decode(request, timeout=_TIMEOUT_S):
            now = time.monotonic()
            times += [now] * len(msg.token_ids)
            ids += msg.token_ids
            if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                finished = True
    return StreamTiming(
        start_s=start,
        first_token_s=first_at,
        end_s=time.monotonic(),
        token_times_s=tuple(times),
        token_ids=tuple(ids),
        finished=finished,
        error="" if finished else "NO_FINISH_REASON",
    )


async def measure_overhead(
    info: ClusterInfo, prompt: str, num_requests: int, max_tokens: int, num_warmup: int
) -> OverheadResult:
    options = GRPC_OPTIONS
    async with (
        grpc.aio.insecure_channel(info.router_endpoint, options=options) as router_channel,
        grpc.aio.insecure_channel(info.worker("prefill").endpoint, options=options) as p_channel,
        grpc.aio.insecure_channel(info.worker("decode").endpoint, options=options) as d_channel,
    ):
        router = generation_pb2_grpc.GenerationStub(router_channel)
        prefill = worker_pb2_grpc.PrefillWorkerStub(p_channel)
        decode = worker_pb2_grpc.DecodeWorkerStub(d_channel)
        # The ids the router's tokenizer makes of `prompt`: both paths prefill the same.
        tokenized = await router.Tokenize(gen_pb.TokenizeRequest(prompt=prompt), timeout=10)
        prompt_ids = list(tokenized.token_ids)
        request = gen_pb.GenerateRequest(
            prompt=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        )
        params = sampling_params_to_proto(
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        )

        async def via_router() -> StreamTiming:
            return await timed_generate(router, request, _TIMEOUT_S)

        async def direct() -> StreamTiming:
            return await direct_generate(prefill, decode, prompt_ids, params)

        routed: list[StreamTiming] = []
        straight: list[StreamTiming] = []
        for i in range(num_warmup + num_requests):
            if i % 2 == 0:
                r, d = await via_router(), await direct()
            else:
                d, r = await direct(), await via_router()
            for t in (r, d):
                if t.error:
                    raise RuntimeError(f"request failed: {t.error}")
            if i >= num_warmup:
                routed.append(r)
                straight.append(d)
    r_e2e, d_e2e = [t.e2e_s for t in routed], [t.e2e_s for t in straight]
    r_ttft = [t.ttft_s for t in routed if t.ttft_s is not None]
    d_ttft = [t.ttft_s for t in straight if t.ttft_s is not None]
    return OverheadResult(
        num_requests=num_requests,
        num_prompt_tokens=len(prompt_ids),
        max_tokens=max_tokens,
        router_e2e=LatencySummary.of(r_e2e),
        direct_e2e=LatencySummary.of(d_e2e),
        router_ttft=LatencySummary.of(r_ttft),
        direct_ttft=LatencySummary.of(d_ttft),
        added_e2e=LatencySummary.of(paired_differences(r_e2e, d_e2e)),
        added_ttft=LatencySummary.of(paired_differences(r_ttft, d_ttft)),
        outputs_match=all(
            r.token_ids == d.token_ids for r, d in zip(routed, straight, strict=True)
        ),
    )
