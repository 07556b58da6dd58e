from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
    WORKER_ROLE_COLOCATED: _ClassVar[WorkerRole]

class KvBackend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_BACKEND_UNSPECIFIED: _ClassVar[KvBackend]
    KV_BACKEND_TCP: _ClassVar[KvBackend]
    KV_BACKEND_NCCL: _ClassVar[KvBackend]
    KV_BACKEND_LOCAL: _ClassVar[KvBackend]
    KV_BACKEND_CUDA_IPC: _ClassVar[KvBackend]
    KV_BACKEND_AUTO: _ClassVar[KvBackend]

class GuidedKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GUIDED_KIND_UNSPECIFIED: _ClassVar[GuidedKind]
    GUIDED_KIND_JSON_SCHEMA: _ClassVar[GuidedKind]
    GUIDED_KIND_JSON_OBJECT: _ClassVar[GuidedKind]
    GUIDED_KIND_REGEX: _ClassVar[GuidedKind]
    GUIDED_KIND_CHOICE: _ClassVar[GuidedKind]
    GUIDED_KIND_GRAMMAR: _ClassVar[GuidedKind]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
WORKER_ROLE_COLOCATED: WorkerRole
KV_BACKEND_UNSPECIFIED: KvBackend
KV_BACKEND_TCP: KvBackend
KV_BACKEND_NCCL: KvBackend
KV_BACKEND_LOCAL: KvBackend
KV_BACKEND_CUDA_IPC: KvBackend
KV_BACKEND_AUTO: KvBackend
GUIDED_KIND_UNSPECIFIED: GuidedKind
GUIDED_KIND_JSON_SCHEMA: GuidedKind
GUIDED_KIND_JSON_OBJECT: GuidedKind
GUIDED_KIND_REGEX: GuidedKind
GUIDED_KIND_CHOICE: GuidedKind
GUIDED_KIND_GRAMMAR: GuidedKind

class GuidedDecoding(_message.Message):
    __slots__ = ("kind", "spec", "accepted_token_ids")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    kind: GuidedKind
    spec: str
    accepted_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kind: _Optional[_Union[GuidedKind, str]] = ..., spec: _Optional[str] = ..., accepted_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "include_stop_str_in_output", "stop_token_ids", "ignore_eos", "min_tokens", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words", "num_resumed_tokens", "skip_special_tokens", "prompt_logprobs", "prompt_top_logprobs", "cache_salt", "structured")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    NUM_RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    include_stop_str_in_output: bool
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_tokens: int
    logprobs: bool
    top_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    num_resumed_tokens: int
    skip_special_tokens: bool
    prompt_logprobs: bool
    prompt_top_logprobs: int
    cache_salt: str
    structured: GuidedDecoding
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., include_stop_str_in_output: _Optional[bool] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ..., num_resumed_tokens: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., prompt_logprobs: _Optional[bool] = ..., prompt_top_logprobs: _Optional[int] = ..., cache_salt: _Optional[str] = ..., structured: _Optional[_Union[GuidedDecoding, _Mapping]] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class KvHandle(_message.Message):
    __slots__ = ("worker_id", "endpoint", "request_id", "block_ids", "num_tokens", "layout_fingerprint", "lease_expiry_unix_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRY_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    endpoint: str
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    layout_fingerprint: str
    lease_expiry_unix_s: float
    def __init__(self, worker_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., layout_fingerprint: _Optional[str] = ..., lease_expiry_unix_s: _Optional[float] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_s", "compute_s", "transfer_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    compute_s: float
    transfer_s: float
    def __init__(self, queue_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., transfer_s: _Optional[float] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_token_logprob", "first_token_text", "finish_reason", "kv_handle", "num_cached_tokens", "timings", "first_token_top_logprobs", "prompt_logprobs", "prompt_ranks", "prompt_top_logprobs", "stop_token_id", "stop_string")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_RANKS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_token_logprob: float
    first_token_text: str
    finish_reason: FinishReason
    kv_handle: KvHandle
    num_cached_tokens: int
    timings: Timings
    first_token_top_logprobs: TopLogprobs
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_ranks: _containers.RepeatedScalarFieldContainer[int]
    prompt_top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    stop_token_id: int
    stop_string: str
    def __init__(self, first_token_id: _Optional[int] = ..., first_token_logprob: _Optional[float] = ..., first_token_text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., kv_handle: _Optional[_Union[KvHandle, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., first_token_top_logprobs: _Optional[_Union[TopLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_ranks: _Optional[_Iterable[int]] = ..., prompt_top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., stop_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("worker_id", "role", "num_waiting", "num_running", "num_held", "num_importing", "num_free_blocks", "num_blocks", "num_queued_prefill_tokens", "prefix_cache_queries", "prefix_cache_hits", "num_open_streams", "num_open_channels", "num_transfer_threads", "num_kv_recomputes", "num_preemptions", "block_size", "max_model_len", "dtype", "max_num_seqs")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_FIELD_NUMBER: _ClassVar[int]
    NUM_IMPORTING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_OPEN_STREAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_OPEN_CHANNELS_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFER_THREADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_RECOMPUTES_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: WorkerRole
    num_waiting: int
    num_running: int
    num_held: int
    num_importing: int
    num_free_blocks: int
    num_blocks: int
    num_queued_prefill_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_open_streams: int
    num_open_channels: int
    num_transfer_threads: int
    num_kv_recomputes: int
    num_preemptions: int
    block_size: int
    max_model_len: int
    dtype: str
    max_num_seqs: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_held: _Optional[int] = ..., num_importing: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_queued_prefill_tokens: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_open_streams: _Optional[int] = ..., num_open_channels: _Optional[int] = ..., num_transfer_threads: _Optional[int] = ..., num_kv_recomputes: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., dtype: _Optional[str] = ..., max_num_seqs: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "kv_handle", "first_token_id", "local_prefill")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    kv_handle: KvHandle
    first_token_id: int
    local_prefill: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., kv_handle: _Optional[_Union[KvHandle, _Mapping]] = ..., first_token_id: _Optional[int] = ..., local_prefill: _Optional[bool] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "top_logprobs", "text", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "kv_recomputed", "timings", "prefill_timings", "prompt_logprobs", "prompt_ranks", "prompt_top_logprobs", "stop_token_id", "stop_string")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_RANKS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    text: str
    finish_reason: FinishReason
    num_prompt_tokens: int
    num_cached_tokens: int
    kv_recomputed: bool
    timings: Timings
    prefill_timings: Timings
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_ranks: _containers.RepeatedScalarFieldContainer[int]
    prompt_top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    stop_token_id: int
    stop_string: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., kv_recomputed: _Optional[bool] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., prefill_timings: _Optional[_Union[Timings, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_ranks: _Optional[_Iterable[int]] = ..., prompt_top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., stop_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class OpenChannelRequest(_message.Message):
    __slots__ = ("decode_worker_id", "layout_fingerprint", "backend", "nccl_unique_id", "node_id", "pid", "gpu_uuid")
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    NCCL_UNIQUE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    decode_worker_id: str
    layout_fingerprint: str
    backend: KvBackend
    nccl_unique_id: bytes
    node_id: str
    pid: int
    gpu_uuid: str
    def __init__(self, decode_worker_id: _Optional[str] = ..., layout_fingerprint: _Optional[str] = ..., backend: _Optional[_Union[KvBackend, str]] = ..., nccl_unique_id: _Optional[bytes] = ..., node_id: _Optional[str] = ..., pid: _Optional[int] = ..., gpu_uuid: _Optional[str] = ...) -> None: ...

class OpenChannelResponse(_message.Message):
    __slots__ = ("channel_id", "tcp_endpoint", "nccl_rank", "backend", "cuda_ipc_cache")
    CHANNEL_ID_FIELD_NUMBER: _ClassVar[int]
    TCP_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    NCCL_RANK_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_CACHE_FIELD_NUMBER: _ClassVar[int]
    channel_id: str
    tcp_endpoint: str
    nccl_rank: int
    backend: KvBackend
    cuda_ipc_cache: bytes
    def __init__(self, channel_id: _Optional[str] = ..., tcp_endpoint: _Optional[str] = ..., nccl_rank: _Optional[int] = ..., backend: _Optional[_Union[KvBackend, str]] = ..., cuda_ipc_cache: _Optional[bytes] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("channel_id", "request_id")
    CHANNEL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    channel_id: str
    request_id: str
    def __init__(self, channel_id: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("num_bytes", "block_ids")
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    num_bytes: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_bytes: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class FinishPullRequest(_message.Message):
    __slots__ = ("channel_id", "request_id")
    CHANNEL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    channel_id: str
    request_id: str
    def __init__(self, channel_id: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class FinishPullResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CloseChannelRequest(_message.Message):
    __slots__ = ("channel_id",)
    CHANNEL_ID_FIELD_NUMBER: _ClassVar[int]
    channel_id: str
    def __init__(self, channel_id: _Optional[str] = ...) -> None: ...

class CloseChannelResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
