"""Start-up latency profile: seeds each worker's latency models before traffic.

The router sends a few greedy probe requests of known prompt lengths to every
worker (prefill workers: `Prefill` with max_tokens 1; decode workers: a local
prefill plus a few decode steps) and reads the workers' own timings, so the first
placements compare workers on measured costs, not on priors. Online correction takes
over from there.
"""

from __future__ import annotations

import random
import time

from tandem.proto.tandem.worker.v1 import worker_pb2 as pb
from tandem.router.policy import DecodeLatencyModel, PrefillLatencyModel
from tandem.router.policy.latency_model import DecodeObservation, PrefillObservation
from tandem.router.worker_pool import WorkerEndpoint, WorkerPool

PROBE_PROMPT_LENS = (16, 128, 384)
PROBE_DECODE_TOKENS = 6


def probe_prompt(vocab_size: int, num_tokens: int, rng: random.Random) -> list[int]:
    # Random ids (not a real prefix anyone shares) so the probes never hit a cache.
    return [rng.randrange(3, vocab_size) for _ in range(num_tokens)]


async def profile_prefill(
    pool: WorkerPool, worker: WorkerEndpoint, vocab_size: int, max_len: int, timeout_s: float
) -> PrefillLatencyModel:
    rng = random.Random(worker.worker_id)
    stub = pool.prefill_stub(worker)
    observations = []
    for n in (min(n, max_len - 2) for n in PROBE_PROMPT_LENS):
        request = pb.PrefillRequest(
            request_id=f"profile-{worker.worker_id}-{n}",
            prompt_token_ids=probe_prompt(vocab_size, n, rng),
            params=pb.SamplingParams(max_tokens=1, temperature=0.0),
        )
        reply = await stub.Prefill(request, timeout=timeout_s)
        observations.append(PrefillObservation(n, reply.timings.compute_s))
    return PrefillLatencyModel.from_profile(observations)


async def profile_decode(
    pool: WorkerPool, worker: WorkerEndpoint, vocab_size: int, max_len: int, timeout_s: float
) -> tuple[PrefillLatencyModel, DecodeLatencyModel]:
    """A decode worker's local-prefill model and its decode-step model (batch 1)."""
    rng = random.Random(worker.worker_id)
    stub = pool.decode_stub(worker)
    prefill_obs, decode_obs = [], []
    for n in (min(n, max_len - PROBE_DECODE_TOKENS - 1) for n in PROBE_PROMPT_LENS):
        request = pb.DecodeRequest(
            request_id=f"profile-{worker.worker_id}-{n}",
            prompt_token_ids=probe_prompt(vocab_size, n, rng),
            params=pb.SamplingParams(
                max_tokens=PROBE_DECODE_TOKENS, temperature=0.0, ignore_eos=True
            ),
            local_prefill=True,  # the probe times the worker's own prefill
        )
        last_at = None
        async for msg in stub.Decode(request, timeout=timeout_s):
            now = time.monotonic()
            if msg.HasField("prefill_timings"):
                prefill_obs.append(PrefillObservation(n, msg.prefill_timings.compute_s))
            elif last_at is not None and msg.token_ids:
                gap = (now - last_at) / len(msg.token_ids)
                decode_obs.append(DecodeObservation(1, n, gap))
            last_at = now
    return (
        PrefillLatencyModel.from_profile(prefill_obs),
        DecodeLatencyModel.from_profile(decode_obs),
    )
