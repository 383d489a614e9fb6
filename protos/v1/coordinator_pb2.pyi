from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ThreadSpec(_message.Message):
    __slots__ = ("thread_index", "runtime_ordinal")
    THREAD_INDEX_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_ORDINAL_FIELD_NUMBER: _ClassVar[int]
    thread_index: int
    runtime_ordinal: int
    def __init__(self, thread_index: _Optional[int] = ..., runtime_ordinal: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("job", "incarnation", "host", "pid", "task_id", "num_tasks", "devices_per_task", "local_rank", "threads", "runtime_world_size", "client_version", "heartbeat_interval", "process_age", "launch")
    JOB_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TASKS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_PER_TASK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    PROCESS_AGE_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_FIELD_NUMBER: _ClassVar[int]
    job: str
    incarnation: str
    host: str
    pid: int
    task_id: int
    num_tasks: int
    devices_per_task: int
    local_rank: int
    threads: _containers.RepeatedCompositeFieldContainer[ThreadSpec]
    runtime_world_size: int
    client_version: str
    heartbeat_interval: float
    process_age: float
    launch: str
    def __init__(self, job: _Optional[str] = ..., incarnation: _Optional[str] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., task_id: _Optional[int] = ..., num_tasks: _Optional[int] = ..., devices_per_task: _Optional[int] = ..., local_rank: _Optional[int] = ..., threads: _Optional[_Iterable[_Union[ThreadSpec, _Mapping]]] = ..., runtime_world_size: _Optional[int] = ..., client_version: _Optional[str] = ..., heartbeat_interval: _Optional[float] = ..., process_age: _Optional[float] = ..., launch: _Optional[str] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("thread_index", "ordinal", "local_ordinal")
    THREAD_INDEX_FIELD_NUMBER: _ClassVar[int]
    ORDINAL_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ORDINAL_FIELD_NUMBER: _ClassVar[int]
    thread_index: int
    ordinal: int
    local_ordinal: int
    def __init__(self, thread_index: _Optional[int] = ..., ordinal: _Optional[int] = ..., local_ordinal: _Optional[int] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("world_size", "assignments", "generation", "heartbeat_timeout", "session_port", "reads_process_indexes", "job_id")
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    SESSION_PORT_FIELD_NUMBER: _ClassVar[int]
    READS_PROCESS_INDEXES_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    world_size: int
    assignments: _containers.RepeatedCompositeFieldContainer[Assignment]
    generation: int
    heartbeat_timeout: float
    session_port: int
    reads_process_indexes: bool
    job_id: str
    def __init__(self, world_size: _Optional[int] = ..., assignments: _Optional[_Iterable[_Union[Assignment, _Mapping]]] = ..., generation: _Optional[int] = ..., heartbeat_timeout: _Optional[float] = ..., session_port: _Optional[int] = ..., reads_process_indexes: _Optional[bool] = ..., job_id: _Optional[str] = ...) -> None: ...

class WaitWorldRequest(_message.Message):
    __slots__ = ("job", "timeout")
    JOB_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    job: str
    timeout: float
    def __init__(self, job: _Optional[str] = ..., timeout: _Optional[float] = ...) -> None: ...

class Participant(_message.Message):
    __slots__ = ("ordinal", "local_ordinal", "task_id", "thread_index", "host", "pid", "incarnation", "last_seen_age", "runtime_ordinal", "alive", "left", "ended", "client_version", "disconnected_age", "unheard_since_restart")
    ORDINAL_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ORDINAL_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    THREAD_INDEX_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_AGE_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_ORDINAL_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    LEFT_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DISCONNECTED_AGE_FIELD_NUMBER: _ClassVar[int]
    UNHEARD_SINCE_RESTART_FIELD_NUMBER: _ClassVar[int]
    ordinal: int
    local_ordinal: int
    task_id: int
    thread_index: int
    host: str
    pid: int
    incarnation: str
    last_seen_age: float
    runtime_ordinal: int
    alive: bool
    left: bool
    ended: str
    client_version: str
    disconnected_age: float
    unheard_since_restart: bool
    def __init__(self, ordinal: _Optional[int] = ..., local_ordinal: _Optional[int] = ..., task_id: _Optional[int] = ..., thread_index: _Optional[int] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., incarnation: _Optional[str] = ..., last_seen_age: _Optional[float] = ..., runtime_ordinal: _Optional[int] = ..., alive: _Optional[bool] = ..., left: _Optional[bool] = ..., ended: _Optional[str] = ..., client_version: _Optional[str] = ..., disconnected_age: _Optional[float] = ..., unheard_since_restart: _Optional[bool] = ...) -> None: ...

class WaitWorldResponse(_message.Message):
    __slots__ = ("world_size", "processes")
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    world_size: int
    processes: _containers.RepeatedCompositeFieldContainer[WorldProcess]
    def __init__(self, world_size: _Optional[int] = ..., processes: _Optional[_Iterable[_Union[WorldProcess, _Mapping]]] = ...) -> None: ...

class WorldProcess(_message.Message):
    __slots__ = ("task_id", "host", "pid", "incarnation", "last_seen_age", "alive", "threads")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_AGE_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    host: str
    pid: int
    incarnation: str
    last_seen_age: float
    alive: bool
    threads: _containers.RepeatedCompositeFieldContainer[WorldThread]
    def __init__(self, task_id: _Optional[int] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., incarnation: _Optional[str] = ..., last_seen_age: _Optional[float] = ..., alive: _Optional[bool] = ..., threads: _Optional[_Iterable[_Union[WorldThread, _Mapping]]] = ...) -> None: ...

class WorldThread(_message.Message):
    __slots__ = ("ordinal", "local_ordinal", "thread_index", "runtime_ordinal")
    ORDINAL_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ORDINAL_FIELD_NUMBER: _ClassVar[int]
    THREAD_INDEX_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_ORDINAL_FIELD_NUMBER: _ClassVar[int]
    ordinal: int
    local_ordinal: int
    thread_index: int
    runtime_ordinal: int
    def __init__(self, ordinal: _Optional[int] = ..., local_ordinal: _Optional[int] = ..., thread_index: _Optional[int] = ..., runtime_ordinal: _Optional[int] = ...) -> None: ...

class Contribution(_message.Message):
    __slots__ = ("ordinal", "tag", "payload", "incarnation")
    ORDINAL_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ordinal: int
    tag: str
    payload: bytes
    incarnation: str
    def __init__(self, ordinal: _Optional[int] = ..., tag: _Optional[str] = ..., payload: _Optional[bytes] = ..., incarnation: _Optional[str] = ...) -> None: ...

class RendezvousRequest(_message.Message):
    __slots__ = ("job", "incarnation", "replicas", "round", "contributions", "timeout", "generation", "ordinals", "tags", "payloads", "incarnations", "processes", "process_indexes")
    JOB_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ORDINALS_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    INCARNATIONS_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    PROCESS_INDEXES_FIELD_NUMBER: _ClassVar[int]
    job: str
    incarnation: str
    replicas: _containers.RepeatedScalarFieldContainer[int]
    round: int
    contributions: _containers.RepeatedCompositeFieldContainer[Contribution]
    timeout: float
    generation: int
    ordinals: _containers.RepeatedScalarFieldContainer[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    payloads: _containers.RepeatedScalarFieldContainer[bytes]
    incarnations: _containers.RepeatedScalarFieldContainer[str]
    processes: _containers.RepeatedScalarFieldContainer[str]
    process_indexes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job: _Optional[str] = ..., incarnation: _Optional[str] = ..., replicas: _Optional[_Iterable[int]] = ..., round: _Optional[int] = ..., contributions: _Optional[_Iterable[_Union[Contribution, _Mapping]]] = ..., timeout: _Optional[float] = ..., generation: _Optional[int] = ..., ordinals: _Optional[_Iterable[int]] = ..., tags: _Optional[_Iterable[str]] = ..., payloads: _Optional[_Iterable[bytes]] = ..., incarnations: _Optional[_Iterable[str]] = ..., processes: _Optional[_Iterable[str]] = ..., process_indexes: _Optional[_Iterable[int]] = ...) -> None: ...

class RendezvousResponse(_message.Message):
    __slots__ = ("payloads",)
    PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    payloads: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, payloads: _Optional[_Iterable[bytes]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("job", "incarnation")
    JOB_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    job: str
    incarnation: str
    def __init__(self, job: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("generation", "heartbeat_timeout", "session_port", "reads_process_indexes")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    SESSION_PORT_FIELD_NUMBER: _ClassVar[int]
    READS_PROCESS_INDEXES_FIELD_NUMBER: _ClassVar[int]
    generation: int
    heartbeat_timeout: float
    session_port: int
    reads_process_indexes: bool
    def __init__(self, generation: _Optional[int] = ..., heartbeat_timeout: _Optional[float] = ..., session_port: _Optional[int] = ..., reads_process_indexes: _Optional[bool] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("job", "incarnation", "reason")
    JOB_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job: str
    incarnation: str
    reason: str
    def __init__(self, job: _Optional[str] = ..., incarnation: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EndReplicasRequest(_message.Message):
    __slots__ = ("job", "incarnation", "ordinals", "reason")
    JOB_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ORDINALS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job: str
    incarnation: str
    ordinals: _containers.RepeatedScalarFieldContainer[int]
    reason: str
    def __init__(self, job: _Optional[str] = ..., incarnation: _Optional[str] = ..., ordinals: _Optional[_Iterable[int]] = ..., reason: _Optional[str] = ...) -> None: ...

class EndReplicasResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GiveUpRoundRequest(_message.Message):
    __slots__ = ("job", "incarnation", "generation", "replicas", "round", "ordinals", "reason", "tag", "job_id")
    JOB_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ORDINALS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job: str
    incarnation: str
    generation: int
    replicas: _containers.RepeatedScalarFieldContainer[int]
    round: int
    ordinals: _containers.RepeatedScalarFieldContainer[int]
    reason: str
    tag: str
    job_id: str
    def __init__(self, job: _Optional[str] = ..., incarnation: _Optional[str] = ..., generation: _Optional[int] = ..., replicas: _Optional[_Iterable[int]] = ..., round: _Optional[int] = ..., ordinals: _Optional[_Iterable[int]] = ..., reason: _Optional[str] = ..., tag: _Optional[str] = ..., job_id: _Optional[str] = ...) -> None: ...

class GiveUpRoundResponse(_message.Message):
    __slots__ = ("failed",)
    FAILED_FIELD_NUMBER: _ClassVar[int]
    failed: bool
    def __init__(self, failed: _Optional[bool] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("job", "incarnation", "after")
    JOB_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    job: str
    incarnation: str
    after: int
    def __init__(self, job: _Optional[str] = ..., incarnation: _Optional[str] = ..., after: _Optional[int] = ...) -> None: ...

class WatchEvent(_message.Message):
    __slots__ = ("kind", "generation", "ordinals", "host", "message", "index")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[WatchEvent.Kind]
        PROCESS_DEAD: _ClassVar[WatchEvent.Kind]
        PROCESS_RESTARTED: _ClassVar[WatchEvent.Kind]
        WORLD_COMPLETE: _ClassVar[WatchEvent.Kind]
        PROCESS_LEFT: _ClassVar[WatchEvent.Kind]
    KIND_UNSPECIFIED: WatchEvent.Kind
    PROCESS_DEAD: WatchEvent.Kind
    PROCESS_RESTARTED: WatchEvent.Kind
    WORLD_COMPLETE: WatchEvent.Kind
    PROCESS_LEFT: WatchEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ORDINALS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    kind: WatchEvent.Kind
    generation: int
    ordinals: _containers.RepeatedScalarFieldContainer[int]
    host: str
    message: str
    index: int
    def __init__(self, kind: _Optional[_Union[WatchEvent.Kind, str]] = ..., generation: _Optional[int] = ..., ordinals: _Optional[_Iterable[int]] = ..., host: _Optional[str] = ..., message: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class KvEntry(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...

class KvSetRequest(_message.Message):
    __slots__ = ("job", "entries", "request_id", "store_id")
    JOB_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    job: str
    entries: _containers.RepeatedCompositeFieldContainer[KvEntry]
    request_id: str
    store_id: str
    def __init__(self, job: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[KvEntry, _Mapping]]] = ..., request_id: _Optional[str] = ..., store_id: _Optional[str] = ...) -> None: ...

class KvSetResponse(_message.Message):
    __slots__ = ("store_id",)
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    store_id: str
    def __init__(self, store_id: _Optional[str] = ...) -> None: ...

class KvGetRequest(_message.Message):
    __slots__ = ("job", "keys", "wait", "timeout", "found_only", "store_id")
    JOB_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    FOUND_ONLY_FIELD_NUMBER: _ClassVar[int]
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    job: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    wait: bool
    timeout: float
    found_only: bool
    store_id: str
    def __init__(self, job: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., wait: _Optional[bool] = ..., timeout: _Optional[float] = ..., found_only: _Optional[bool] = ..., store_id: _Optional[str] = ...) -> None: ...

class KvGetResponse(_message.Message):
    __slots__ = ("values", "store_id")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedCompositeFieldContainer[KvValue]
    store_id: str
    def __init__(self, values: _Optional[_Iterable[_Union[KvValue, _Mapping]]] = ..., store_id: _Optional[str] = ...) -> None: ...

class KvValue(_message.Message):
    __slots__ = ("found", "value")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    found: bool
    value: bytes
    def __init__(self, found: _Optional[bool] = ..., value: _Optional[bytes] = ...) -> None: ...

class KvAddRequest(_message.Message):
    __slots__ = ("job", "key", "delta", "request_id", "store_id")
    JOB_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    job: str
    key: str
    delta: int
    request_id: str
    store_id: str
    def __init__(self, job: _Optional[str] = ..., key: _Optional[str] = ..., delta: _Optional[int] = ..., request_id: _Optional[str] = ..., store_id: _Optional[str] = ...) -> None: ...

class KvAddResponse(_message.Message):
    __slots__ = ("value", "store_id")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    value: int
    store_id: str
    def __init__(self, value: _Optional[int] = ..., store_id: _Optional[str] = ...) -> None: ...

class KvCompareSetRequest(_message.Message):
    __slots__ = ("job", "key", "expected", "desired", "request_id", "store_id")
    JOB_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    job: str
    key: str
    expected: bytes
    desired: bytes
    request_id: str
    store_id: str
    def __init__(self, job: _Optional[str] = ..., key: _Optional[str] = ..., expected: _Optional[bytes] = ..., desired: _Optional[bytes] = ..., request_id: _Optional[str] = ..., store_id: _Optional[str] = ...) -> None: ...

class KvCompareSetResponse(_message.Message):
    __slots__ = ("value", "store_id")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    store_id: str
    def __init__(self, value: _Optional[bytes] = ..., store_id: _Optional[str] = ...) -> None: ...

class KvAppendRequest(_message.Message):
    __slots__ = ("job", "key", "value", "request_id", "store_id")
    JOB_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    job: str
    key: str
    value: bytes
    request_id: str
    store_id: str
    def __init__(self, job: _Optional[str] = ..., key: _Optional[str] = ..., value: _Optional[bytes] = ..., request_id: _Optional[str] = ..., store_id: _Optional[str] = ...) -> None: ...

class KvAppendResponse(_message.Message):
    __slots__ = ("store_id",)
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    store_id: str
    def __init__(self, store_id: _Optional[str] = ...) -> None: ...

class KvDeleteRequest(_message.Message):
    __slots__ = ("job", "key", "request_id", "store_id")
    JOB_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    job: str
    key: str
    request_id: str
    store_id: str
    def __init__(self, job: _Optional[str] = ..., key: _Optional[str] = ..., request_id: _Optional[str] = ..., store_id: _Optional[str] = ...) -> None: ...

class KvDeleteResponse(_message.Message):
    __slots__ = ("deleted", "store_id")
    DELETED_FIELD_NUMBER: _ClassVar[int]
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    store_id: str
    def __init__(self, deleted: _Optional[bool] = ..., store_id: _Optional[str] = ...) -> None: ...

class KvListRequest(_message.Message):
    __slots__ = ("job", "prefix", "count_only", "store_id")
    JOB_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    COUNT_ONLY_FIELD_NUMBER: _ClassVar[int]
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    job: str
    prefix: str
    count_only: bool
    store_id: str
    def __init__(self, job: _Optional[str] = ..., prefix: _Optional[str] = ..., count_only: _Optional[bool] = ..., store_id: _Optional[str] = ...) -> None: ...

class KvListResponse(_message.Message):
    __slots__ = ("entries", "count", "store_id")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[KvEntry]
    count: int
    store_id: str
    def __init__(self, entries: _Optional[_Iterable[_Union[KvEntry, _Mapping]]] = ..., count: _Optional[int] = ..., store_id: _Optional[str] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("calls",)
    CALLS_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[SessionCall]
    def __init__(self, calls: _Optional[_Iterable[_Union[SessionCall, _Mapping]]] = ...) -> None: ...

class SessionHello(_message.Message):
    __slots__ = ("authorization",)
    AUTHORIZATION_FIELD_NUMBER: _ClassVar[int]
    authorization: str
    def __init__(self, authorization: _Optional[str] = ...) -> None: ...

class SessionCall(_message.Message):
    __slots__ = ("id", "method", "request", "cancel")
    ID_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    id: int
    method: str
    request: bytes
    cancel: bool
    def __init__(self, id: _Optional[int] = ..., method: _Optional[str] = ..., request: _Optional[bytes] = ..., cancel: _Optional[bool] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("answers",)
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[SessionAnswer]
    def __init__(self, answers: _Optional[_Iterable[_Union[SessionAnswer, _Mapping]]] = ...) -> None: ...

class SessionAnswer(_message.Message):
    __slots__ = ("id", "code", "message", "response")
    ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    id: int
    code: int
    message: str
    response: bytes
    def __init__(self, id: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., response: _Optional[bytes] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("job", "rounds_only")
    JOB_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_ONLY_FIELD_NUMBER: _ClassVar[int]
    job: str
    rounds_only: bool
    def __init__(self, job: _Optional[str] = ..., rounds_only: _Optional[bool] = ...) -> None: ...

class TagGroup(_message.Message):
    __slots__ = ("tag", "ordinals")
    TAG_FIELD_NUMBER: _ClassVar[int]
    ORDINALS_FIELD_NUMBER: _ClassVar[int]
    tag: str
    ordinals: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tag: _Optional[str] = ..., ordinals: _Optional[_Iterable[int]] = ...) -> None: ...

class PendingRound(_message.Message):
    __slots__ = ("replicas", "round", "tags", "arrived", "missing", "waiting_seconds", "missing_summary")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    ARRIVED_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    WAITING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MISSING_SUMMARY_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedScalarFieldContainer[int]
    round: int
    tags: _containers.RepeatedCompositeFieldContainer[TagGroup]
    arrived: _containers.RepeatedScalarFieldContainer[int]
    missing: _containers.RepeatedScalarFieldContainer[int]
    waiting_seconds: float
    missing_summary: str
    def __init__(self, replicas: _Optional[_Iterable[int]] = ..., round: _Optional[int] = ..., tags: _Optional[_Iterable[_Union[TagGroup, _Mapping]]] = ..., arrived: _Optional[_Iterable[int]] = ..., missing: _Optional[_Iterable[int]] = ..., waiting_seconds: _Optional[float] = ..., missing_summary: _Optional[str] = ...) -> None: ...

class RefusedTask(_message.Message):
    __slots__ = ("task_id", "ordinals", "reason")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ORDINALS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    ordinals: _containers.RepeatedScalarFieldContainer[int]
    reason: str
    def __init__(self, task_id: _Optional[int] = ..., ordinals: _Optional[_Iterable[int]] = ..., reason: _Optional[str] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job", "world_size", "registered", "generation", "participants", "pending_rounds", "rounds_completed", "kv_keys", "refused", "devices_per_task", "world_missing_summary")
    JOB_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    PENDING_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    KV_KEYS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    DEVICES_PER_TASK_FIELD_NUMBER: _ClassVar[int]
    WORLD_MISSING_SUMMARY_FIELD_NUMBER: _ClassVar[int]
    job: str
    world_size: int
    registered: int
    generation: int
    participants: _containers.RepeatedCompositeFieldContainer[Participant]
    pending_rounds: _containers.RepeatedCompositeFieldContainer[PendingRound]
    rounds_completed: int
    kv_keys: int
    refused: _containers.RepeatedCompositeFieldContainer[RefusedTask]
    devices_per_task: int
    world_missing_summary: str
    def __init__(self, job: _Optional[str] = ..., world_size: _Optional[int] = ..., registered: _Optional[int] = ..., generation: _Optional[int] = ..., participants: _Optional[_Iterable[_Union[Participant, _Mapping]]] = ..., pending_rounds: _Optional[_Iterable[_Union[PendingRound, _Mapping]]] = ..., rounds_completed: _Optional[int] = ..., kv_keys: _Optional[int] = ..., refused: _Optional[_Iterable[_Union[RefusedTask, _Mapping]]] = ..., devices_per_task: _Optional[int] = ..., world_missing_summary: _Optional[str] = ...) -> None: ...

class UnknownProcesses(_message.Message):
    __slots__ = ("job", "job_known", "processes", "last_call_age", "reason")
    JOB_FIELD_NUMBER: _ClassVar[int]
    JOB_KNOWN_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    LAST_CALL_AGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job: str
    job_known: bool
    processes: int
    last_call_age: float
    reason: str
    def __init__(self, job: _Optional[str] = ..., job_known: _Optional[bool] = ..., processes: _Optional[int] = ..., last_call_age: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("jobs", "coordinator_version", "unknown_processes")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_VERSION_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobStatus]
    coordinator_version: str
    unknown_processes: _containers.RepeatedCompositeFieldContainer[UnknownProcesses]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobStatus, _Mapping]]] = ..., coordinator_version: _Optional[str] = ..., unknown_processes: _Optional[_Iterable[_Union[UnknownProcesses, _Mapping]]] = ...) -> None: ...
