"""Start-up latency profile: seeds each worker's latency models before traffic.

The router sends a few greedy probe requests of known prompt lengths to every
worker (prefill workers: `Prefill` with max_tokens 1; decode workers: a local
prefill plus a few decode steps, alone and then in batches of several sequences) and
reads the workers' own timings and the token gaps it sees, so the first
placements compare workers on measured costs, not on priors. Online correction takes
over from there.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Sequence

from tandem.proto.tandem.worker.v1 import worker_pb2 as pb
from tandem.proto.tandem.worker.v1 import worker_pb2_grpc
from tandem.router.policy import PrefillLatencyModel
from tandem.router.policy.latency_model import DecodeObservation, PrefillObservation
from tandem.router.worker_pool import WorkerEndpoint, WorkerPool

PROBE_PROMPT_LENS = (16, 128, 384)
PROBE_DECODE_TOKENS = 6
# Decode steps of this many sequences at once (capped by what the worker runs and holds),
# each prompt PROBE_BATCH_PROMPT_LEN tokens.
PROBE_BATCH_SIZES = (8, 32)
PROBE_BATCH_PROMPT_LEN = 16
# Token gaps of a batch probe counted after this many tokens of each stream.
_SETTLE_TOKENS = 2


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


async def probe_decode(
    pool: WorkerPool,
    worker: WorkerEndpoint,
    vocab_size: int,
    max_len: int,
    timeout_s: float,
    batch_sizes: Sequence[int] = (),
) -> tuple[list[PrefillObservation], list[DecodeObservation]]:
    """Timed local prefills, and decode steps of one sequence at each probe length, then
    of each of `batch_sizes` sequences at once (see `probe_batch_sizes`): batch 1 alone
    cannot tell a step's cost per sequence from its fixed cost."""
    rng = random.Random(worker.worker_id)
    stub = pool.decode_stub(worker)
    prefill_obs: list[PrefillObservation] = []
    decode_obs: list[DecodeObservation] = []
    for n in (min(n, max_len - PROBE_DECODE_TOKENS - 1) for n in PROBE_PROMPT_LENS):
        request = _probe_request(f"profile-{worker.worker_id}-{n}", vocab_size, n, rng)
        prefill_s, gaps = await _stream_timings(stub, request, timeout_s, settle_tokens=1)
        if prefill_s is not None:
            prefill_obs.append(PrefillObservation(n, prefill_s))
        decode_obs.extend(DecodeObservation(1, n, gap) for gap in gaps)
    for batch in batch_sizes:
        gap = await _batch_step_s(stub, worker.worker_id, vocab_size, batch, rng, timeout_s)
        context = batch * (PROBE_BATCH_PROMPT_LEN + PROBE_DECODE_TOKENS // 2)
        decode_obs.append(DecodeObservation(batch, context, gap))
    return prefill_obs, decode_obs


def probe_batch_sizes(
    max_num_seqs: int, num_blocks: int, block_size: int, max_len: int
) -> list[int]:
    """The batch probes a decode worker can run whole: `PROBE_BATCH_SIZES` capped by the
    sequences one of its steps runs and by what its KV blocks hold (none when the worker
    does not report `max_num_seqs`, or its longest request is shorter than a probe)."""
    tokens = PROBE_BATCH_PROMPT_LEN + PROBE_DECODE_TOKENS
    if max_num_seqs <= 1 or max_len < tokens:
        return []
    most = min(max_num_seqs, num_blocks // -(-tokens // block_size))
    return sorted({min(batch, most) for batch in PROBE_BATCH_SIZES} - {0, 1})


def _probe_request(
    request_id: str, vocab_size: int, num_tokens: int, rng: random.Random
) -> pb.DecodeRequest:
    return pb.DecodeRequest(
        request_id=request_id,
        prompt_token_ids=probe_prompt(vocab_size, num_tokens, rng),
        params=pb.SamplingParams(max_tokens=PROBE_DECODE_TOKENS, temperature=0.0, ignore_eos=True),
        local_prefill=True,  # the probe times the worker's own prefill
    )


async def _stream_timings(
    stub: worker_pb2_grpc.DecodeWorkerStub,
    request: pb.DecodeRequest,
    timeout_s: float,
    settle_tokens: int,
) -> tuple[float | None, list[float]]:
    """One probe's local-prefill compute time (None if not reported) and the seconds per
    token between its token messages, counted once `settle_tokens` tokens have come."""
    prefill_s, gaps, last_at, num_tokens = None, [], None, 0
    async for msg in stub.Decode(request, timeout=timeout_s):
        now = time.monotonic()
        if msg.HasField("prefill_timings"):
            prefill_s = msg.prefill_timings.compute_s
        if not msg.token_ids:
            continue
        if last_at is not None and num_tokens >= settle_tokens:
            gaps.append((now - last_at) / len(msg.token_ids))
        last_at, num_tokens = now, num_tokens + len(msg.token_ids)
    return prefill_s, gaps


async def _batch_step_s(
    stub: worker_pb2_grpc.DecodeWorkerStub,
    worker_id: str,
    vocab_size: int,
    batch: int,
    rng: random.Random,
    timeout_s: float,
) -> float:
    """Median seconds between two tokens of `batch` probes decoding together."""

    async def gaps_of(index: int) -> list[float]:
        request = _probe_request(f"profile-{worker_id}-b{batch}-{index}", vocab_size,
                                 PROBE_BATCH_PROMPT_LEN, rng)  # fmt: skip
        # The first tokens may still wait on the other probes' prefills.
        _, gaps = await _stream_timings(stub, request, timeout_s, _SETTLE_TOKENS)
        return gaps

    # A task group: one failed stream cancels the others (no probe outlives the call);
    # its error leaves as itself, as a batch-1 probe's does.
    try:
        async with asyncio.TaskGroup() as group:
            streams = [group.create_task(gaps_of(i)) for i in range(batch)]
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from None
    gaps = [gap for stream in streams for gap in stream.result()]
    if not gaps:
        raise RuntimeError(f"worker {worker_id} streamed no decode steps for a probe batch")
    return statistics.median(gaps)
