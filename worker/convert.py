"""Conversions between the wire messages (`tandem.worker.v1`) and engine types."""

from __future__ import annotations

from tandem.engine.outputs import EngineStats
from tandem.engine.sampling_params import SamplingParams
from tandem.proto.tandem.worker.v1 import worker_pb2 as pb

FINISH_REASONS = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
FINISH_REASON_NAMES = {v: k for k, v in FINISH_REASONS.items()}


def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Engine params from the wire; raises ValueError naming a bad field."""
    return SamplingParams(
        max_tokens=msg.max_tokens,
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p or 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        min_tokens=msg.min_tokens,
        logprobs=msg.logprobs,
    )


def sampling_params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens,
        logprobs=params.logprobs,
    )
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def stats_to_proto(stats: EngineStats, worker_id: str, role: str, **extra: int) -> pb.StatsResponse:
    """A worker's `Stats` answer; `extra` fills the server-level counters."""
    return pb.StatsResponse(
        worker_id=worker_id,
        role=role,
        num_waiting=stats.num_waiting,
        num_running=stats.num_running,
        num_held=stats.num_held,
        num_importing=stats.num_importing,
        num_free_blocks=stats.num_free_blocks,
        num_blocks=stats.num_blocks,
        num_queued_prefill_tokens=stats.num_queued_prefill_tokens,
        prefix_cache_queries=stats.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits,
        num_preemptions=stats.num_preemptions,
        **extra,
    )
