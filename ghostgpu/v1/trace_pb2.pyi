from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TraceStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRACE_STATUS_UNSPECIFIED: _ClassVar[TraceStatus]
    TRACE_STATUS_RUNNING: _ClassVar[TraceStatus]
    TRACE_STATUS_COMPLETED: _ClassVar[TraceStatus]
    TRACE_STATUS_STOPPED: _ClassVar[TraceStatus]
    TRACE_STATUS_NODE_LOST: _ClassVar[TraceStatus]
    TRACE_STATUS_FAILED: _ClassVar[TraceStatus]
TRACE_STATUS_UNSPECIFIED: TraceStatus
TRACE_STATUS_RUNNING: TraceStatus
TRACE_STATUS_COMPLETED: TraceStatus
TRACE_STATUS_STOPPED: TraceStatus
TRACE_STATUS_NODE_LOST: TraceStatus
TRACE_STATUS_FAILED: TraceStatus

class TraceScope(_message.Message):
    __slots__ = ("namespace", "pod", "container", "node", "pid", "gpu")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    pod: str
    container: str
    node: str
    pid: int
    gpu: str
    def __init__(self, namespace: _Optional[str] = ..., pod: _Optional[str] = ..., container: _Optional[str] = ..., node: _Optional[str] = ..., pid: _Optional[int] = ..., gpu: _Optional[str] = ...) -> None: ...

class TraceSession(_message.Message):
    __slots__ = ("id", "scope", "requested_by", "started_unix_ns", "deadline_unix_ns", "ended_unix_ns", "status", "status_detail", "nodes", "container_ids", "records_total", "dropped_limit_total", "dropped_ringbuf_total", "dropped_store_total", "max_records", "dropped_transport_total")
    ID_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_BY_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    ENDED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STATUS_DETAIL_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_IDS_FIELD_NUMBER: _ClassVar[int]
    RECORDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DROPPED_LIMIT_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DROPPED_RINGBUF_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STORE_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MAX_RECORDS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_TRANSPORT_TOTAL_FIELD_NUMBER: _ClassVar[int]
    id: str
    scope: TraceScope
    requested_by: str
    started_unix_ns: int
    deadline_unix_ns: int
    ended_unix_ns: int
    status: TraceStatus
    status_detail: str
    nodes: _containers.RepeatedScalarFieldContainer[str]
    container_ids: _containers.RepeatedScalarFieldContainer[str]
    records_total: int
    dropped_limit_total: int
    dropped_ringbuf_total: int
    dropped_store_total: int
    max_records: int
    dropped_transport_total: int
    def __init__(self, id: _Optional[str] = ..., scope: _Optional[_Union[TraceScope, _Mapping]] = ..., requested_by: _Optional[str] = ..., started_unix_ns: _Optional[int] = ..., deadline_unix_ns: _Optional[int] = ..., ended_unix_ns: _Optional[int] = ..., status: _Optional[_Union[TraceStatus, str]] = ..., status_detail: _Optional[str] = ..., nodes: _Optional[_Iterable[str]] = ..., container_ids: _Optional[_Iterable[str]] = ..., records_total: _Optional[int] = ..., dropped_limit_total: _Optional[int] = ..., dropped_ringbuf_total: _Optional[int] = ..., dropped_store_total: _Optional[int] = ..., max_records: _Optional[int] = ..., dropped_transport_total: _Optional[int] = ...) -> None: ...

class TraceRecord(_message.Message):
    __slots__ = ("seq", "node", "ts_unix_ns", "kind", "pid", "tid", "ns_pid", "container_id", "namespace", "pod", "container", "gpu", "device", "fd", "call", "request", "escape", "cmd", "cmd_name", "h_class", "class_name", "nv_status", "nv_status_name", "ret", "duration_ns", "args", "notes", "comm", "child_pid")
    class ArgsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SEQ_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    TS_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    TID_FIELD_NUMBER: _ClassVar[int]
    NS_PID_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    ESCAPE_FIELD_NUMBER: _ClassVar[int]
    CMD_FIELD_NUMBER: _ClassVar[int]
    CMD_NAME_FIELD_NUMBER: _ClassVar[int]
    H_CLASS_FIELD_NUMBER: _ClassVar[int]
    CLASS_NAME_FIELD_NUMBER: _ClassVar[int]
    NV_STATUS_FIELD_NUMBER: _ClassVar[int]
    NV_STATUS_NAME_FIELD_NUMBER: _ClassVar[int]
    RET_FIELD_NUMBER: _ClassVar[int]
    DURATION_NS_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    COMM_FIELD_NUMBER: _ClassVar[int]
    CHILD_PID_FIELD_NUMBER: _ClassVar[int]
    seq: int
    node: str
    ts_unix_ns: int
    kind: str
    pid: int
    tid: int
    ns_pid: int
    container_id: str
    namespace: str
    pod: str
    container: str
    gpu: str
    device: str
    fd: int
    call: str
    request: int
    escape: str
    cmd: int
    cmd_name: str
    h_class: int
    class_name: str
    nv_status: int
    nv_status_name: str
    ret: int
    duration_ns: int
    args: _containers.ScalarMap[str, str]
    notes: _containers.RepeatedScalarFieldContainer[str]
    comm: str
    child_pid: int
    def __init__(self, seq: _Optional[int] = ..., node: _Optional[str] = ..., ts_unix_ns: _Optional[int] = ..., kind: _Optional[str] = ..., pid: _Optional[int] = ..., tid: _Optional[int] = ..., ns_pid: _Optional[int] = ..., container_id: _Optional[str] = ..., namespace: _Optional[str] = ..., pod: _Optional[str] = ..., container: _Optional[str] = ..., gpu: _Optional[str] = ..., device: _Optional[str] = ..., fd: _Optional[int] = ..., call: _Optional[str] = ..., request: _Optional[int] = ..., escape: _Optional[str] = ..., cmd: _Optional[int] = ..., cmd_name: _Optional[str] = ..., h_class: _Optional[int] = ..., class_name: _Optional[str] = ..., nv_status: _Optional[int] = ..., nv_status_name: _Optional[str] = ..., ret: _Optional[int] = ..., duration_ns: _Optional[int] = ..., args: _Optional[_Mapping[str, str]] = ..., notes: _Optional[_Iterable[str]] = ..., comm: _Optional[str] = ..., child_pid: _Optional[int] = ...) -> None: ...

class TraceBatch(_message.Message):
    __slots__ = ("session", "records", "records_total", "dropped_limit_total", "dropped_ringbuf_total", "ended", "end_reason", "dropped_transport_total")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    RECORDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DROPPED_LIMIT_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DROPPED_RINGBUF_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    END_REASON_FIELD_NUMBER: _ClassVar[int]
    DROPPED_TRANSPORT_TOTAL_FIELD_NUMBER: _ClassVar[int]
    session: str
    records: _containers.RepeatedCompositeFieldContainer[TraceRecord]
    records_total: int
    dropped_limit_total: int
    dropped_ringbuf_total: int
    ended: bool
    end_reason: str
    dropped_transport_total: int
    def __init__(self, session: _Optional[str] = ..., records: _Optional[_Iterable[_Union[TraceRecord, _Mapping]]] = ..., records_total: _Optional[int] = ..., dropped_limit_total: _Optional[int] = ..., dropped_ringbuf_total: _Optional[int] = ..., ended: _Optional[bool] = ..., end_reason: _Optional[str] = ..., dropped_transport_total: _Optional[int] = ...) -> None: ...

class TraceStart(_message.Message):
    __slots__ = ("session", "container_ids", "pid", "gpu", "deadline_unix_ns", "max_records", "pid_containers")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_IDS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    MAX_RECORDS_FIELD_NUMBER: _ClassVar[int]
    PID_CONTAINERS_FIELD_NUMBER: _ClassVar[int]
    session: str
    container_ids: _containers.RepeatedScalarFieldContainer[str]
    pid: int
    gpu: str
    deadline_unix_ns: int
    max_records: int
    pid_containers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session: _Optional[str] = ..., container_ids: _Optional[_Iterable[str]] = ..., pid: _Optional[int] = ..., gpu: _Optional[str] = ..., deadline_unix_ns: _Optional[int] = ..., max_records: _Optional[int] = ..., pid_containers: _Optional[_Iterable[str]] = ...) -> None: ...

class TraceUpdate(_message.Message):
    __slots__ = ("session", "container_ids")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_IDS_FIELD_NUMBER: _ClassVar[int]
    session: str
    container_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session: _Optional[str] = ..., container_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class TraceStop(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class TraceCommandResult(_message.Message):
    __slots__ = ("session", "error")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    session: str
    error: str
    def __init__(self, session: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class StartTraceRequest(_message.Message):
    __slots__ = ("scope", "duration_ms", "max_records")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_RECORDS_FIELD_NUMBER: _ClassVar[int]
    scope: TraceScope
    duration_ms: int
    max_records: int
    def __init__(self, scope: _Optional[_Union[TraceScope, _Mapping]] = ..., duration_ms: _Optional[int] = ..., max_records: _Optional[int] = ...) -> None: ...

class StartTraceResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: TraceSession
    def __init__(self, session: _Optional[_Union[TraceSession, _Mapping]] = ...) -> None: ...

class StopTraceRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class StopTraceResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: TraceSession
    def __init__(self, session: _Optional[_Union[TraceSession, _Mapping]] = ...) -> None: ...

class ListTracesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTracesResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[TraceSession]
    def __init__(self, sessions: _Optional[_Iterable[_Union[TraceSession, _Mapping]]] = ...) -> None: ...

class WatchTraceRequest(_message.Message):
    __slots__ = ("id", "follow")
    ID_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    id: str
    follow: bool
    def __init__(self, id: _Optional[str] = ..., follow: _Optional[bool] = ...) -> None: ...

class TraceWatchMessage(_message.Message):
    __slots__ = ("records", "session")
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[TraceRecord]
    session: TraceSession
    def __init__(self, records: _Optional[_Iterable[_Union[TraceRecord, _Mapping]]] = ..., session: _Optional[_Union[TraceSession, _Mapping]] = ...) -> None: ...

class TraceAuditEntry(_message.Message):
    __slots__ = ("ts_unix_ns", "session", "action", "who", "detail")
    TS_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    WHO_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    ts_unix_ns: int
    session: str
    action: str
    who: str
    detail: str
    def __init__(self, ts_unix_ns: _Optional[int] = ..., session: _Optional[str] = ..., action: _Optional[str] = ..., who: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...
