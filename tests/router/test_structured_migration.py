"""A grammar survives a decode worker killed mid-stream: the migrated request resumes
its grammar after the tokens already streamed (real processes, kill -9)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tandem.proto.tandem.v1 import generation_pb2 as gen_pb
from tandem.proto.tandem.v1 import generation_pb2_grpc
from tandem.router.membership import WorkerLifecycle
from tandem.worker.config import WorkerRole
from tests.helpers.grpc_calls import public_channel
from tests.helpers.parallel import DISRUPTS_ITS_CLUSTER
from tests.helpers.process_cluster import ProcessCluster

pytestmark = [pytest.mark.timeout(600), DISRUPTS_ITS_CLUSTER]

# One legal token at every step: a grammar restarted after the migration would write
# the option's beginning again; one resumed in the right state finishes it exactly. ~70
# tokens of the tiny model (under max_tokens): long enough that no stream can finish
# while the last one is still starting (at ~24 tokens one did).
OPTION = " ".join(["decode prefill batch queue worker router latency cache"] * 8)


async def guided_stream(endpoint: str, req_id: str, progress: dict[str, int]) -> str:
    async with public_channel(endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = gen_pb.GenerateRequest(
            request_id=req_id,
            prompt=f"the {req_id}",
            max_tokens=256,
            temperature=1.0,
            guided=gen_pb.GuidedDecoding(choice=gen_pb.GuidedChoice(options=[OPTION])),
        )
        text, reason = "", gen_pb.FINISH_REASON_UNSPECIFIED
        async for msg in stub.Generate(request, timeout=180):
            text += msg.text
            progress[req_id] = progress.get(req_id, 0) + len(msg.token_ids)
            reason = msg.finish_reason or reason
        assert reason == gen_pb.FINISH_REASON_STOP
        return text


def test_kill_decode_worker_mid_grammar_resumes_it(tiny_model_dir):
    roles = {"prefill-0": WorkerRole.PREFILL, "decode-0": WorkerRole.DECODE,
             "decode-1": WorkerRole.DECODE}  # fmt: skip
    cluster = ProcessCluster(str(tiny_model_dir), roles).start()
    try:

        async def scenario() -> tuple[list[str], str]:
            progress: dict[str, int] = {}
            ids = [f"g{i}" for i in range(4)]
            tasks = [
                asyncio.ensure_future(guided_stream(cluster.grpc_endpoint, rid, progress))
                for rid in ids
            ]
            deadline = time.monotonic() + 60
            while not all(progress.get(rid, 0) >= 4 for rid in ids):
                assert time.monotonic() < deadline, f"streams did not start: {progress}"
                await asyncio.sleep(0.005)
            policy = cluster.router.policy_runtime.policy
            placements = [policy.placement_of(rid) for rid in ids]  # None: finished
            on = [p.decode_worker_id for p in placements if p is not None]
            victim = max(("decode-0", "decode-1"), key=on.count)
            await asyncio.get_running_loop().run_in_executor(None, cluster.kill, victim)
            return list(await asyncio.gather(*tasks)), victim

        texts, victim = cluster.run(scenario(), timeout_s=300)
        assert texts == [OPTION] * 4
        # At least one stream was on the victim mid-grammar and moved.
        assert sum(cluster.migrations().values()) >= 1
        cluster.set_state(victim, WorkerLifecycle.DEAD)
        cluster.assert_idle()
    finally:
        cluster.stop()
