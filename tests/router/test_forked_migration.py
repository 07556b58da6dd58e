"""An `n > 1` request whose decode worker is killed with -9 mid-stream: each of its
sequences migrates on its own (re-prefill on the other decode worker's pair, the tokens
already sent kept), and every choice ends as an uninterrupted run does."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tandem.proto.tandem.v1 import generation_pb2 as gen_pb
from tandem.proto.tandem.v1 import generation_pb2_grpc
from tandem.router.membership import WorkerLifecycle
from tandem.worker.config import WorkerRole
from tests.helpers.grpc_calls import wait_streaming
from tests.helpers.process_cluster import ProcessCluster
from tests.helpers.prompts import make_prompts

pytestmark = pytest.mark.timeout(180)

N = 3
MAX_TOKENS = 96
PROMPT = make_prompts(2048, (60,), seed=77)[0]


async def stream_choices(
    endpoint: str, req_id: str, progress: dict[str, int] | None = None
) -> tuple[list[list[int]], list[str], int]:
    """One greedy `n = N` request over `Generate`: (token ids, text) per choice, and
    the completion tokens of the final usage."""
    tokens: list[list[int]] = [[] for _ in range(N)]
    texts = ["" for _ in range(N)]
    num_completion_tokens = 0
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = gen_pb.GenerateRequest(
            request_id=req_id, prompt_token_ids=PROMPT, max_tokens=MAX_TOKENS,
            temperature=0.0, ignore_eos=True, n=N,
        )  # fmt: skip
        async for msg in stub.Generate(request, timeout=120):
            tokens[msg.index] += msg.token_ids
            texts[msg.index] += msg.text
            if msg.HasField("usage"):
                num_completion_tokens = msg.usage.completion_tokens
            if progress is not None:
                progress[req_id] = min(len(t) for t in tokens)
    return tokens, texts, num_completion_tokens


def test_kill_decode_worker_mid_stream_migrates_every_choice(tiny_model_dir):
    roles = {"prefill-0": WorkerRole.PREFILL, "decode-0": WorkerRole.DECODE,
             "decode-1": WorkerRole.DECODE}  # fmt: skip
    # Every prompt goes through the prefill worker (one prefill, n KV handles).
    cluster = ProcessCluster(str(tiny_model_dir), roles, max_local_prefill_tokens=0).start()
    try:
        reference = cluster.run(stream_choices(cluster.grpc_endpoint, "ref"))
        cluster.assert_idle()

        async def scenario() -> tuple[tuple[list[list[int]], list[str], int], str]:
            progress: dict[str, int] = {}
            task = asyncio.ensure_future(stream_choices(cluster.grpc_endpoint, "req", progress))
            await wait_streaming(progress, ["req"])
            placement = cluster.router.policy_runtime.policy.placement_of("req")
            victim = placement.decode_worker_id
            await asyncio.get_running_loop().run_in_executor(None, cluster.kill, victim)
            return await task, victim

        (tokens, texts, num_completion_tokens), victim = cluster.run(scenario(), timeout_s=120)
        ref_tokens, ref_texts, _ = reference
        assert [len(t) for t in tokens] == [MAX_TOKENS] * N
        assert tokens == ref_tokens
        assert texts == ref_texts
        assert num_completion_tokens == N * MAX_TOKENS
        counts = {
            s.labels["reason"]: s.value
            for metric in cluster.router.metrics.migrations.collect()
            for s in metric.samples
            if s.name.endswith("_total")
        }
        # Every sequence was decoding on the victim: each one moved.
        assert counts["decode_failed"] + counts["worker_lost"] >= N
        cluster.set_state(victim, WorkerLifecycle.DEAD)
        cluster.assert_idle()
    finally:
        cluster.stop()
