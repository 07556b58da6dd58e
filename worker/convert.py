"""Conversions between the wire messages (`tandem.worker.v1`) and engine types."""

from __future__ import annotations

from typing import Protocol

from tandem.engine.config import EngineConfig
from tandem.engine.outputs import EngineStats, PromptLogprobs
from tandem.engine.request import FinishReason
from tandem.engine.sampler import TopLogprobs
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured.spec import GuidedDecoding, GuidedKind
from tandem.proto.tandem.worker.v1 import worker_pb2 as pb
from tandem.worker.config import WorkerRole

# Engine finish reason <-> wire (PREFILLED never crosses it: the prefill worker answers a
# KvHandle instead). None = still running.
FINISH_REASONS: dict[FinishReason | None, pb.FinishReason] = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}
FINISH_REASON_FROM_PROTO: dict[int, FinishReason | None] = {v: k for k, v in FINISH_REASONS.items()}

# The wire's top_k is an int32. A top_k at or past the vocabulary keeps every token (as 0
# does), so a larger one (the OpenAI API takes any int) travels as the int32 maximum.
MAX_WIRE_TOP_K = 2**31 - 1

WORKER_ROLES: dict[WorkerRole, pb.WorkerRole] = {
    WorkerRole.PREFILL: pb.WORKER_ROLE_PREFILL,
    WorkerRole.DECODE: pb.WORKER_ROLE_DECODE,
    WorkerRole.COLOCATED: pb.WORKER_ROLE_COLOCATED,
}
WORKER_ROLE_FROM_PROTO: dict[int, WorkerRole] = {v: k for k, v in WORKER_ROLES.items()}


def finish_reason_from_proto(value: int) -> FinishReason | None:
    """The engine's reason for a wire value; ValueError for one this build does not know."""
    try:
        return FINISH_REASON_FROM_PROTO[value]
    except KeyError:
        raise ValueError(f"unknown finish reason {value} on the wire") from None


def worker_role_from_proto(value: int) -> WorkerRole:
    """The role a worker reports; ValueError for UNSPECIFIED or an unknown value."""
    try:
        return WORKER_ROLE_FROM_PROTO[value]
    except KeyError:
        raise ValueError(f"worker role {value} on the wire is not a known role") from None


GUIDED_KINDS: dict[GuidedKind, pb.GuidedKind] = {
    GuidedKind.JSON_SCHEMA: pb.GUIDED_KIND_JSON_SCHEMA,
    GuidedKind.JSON_OBJECT: pb.GUIDED_KIND_JSON_OBJECT,
    GuidedKind.REGEX: pb.GUIDED_KIND_REGEX,
    GuidedKind.CHOICE: pb.GUIDED_KIND_CHOICE,
    GuidedKind.GRAMMAR: pb.GUIDED_KIND_GRAMMAR,
}
GUIDED_KIND_FROM_PROTO: dict[int, GuidedKind] = {v: k for k, v in GUIDED_KINDS.items()}


def guided_from_proto(msg: pb.SamplingParams) -> GuidedDecoding | None:
    """The structured-output spec on the wire (None when absent); ValueError if bad."""
    if not msg.HasField("structured"):
        return None
    wire = msg.structured
    kind = GUIDED_KIND_FROM_PROTO.get(wire.kind)
    if kind is None:
        raise ValueError(f"structured.kind {wire.kind} is not a known guided-decoding kind")
    return GuidedDecoding(kind, wire.spec, tuple(wire.accepted_token_ids))


def guided_to_proto(guided: GuidedDecoding) -> pb.GuidedDecoding:
    return pb.GuidedDecoding(
        kind=GUIDED_KINDS[guided.kind],
        spec=guided.spec,
        accepted_token_ids=list(guided.accepted_token_ids),
    )


def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Engine params from the wire; raises ValueError naming a bad field."""
    return SamplingParams(
        max_tokens=msg.max_tokens,
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p or 1.0,
        min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=list(msg.stop),
        include_stop_str_in_output=msg.include_stop_str_in_output,
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        min_tokens=msg.min_tokens,
        logprobs=msg.logprobs,
        top_logprobs=msg.top_logprobs,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty or 1.0,
        logit_bias=dict(msg.logit_bias),
        allowed_token_ids=list(msg.allowed_token_ids),
        bad_words_token_ids=[list(sequence.token_ids) for sequence in msg.bad_words],
        num_resumed_tokens=msg.num_resumed_tokens,
        skip_special_tokens=(
            msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True
        ),
        prompt_logprobs=msg.prompt_logprobs,
        prompt_top_logprobs=msg.prompt_top_logprobs,
        cache_salt=msg.cache_salt if msg.HasField("cache_salt") else None,
        structured=guided_from_proto(msg),
    )


def sampling_params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_k=min(params.top_k, MAX_WIRE_TOP_K),
        top_p=params.top_p,
        min_p=params.min_p,
        stop=params.stop,
        include_stop_str_in_output=params.include_stop_str_in_output,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens,
        logprobs=params.logprobs,
        top_logprobs=params.top_logprobs,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=params.logit_bias,
        allowed_token_ids=params.allowed_token_ids,
        bad_words=[pb.TokenSequence(token_ids=ids) for ids in params.bad_words_token_ids],
        num_resumed_tokens=params.num_resumed_tokens,
        skip_special_tokens=params.skip_special_tokens,
        prompt_logprobs=params.prompt_logprobs,
        prompt_top_logprobs=params.prompt_top_logprobs,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.cache_salt is not None:
        msg.cache_salt = params.cache_salt
    if params.structured is not None:
        msg.structured.CopyFrom(guided_to_proto(params.structured))
    return msg


def top_logprobs_to_proto(top: TopLogprobs) -> pb.TopLogprobs:
    return pb.TopLogprobs(token_ids=top.token_ids, logprobs=top.logprobs)


def top_logprobs_from_proto(msg: pb.TopLogprobs) -> TopLogprobs:
    return TopLogprobs(list(msg.token_ids), list(msg.logprobs))


def add_prompt_logprobs(
    msg: pb.PrefillResponse | pb.DecodeResponse, scores: PromptLogprobs | None
) -> None:
    """Fill the message's prompt_logprobs, prompt_ranks and prompt_top_logprobs."""
    if scores is None:
        return
    msg.prompt_logprobs.extend(scores.logprobs)
    msg.prompt_ranks.extend(scores.ranks)
    msg.prompt_top_logprobs.extend(top_logprobs_to_proto(top) for top in scores.top)


class StopReasonMessage(Protocol):
    """A message with the `stop_reason` oneof (stop_token_id | stop_string): the workers'
    responses, and tandem.v1's GenerateResponse."""

    stop_token_id: int
    stop_string: str

    def WhichOneof(self, oneof_group: str) -> str | None: ...


def set_stop_reason(msg: StopReasonMessage, stop_reason: int | str | None) -> None:
    """Put vLLM's stop_reason (a stop token id or stop string) on the message."""
    if isinstance(stop_reason, str):
        msg.stop_string = stop_reason
    elif stop_reason is not None:
        msg.stop_token_id = stop_reason


def stop_reason_from_proto(msg: StopReasonMessage) -> int | str | None:
    field = msg.WhichOneof("stop_reason")
    return None if field is None else getattr(msg, field)


def prompt_logprobs_from_proto(
    msg: pb.PrefillResponse | pb.DecodeResponse,
) -> PromptLogprobs | None:
    """The message's prompt logprobs; None when it carries none."""
    if not msg.prompt_ranks:
        return None
    top = [top_logprobs_from_proto(t) for t in msg.prompt_top_logprobs]
    return PromptLogprobs(list(msg.prompt_logprobs), list(msg.prompt_ranks), top)


def stats_to_proto(
    stats: EngineStats, worker_id: str, role: WorkerRole, engine: EngineConfig, **extra: int
) -> pb.StatsResponse:
    """A worker's `Stats` answer; `extra` fills the server-level counters."""
    return pb.StatsResponse(
        worker_id=worker_id,
        role=WORKER_ROLES[role],
        block_size=engine.block_size,
        max_model_len=engine.max_model_len,
        dtype=engine.resolved_dtype,
        max_num_seqs=engine.max_num_seqs,
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
