from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetPoolsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ScalePoolsRequest(_message.Message):
    __slots__ = ("prefill", "decode")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    prefill: int
    decode: int
    def __init__(self, prefill: _Optional[int] = ..., decode: _Optional[int] = ...) -> None: ...

class DrainWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class PoolTargets(_message.Message):
    __slots__ = ("prefill", "decode")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    prefill: int
    decode: int
    def __init__(self, prefill: _Optional[int] = ..., decode: _Optional[int] = ...) -> None: ...

class Worker(_message.Message):
    __slots__ = ("id", "role", "state", "node", "pid", "endpoint", "metrics_url", "running", "waiting", "kv_usage", "being_replaced", "predicted_step_s", "predicted_queue_s", "threads")
    ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    METRICS_URL_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    BEING_REPLACED_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_STEP_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    id: str
    role: str
    state: str
    node: str
    pid: int
    endpoint: str
    metrics_url: str
    running: int
    waiting: int
    kv_usage: float
    being_replaced: bool
    predicted_step_s: float
    predicted_queue_s: float
    threads: int
    def __init__(self, id: _Optional[str] = ..., role: _Optional[str] = ..., state: _Optional[str] = ..., node: _Optional[str] = ..., pid: _Optional[int] = ..., endpoint: _Optional[str] = ..., metrics_url: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., being_replaced: _Optional[bool] = ..., predicted_step_s: _Optional[float] = ..., predicted_queue_s: _Optional[float] = ..., threads: _Optional[int] = ...) -> None: ...

class RestartHold(_message.Message):
    __slots__ = ("failures", "until_unix_s")
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    UNTIL_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    failures: int
    until_unix_s: float
    def __init__(self, failures: _Optional[int] = ..., until_unix_s: _Optional[float] = ...) -> None: ...

class PoolsResponse(_message.Message):
    __slots__ = ("workers", "targets", "version", "owner", "restart_holds")
    class RestartHoldsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: RestartHold
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[RestartHold, _Mapping]] = ...) -> None: ...
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    RESTART_HOLDS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[Worker]
    targets: PoolTargets
    version: int
    owner: str
    restart_holds: _containers.MessageMap[str, RestartHold]
    def __init__(self, workers: _Optional[_Iterable[_Union[Worker, _Mapping]]] = ..., targets: _Optional[_Union[PoolTargets, _Mapping]] = ..., version: _Optional[int] = ..., owner: _Optional[str] = ..., restart_holds: _Optional[_Mapping[str, RestartHold]] = ...) -> None: ...
