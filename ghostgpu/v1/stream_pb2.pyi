from ghostgpu.v1 import node_pb2 as _node_pb2
from ghostgpu.v1 import trace_pb2 as _trace_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TracerMessage(_message.Message):
    __slots__ = ("hello", "events", "snapshot", "heartbeat", "result", "trace")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    events: EventBatch
    snapshot: Snapshot
    heartbeat: Heartbeat
    result: CommandResult
    trace: _trace_pb2.TraceBatch
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., events: _Optional[_Union[EventBatch, _Mapping]] = ..., snapshot: _Optional[_Union[Snapshot, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., result: _Optional[_Union[CommandResult, _Mapping]] = ..., trace: _Optional[_Union[_trace_pb2.TraceBatch, _Mapping]] = ...) -> None: ...

class CollectorMessage(_message.Message):
    __slots__ = ("welcome", "ack", "command")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    ack: Ack
    command: Command
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ..., command: _Optional[_Union[Command, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("api_version", "node", "boot_id", "instance_id", "tracer_version", "capabilities")
    API_VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TRACER_VERSION_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    api_version: int
    node: str
    boot_id: str
    instance_id: str
    tracer_version: str
    capabilities: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, api_version: _Optional[int] = ..., node: _Optional[str] = ..., boot_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., tracer_version: _Optional[str] = ..., capabilities: _Optional[_Iterable[str]] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("api_version", "collector_version", "acked_seq", "max_batch_events")
    API_VERSION_FIELD_NUMBER: _ClassVar[int]
    COLLECTOR_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACKED_SEQ_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_EVENTS_FIELD_NUMBER: _ClassVar[int]
    api_version: int
    collector_version: str
    acked_seq: int
    max_batch_events: int
    def __init__(self, api_version: _Optional[int] = ..., collector_version: _Optional[str] = ..., acked_seq: _Optional[int] = ..., max_batch_events: _Optional[int] = ...) -> None: ...

class Notice(_message.Message):
    __slots__ = ("what", "message")
    WHAT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    what: str
    message: str
    def __init__(self, what: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class ContainerAllocation(_message.Message):
    __slots__ = ("namespace", "pod", "container", "resource_names", "device_ids")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    RESOURCE_NAMES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    pod: str
    container: str
    resource_names: _containers.RepeatedScalarFieldContainer[str]
    device_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, namespace: _Optional[str] = ..., pod: _Optional[str] = ..., container: _Optional[str] = ..., resource_names: _Optional[_Iterable[str]] = ..., device_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class Allocations(_message.Message):
    __slots__ = ("available", "error", "containers", "read_unix_ns")
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CONTAINERS_FIELD_NUMBER: _ClassVar[int]
    READ_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    available: bool
    error: str
    containers: _containers.RepeatedCompositeFieldContainer[ContainerAllocation]
    read_unix_ns: int
    def __init__(self, available: _Optional[bool] = ..., error: _Optional[str] = ..., containers: _Optional[_Iterable[_Union[ContainerAllocation, _Mapping]]] = ..., read_unix_ns: _Optional[int] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("bpf", "nvml", "nvml_error", "driver_version", "gpus")
    BPF_FIELD_NUMBER: _ClassVar[int]
    NVML_FIELD_NUMBER: _ClassVar[int]
    NVML_ERROR_FIELD_NUMBER: _ClassVar[int]
    DRIVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    bpf: bool
    nvml: bool
    nvml_error: str
    driver_version: str
    gpus: _containers.RepeatedCompositeFieldContainer[Gpu]
    def __init__(self, bpf: _Optional[bool] = ..., nvml: _Optional[bool] = ..., nvml_error: _Optional[str] = ..., driver_version: _Optional[str] = ..., gpus: _Optional[_Iterable[_Union[Gpu, _Mapping]]] = ...) -> None: ...

class Gpu(_message.Message):
    __slots__ = ("index", "uuid", "name", "minor", "memory_total_bytes", "pci_bus_id", "memory_used_bytes", "memory_listed_bytes", "memory_unlisted_bytes", "unaccounted_bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MINOR_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LISTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_UNLISTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    UNACCOUNTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    name: str
    minor: int
    memory_total_bytes: int
    pci_bus_id: str
    memory_used_bytes: int
    memory_listed_bytes: int
    memory_unlisted_bytes: int
    unaccounted_bytes: int
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., minor: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., pci_bus_id: _Optional[str] = ..., memory_used_bytes: _Optional[int] = ..., memory_listed_bytes: _Optional[int] = ..., memory_unlisted_bytes: _Optional[int] = ..., unaccounted_bytes: _Optional[int] = ...) -> None: ...

class FaultConsumer(_message.Message):
    __slots__ = ("process", "named", "exited", "gpu")
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    NAMED_FIELD_NUMBER: _ClassVar[int]
    EXITED_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    process: _node_pb2.Process
    named: bool
    exited: bool
    gpu: int
    def __init__(self, process: _Optional[_Union[_node_pb2.Process, _Mapping]] = ..., named: _Optional[bool] = ..., exited: _Optional[bool] = ..., gpu: _Optional[int] = ...) -> None: ...

class Fault(_message.Message):
    __slots__ = ("ts_ns", "gpu", "gpu_uuid", "pci_bus_id", "xid", "severity", "meaning", "message", "pid", "process_name", "affected", "raw", "kmsg_seq", "origin")
    TS_NS_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    XID_FIELD_NUMBER: _ClassVar[int]
    SEVERITY_FIELD_NUMBER: _ClassVar[int]
    MEANING_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_NAME_FIELD_NUMBER: _ClassVar[int]
    AFFECTED_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    KMSG_SEQ_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    ts_ns: int
    gpu: int
    gpu_uuid: str
    pci_bus_id: str
    xid: int
    severity: str
    meaning: str
    message: str
    pid: int
    process_name: str
    affected: _containers.RepeatedCompositeFieldContainer[FaultConsumer]
    raw: str
    kmsg_seq: int
    origin: str
    def __init__(self, ts_ns: _Optional[int] = ..., gpu: _Optional[int] = ..., gpu_uuid: _Optional[str] = ..., pci_bus_id: _Optional[str] = ..., xid: _Optional[int] = ..., severity: _Optional[str] = ..., meaning: _Optional[str] = ..., message: _Optional[str] = ..., pid: _Optional[int] = ..., process_name: _Optional[str] = ..., affected: _Optional[_Iterable[_Union[FaultConsumer, _Mapping]]] = ..., raw: _Optional[str] = ..., kmsg_seq: _Optional[int] = ..., origin: _Optional[str] = ...) -> None: ...

class NodeEvent(_message.Message):
    __slots__ = ("seq", "ts_unix_ns", "finding", "resolved", "holder", "notice", "allocations", "info", "fault")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TS_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    FINDING_FIELD_NUMBER: _ClassVar[int]
    RESOLVED_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    NOTICE_FIELD_NUMBER: _ClassVar[int]
    ALLOCATIONS_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    FAULT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    ts_unix_ns: int
    finding: _node_pb2.Consumer
    resolved: _node_pb2.Consumer
    holder: _node_pb2.HolderEvent
    notice: Notice
    allocations: Allocations
    info: NodeInfo
    fault: Fault
    def __init__(self, seq: _Optional[int] = ..., ts_unix_ns: _Optional[int] = ..., finding: _Optional[_Union[_node_pb2.Consumer, _Mapping]] = ..., resolved: _Optional[_Union[_node_pb2.Consumer, _Mapping]] = ..., holder: _Optional[_Union[_node_pb2.HolderEvent, _Mapping]] = ..., notice: _Optional[_Union[Notice, _Mapping]] = ..., allocations: _Optional[_Union[Allocations, _Mapping]] = ..., info: _Optional[_Union[NodeInfo, _Mapping]] = ..., fault: _Optional[_Union[Fault, _Mapping]] = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[NodeEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[NodeEvent, _Mapping]]] = ...) -> None: ...

class Snapshot(_message.Message):
    __slots__ = ("seq", "consumers", "allocations", "info", "ts_unix_ns", "stats")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CONSUMERS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATIONS_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    TS_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    consumers: _containers.RepeatedCompositeFieldContainer[_node_pb2.Consumer]
    allocations: Allocations
    info: NodeInfo
    ts_unix_ns: int
    stats: TracerStats
    def __init__(self, seq: _Optional[int] = ..., consumers: _Optional[_Iterable[_Union[_node_pb2.Consumer, _Mapping]]] = ..., allocations: _Optional[_Union[Allocations, _Mapping]] = ..., info: _Optional[_Union[NodeInfo, _Mapping]] = ..., ts_unix_ns: _Optional[int] = ..., stats: _Optional[_Union[TracerStats, _Mapping]] = ...) -> None: ...

class TracerStats(_message.Message):
    __slots__ = ("spool_events", "spool_dropped_total", "ringbuf_dropped_total", "reconnects_total", "memory_objects_dropped_total", "kmsg_unparsed_total", "faults_dropped_total", "kmsg_records_lost_total")
    SPOOL_EVENTS_FIELD_NUMBER: _ClassVar[int]
    SPOOL_DROPPED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RINGBUF_DROPPED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RECONNECTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MEMORY_OBJECTS_DROPPED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KMSG_UNPARSED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FAULTS_DROPPED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KMSG_RECORDS_LOST_TOTAL_FIELD_NUMBER: _ClassVar[int]
    spool_events: int
    spool_dropped_total: int
    ringbuf_dropped_total: int
    reconnects_total: int
    memory_objects_dropped_total: int
    kmsg_unparsed_total: int
    faults_dropped_total: int
    kmsg_records_lost_total: int
    def __init__(self, spool_events: _Optional[int] = ..., spool_dropped_total: _Optional[int] = ..., ringbuf_dropped_total: _Optional[int] = ..., reconnects_total: _Optional[int] = ..., memory_objects_dropped_total: _Optional[int] = ..., kmsg_unparsed_total: _Optional[int] = ..., faults_dropped_total: _Optional[int] = ..., kmsg_records_lost_total: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("ts_unix_ns", "last_seq", "stats")
    TS_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    ts_unix_ns: int
    last_seq: int
    stats: TracerStats
    def __init__(self, ts_unix_ns: _Optional[int] = ..., last_seq: _Optional[int] = ..., stats: _Optional[_Union[TracerStats, _Mapping]] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class Command(_message.Message):
    __slots__ = ("id", "cri", "trace_start", "trace_update", "trace_stop", "remediate")
    ID_FIELD_NUMBER: _ClassVar[int]
    CRI_FIELD_NUMBER: _ClassVar[int]
    TRACE_START_FIELD_NUMBER: _ClassVar[int]
    TRACE_UPDATE_FIELD_NUMBER: _ClassVar[int]
    TRACE_STOP_FIELD_NUMBER: _ClassVar[int]
    REMEDIATE_FIELD_NUMBER: _ClassVar[int]
    id: int
    cri: CriRequest
    trace_start: _trace_pb2.TraceStart
    trace_update: _trace_pb2.TraceUpdate
    trace_stop: _trace_pb2.TraceStop
    remediate: RemediateCommand
    def __init__(self, id: _Optional[int] = ..., cri: _Optional[_Union[CriRequest, _Mapping]] = ..., trace_start: _Optional[_Union[_trace_pb2.TraceStart, _Mapping]] = ..., trace_update: _Optional[_Union[_trace_pb2.TraceUpdate, _Mapping]] = ..., trace_stop: _Optional[_Union[_trace_pb2.TraceStop, _Mapping]] = ..., remediate: _Optional[_Union[RemediateCommand, _Mapping]] = ...) -> None: ...

class CommandResult(_message.Message):
    __slots__ = ("id", "cri", "trace", "remediate")
    ID_FIELD_NUMBER: _ClassVar[int]
    CRI_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    REMEDIATE_FIELD_NUMBER: _ClassVar[int]
    id: int
    cri: CriResponse
    trace: _trace_pb2.TraceCommandResult
    remediate: RemediateResult
    def __init__(self, id: _Optional[int] = ..., cri: _Optional[_Union[CriResponse, _Mapping]] = ..., trace: _Optional[_Union[_trace_pb2.TraceCommandResult, _Mapping]] = ..., remediate: _Optional[_Union[RemediateResult, _Mapping]] = ...) -> None: ...

class RemediateCommand(_message.Message):
    __slots__ = ("incident", "process", "container_id", "devices", "grace_ms", "dry_run", "deadline_ms")
    INCIDENT_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    GRACE_MS_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    incident: str
    process: _node_pb2.Process
    container_id: str
    devices: _containers.RepeatedScalarFieldContainer[str]
    grace_ms: int
    dry_run: bool
    deadline_ms: int
    def __init__(self, incident: _Optional[str] = ..., process: _Optional[_Union[_node_pb2.Process, _Mapping]] = ..., container_id: _Optional[str] = ..., devices: _Optional[_Iterable[str]] = ..., grace_ms: _Optional[int] = ..., dry_run: _Optional[bool] = ..., deadline_ms: _Optional[int] = ...) -> None: ...

class RemediateResult(_message.Message):
    __slots__ = ("incident", "outcome", "reason", "signals", "released", "proc_state", "wchan", "stack", "stuck_tids", "elapsed_ms", "exited", "not_started")
    INCIDENT_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SIGNALS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    PROC_STATE_FIELD_NUMBER: _ClassVar[int]
    WCHAN_FIELD_NUMBER: _ClassVar[int]
    STACK_FIELD_NUMBER: _ClassVar[int]
    STUCK_TIDS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    EXITED_FIELD_NUMBER: _ClassVar[int]
    NOT_STARTED_FIELD_NUMBER: _ClassVar[int]
    incident: str
    outcome: str
    reason: str
    signals: _containers.RepeatedScalarFieldContainer[str]
    released: bool
    proc_state: str
    wchan: str
    stack: str
    stuck_tids: _containers.RepeatedScalarFieldContainer[int]
    elapsed_ms: int
    exited: bool
    not_started: bool
    def __init__(self, incident: _Optional[str] = ..., outcome: _Optional[str] = ..., reason: _Optional[str] = ..., signals: _Optional[_Iterable[str]] = ..., released: _Optional[bool] = ..., proc_state: _Optional[str] = ..., wchan: _Optional[str] = ..., stack: _Optional[str] = ..., stuck_tids: _Optional[_Iterable[int]] = ..., elapsed_ms: _Optional[int] = ..., exited: _Optional[bool] = ..., not_started: _Optional[bool] = ...) -> None: ...

class CriRequest(_message.Message):
    __slots__ = ("method", "request", "timeout_ms")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    method: str
    request: bytes
    timeout_ms: int
    def __init__(self, method: _Optional[str] = ..., request: _Optional[bytes] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class CriResponse(_message.Message):
    __slots__ = ("code", "message", "response", "endpoint")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    response: bytes
    endpoint: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., response: _Optional[bytes] = ..., endpoint: _Optional[str] = ...) -> None: ...
