from ghostgpu.v1 import node_pb2 as _node_pb2
from ghostgpu.v1 import stream_pb2 as _stream_pb2
from ghostgpu.v1 import trace_pb2 as _trace_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Allocated(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ALLOCATED_UNKNOWN: _ClassVar[Allocated]
    ALLOCATED_TRUE: _ClassVar[Allocated]
    ALLOCATED_FALSE: _ClassVar[Allocated]
ALLOCATED_UNKNOWN: Allocated
ALLOCATED_TRUE: Allocated
ALLOCATED_FALSE: Allocated

class K8sIdentity(_message.Message):
    __slots__ = ("namespace", "pod", "pod_uid", "container", "image", "container_state", "sandbox_state", "resolution", "error", "runtime")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    POD_UID_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_STATE_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_STATE_FIELD_NUMBER: _ClassVar[int]
    RESOLUTION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    pod: str
    pod_uid: str
    container: str
    image: str
    container_state: str
    sandbox_state: str
    resolution: str
    error: str
    runtime: str
    def __init__(self, namespace: _Optional[str] = ..., pod: _Optional[str] = ..., pod_uid: _Optional[str] = ..., container: _Optional[str] = ..., image: _Optional[str] = ..., container_state: _Optional[str] = ..., sandbox_state: _Optional[str] = ..., resolution: _Optional[str] = ..., error: _Optional[str] = ..., runtime: _Optional[str] = ...) -> None: ...

class ClusterConsumer(_message.Message):
    __slots__ = ("consumer", "k8s", "allocated", "node_class", "since_unix_ns", "updated_unix_ns")
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    K8S_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    NODE_CLASS_FIELD_NUMBER: _ClassVar[int]
    SINCE_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    consumer: _node_pb2.Consumer
    k8s: K8sIdentity
    allocated: Allocated
    node_class: _node_pb2.ConsumerClass
    since_unix_ns: int
    updated_unix_ns: int
    def __init__(self, consumer: _Optional[_Union[_node_pb2.Consumer, _Mapping]] = ..., k8s: _Optional[_Union[K8sIdentity, _Mapping]] = ..., allocated: _Optional[_Union[Allocated, str]] = ..., node_class: _Optional[_Union[_node_pb2.ConsumerClass, str]] = ..., since_unix_ns: _Optional[int] = ..., updated_unix_ns: _Optional[int] = ...) -> None: ...

class ListConsumersRequest(_message.Message):
    __slots__ = ("node", "namespace", "pod", "classes")
    NODE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    node: str
    namespace: str
    pod: str
    classes: _containers.RepeatedScalarFieldContainer[_node_pb2.ConsumerClass]
    def __init__(self, node: _Optional[str] = ..., namespace: _Optional[str] = ..., pod: _Optional[str] = ..., classes: _Optional[_Iterable[_Union[_node_pb2.ConsumerClass, str]]] = ...) -> None: ...

class ListConsumersResponse(_message.Message):
    __slots__ = ("consumers", "ts_unix_ns")
    CONSUMERS_FIELD_NUMBER: _ClassVar[int]
    TS_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    consumers: _containers.RepeatedCompositeFieldContainer[ClusterConsumer]
    ts_unix_ns: int
    def __init__(self, consumers: _Optional[_Iterable[_Union[ClusterConsumer, _Mapping]]] = ..., ts_unix_ns: _Optional[int] = ...) -> None: ...

class Finding(_message.Message):
    __slots__ = ("id", "node", "consumer", "opened_unix_ns", "resolved_unix_ns", "remediation")
    ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    OPENED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    RESOLVED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    REMEDIATION_FIELD_NUMBER: _ClassVar[int]
    id: int
    node: str
    consumer: ClusterConsumer
    opened_unix_ns: int
    resolved_unix_ns: int
    remediation: Remediation
    def __init__(self, id: _Optional[int] = ..., node: _Optional[str] = ..., consumer: _Optional[_Union[ClusterConsumer, _Mapping]] = ..., opened_unix_ns: _Optional[int] = ..., resolved_unix_ns: _Optional[int] = ..., remediation: _Optional[_Union[Remediation, _Mapping]] = ...) -> None: ...

class Remediation(_message.Message):
    __slots__ = ("state", "action", "at_unix_ns", "reason", "mode", "incident", "audit_seq")
    STATE_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    AT_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    INCIDENT_FIELD_NUMBER: _ClassVar[int]
    AUDIT_SEQ_FIELD_NUMBER: _ClassVar[int]
    state: str
    action: str
    at_unix_ns: int
    reason: str
    mode: str
    incident: str
    audit_seq: int
    def __init__(self, state: _Optional[str] = ..., action: _Optional[str] = ..., at_unix_ns: _Optional[int] = ..., reason: _Optional[str] = ..., mode: _Optional[str] = ..., incident: _Optional[str] = ..., audit_seq: _Optional[int] = ...) -> None: ...

class FindingEvent(_message.Message):
    __slots__ = ("kind", "finding")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[FindingEvent.Kind]
        KIND_OPENED: _ClassVar[FindingEvent.Kind]
        KIND_CHANGED: _ClassVar[FindingEvent.Kind]
        KIND_RESOLVED: _ClassVar[FindingEvent.Kind]
    KIND_UNSPECIFIED: FindingEvent.Kind
    KIND_OPENED: FindingEvent.Kind
    KIND_CHANGED: FindingEvent.Kind
    KIND_RESOLVED: FindingEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    FINDING_FIELD_NUMBER: _ClassVar[int]
    kind: FindingEvent.Kind
    finding: Finding
    def __init__(self, kind: _Optional[_Union[FindingEvent.Kind, str]] = ..., finding: _Optional[_Union[Finding, _Mapping]] = ...) -> None: ...

class WatchFindingsRequest(_message.Message):
    __slots__ = ("node", "namespace", "classes", "include_open")
    NODE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_OPEN_FIELD_NUMBER: _ClassVar[int]
    node: str
    namespace: str
    classes: _containers.RepeatedScalarFieldContainer[_node_pb2.ConsumerClass]
    include_open: bool
    def __init__(self, node: _Optional[str] = ..., namespace: _Optional[str] = ..., classes: _Optional[_Iterable[_Union[_node_pb2.ConsumerClass, str]]] = ..., include_open: _Optional[bool] = ...) -> None: ...

class ListFindingsRequest(_message.Message):
    __slots__ = ("since_unix_ns", "node", "namespace", "classes", "limit")
    SINCE_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    since_unix_ns: int
    node: str
    namespace: str
    classes: _containers.RepeatedScalarFieldContainer[_node_pb2.ConsumerClass]
    limit: int
    def __init__(self, since_unix_ns: _Optional[int] = ..., node: _Optional[str] = ..., namespace: _Optional[str] = ..., classes: _Optional[_Iterable[_Union[_node_pb2.ConsumerClass, str]]] = ..., limit: _Optional[int] = ...) -> None: ...

class ListFindingsResponse(_message.Message):
    __slots__ = ("findings",)
    FINDINGS_FIELD_NUMBER: _ClassVar[int]
    findings: _containers.RepeatedCompositeFieldContainer[Finding]
    def __init__(self, findings: _Optional[_Iterable[_Union[Finding, _Mapping]]] = ...) -> None: ...

class NodeStatusRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: str
    def __init__(self, node: _Optional[str] = ...) -> None: ...

class TracerStatus(_message.Message):
    __slots__ = ("node", "connected", "boot_id", "instance_id", "tracer_version", "capabilities", "connected_unix_ns", "last_heartbeat_unix_ns", "last_seq", "events_ingested_total", "events_lost_total", "duplicates_total", "info", "allocations", "consumers", "cri_failures_total", "stats")
    NODE_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TRACER_VERSION_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENTS_INGESTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EVENTS_LOST_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    ALLOCATIONS_FIELD_NUMBER: _ClassVar[int]
    CONSUMERS_FIELD_NUMBER: _ClassVar[int]
    CRI_FAILURES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    node: str
    connected: bool
    boot_id: str
    instance_id: str
    tracer_version: str
    capabilities: _containers.RepeatedScalarFieldContainer[str]
    connected_unix_ns: int
    last_heartbeat_unix_ns: int
    last_seq: int
    events_ingested_total: int
    events_lost_total: int
    duplicates_total: int
    info: _stream_pb2.NodeInfo
    allocations: _stream_pb2.Allocations
    consumers: int
    cri_failures_total: int
    stats: _stream_pb2.TracerStats
    def __init__(self, node: _Optional[str] = ..., connected: _Optional[bool] = ..., boot_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., tracer_version: _Optional[str] = ..., capabilities: _Optional[_Iterable[str]] = ..., connected_unix_ns: _Optional[int] = ..., last_heartbeat_unix_ns: _Optional[int] = ..., last_seq: _Optional[int] = ..., events_ingested_total: _Optional[int] = ..., events_lost_total: _Optional[int] = ..., duplicates_total: _Optional[int] = ..., info: _Optional[_Union[_stream_pb2.NodeInfo, _Mapping]] = ..., allocations: _Optional[_Union[_stream_pb2.Allocations, _Mapping]] = ..., consumers: _Optional[int] = ..., cri_failures_total: _Optional[int] = ..., stats: _Optional[_Union[_stream_pb2.TracerStats, _Mapping]] = ...) -> None: ...

class NodeStatusResponse(_message.Message):
    __slots__ = ("nodes", "collector_version")
    NODES_FIELD_NUMBER: _ClassVar[int]
    COLLECTOR_VERSION_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[TracerStatus]
    collector_version: str
    def __init__(self, nodes: _Optional[_Iterable[_Union[TracerStatus, _Mapping]]] = ..., collector_version: _Optional[str] = ...) -> None: ...

class ListEventsRequest(_message.Message):
    __slots__ = ("node", "after_seq", "instance_id", "limit")
    NODE_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    node: str
    after_seq: int
    instance_id: str
    limit: int
    def __init__(self, node: _Optional[str] = ..., after_seq: _Optional[int] = ..., instance_id: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class StoredEvent(_message.Message):
    __slots__ = ("node", "boot_id", "instance_id", "event")
    NODE_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    node: str
    boot_id: str
    instance_id: str
    event: _stream_pb2.NodeEvent
    def __init__(self, node: _Optional[str] = ..., boot_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., event: _Optional[_Union[_stream_pb2.NodeEvent, _Mapping]] = ...) -> None: ...

class ListEventsResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[StoredEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[StoredEvent, _Mapping]]] = ...) -> None: ...

class AuditRecord(_message.Message):
    __slots__ = ("seq", "ts_unix_ns", "action", "subject", "result", "detail_json", "prev_sha256", "sha256")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TS_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_JSON_FIELD_NUMBER: _ClassVar[int]
    PREV_SHA256_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    seq: int
    ts_unix_ns: int
    action: str
    subject: str
    result: str
    detail_json: str
    prev_sha256: str
    sha256: str
    def __init__(self, seq: _Optional[int] = ..., ts_unix_ns: _Optional[int] = ..., action: _Optional[str] = ..., subject: _Optional[str] = ..., result: _Optional[str] = ..., detail_json: _Optional[str] = ..., prev_sha256: _Optional[str] = ..., sha256: _Optional[str] = ...) -> None: ...

class ListAuditRequest(_message.Message):
    __slots__ = ("since_unix_ns", "after_seq", "limit")
    SINCE_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    since_unix_ns: int
    after_seq: int
    limit: int
    def __init__(self, since_unix_ns: _Optional[int] = ..., after_seq: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class ListAuditResponse(_message.Message):
    __slots__ = ("records",)
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[AuditRecord]
    def __init__(self, records: _Optional[_Iterable[_Union[AuditRecord, _Mapping]]] = ...) -> None: ...

class FaultHit(_message.Message):
    __slots__ = ("consumer", "k8s")
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    K8S_FIELD_NUMBER: _ClassVar[int]
    consumer: _stream_pb2.FaultConsumer
    k8s: K8sIdentity
    def __init__(self, consumer: _Optional[_Union[_stream_pb2.FaultConsumer, _Mapping]] = ..., k8s: _Optional[_Union[K8sIdentity, _Mapping]] = ...) -> None: ...

class ClusterFault(_message.Message):
    __slots__ = ("id", "node", "fault", "hits", "ts_unix_ns", "boot_id", "stored_unix_ns")
    ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    FAULT_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    TS_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    STORED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    id: int
    node: str
    fault: _stream_pb2.Fault
    hits: _containers.RepeatedCompositeFieldContainer[FaultHit]
    ts_unix_ns: int
    boot_id: str
    stored_unix_ns: int
    def __init__(self, id: _Optional[int] = ..., node: _Optional[str] = ..., fault: _Optional[_Union[_stream_pb2.Fault, _Mapping]] = ..., hits: _Optional[_Iterable[_Union[FaultHit, _Mapping]]] = ..., ts_unix_ns: _Optional[int] = ..., boot_id: _Optional[str] = ..., stored_unix_ns: _Optional[int] = ...) -> None: ...

class ListFaultsRequest(_message.Message):
    __slots__ = ("since_unix_ns", "node", "namespace", "limit")
    SINCE_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    since_unix_ns: int
    node: str
    namespace: str
    limit: int
    def __init__(self, since_unix_ns: _Optional[int] = ..., node: _Optional[str] = ..., namespace: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class ListFaultsResponse(_message.Message):
    __slots__ = ("faults", "left_out")
    FAULTS_FIELD_NUMBER: _ClassVar[int]
    LEFT_OUT_FIELD_NUMBER: _ClassVar[int]
    faults: _containers.RepeatedCompositeFieldContainer[ClusterFault]
    left_out: int
    def __init__(self, faults: _Optional[_Iterable[_Union[ClusterFault, _Mapping]]] = ..., left_out: _Optional[int] = ...) -> None: ...

class RemediateRequest(_message.Message):
    __slots__ = ("finding", "dry_run")
    FINDING_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    finding: int
    dry_run: bool
    def __init__(self, finding: _Optional[int] = ..., dry_run: _Optional[bool] = ...) -> None: ...

class RemediateResponse(_message.Message):
    __slots__ = ("remediation", "detail")
    REMEDIATION_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    remediation: Remediation
    detail: str
    def __init__(self, remediation: _Optional[_Union[Remediation, _Mapping]] = ..., detail: _Optional[str] = ...) -> None: ...

class RemediationControlRequest(_message.Message):
    __slots__ = ("verb", "mode", "reason")
    class Verb(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        VERB_UNSPECIFIED: _ClassVar[RemediationControlRequest.Verb]
        VERB_PAUSE: _ClassVar[RemediationControlRequest.Verb]
        VERB_RESUME: _ClassVar[RemediationControlRequest.Verb]
        VERB_SET_MODE: _ClassVar[RemediationControlRequest.Verb]
    VERB_UNSPECIFIED: RemediationControlRequest.Verb
    VERB_PAUSE: RemediationControlRequest.Verb
    VERB_RESUME: RemediationControlRequest.Verb
    VERB_SET_MODE: RemediationControlRequest.Verb
    VERB_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    verb: RemediationControlRequest.Verb
    mode: str
    reason: str
    def __init__(self, verb: _Optional[_Union[RemediationControlRequest.Verb, str]] = ..., mode: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class RemediationStatus(_message.Message):
    __slots__ = ("mode", "config_mode", "override_mode", "paused", "paused_by", "paused_unix_ns", "breaker_open", "breaker_reason", "actions_in_window", "max_actions", "isolated_nodes")
    MODE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_MODE_FIELD_NUMBER: _ClassVar[int]
    OVERRIDE_MODE_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    PAUSED_BY_FIELD_NUMBER: _ClassVar[int]
    PAUSED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    BREAKER_OPEN_FIELD_NUMBER: _ClassVar[int]
    BREAKER_REASON_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_IN_WINDOW_FIELD_NUMBER: _ClassVar[int]
    MAX_ACTIONS_FIELD_NUMBER: _ClassVar[int]
    ISOLATED_NODES_FIELD_NUMBER: _ClassVar[int]
    mode: str
    config_mode: str
    override_mode: str
    paused: bool
    paused_by: str
    paused_unix_ns: int
    breaker_open: bool
    breaker_reason: str
    actions_in_window: int
    max_actions: int
    isolated_nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, mode: _Optional[str] = ..., config_mode: _Optional[str] = ..., override_mode: _Optional[str] = ..., paused: _Optional[bool] = ..., paused_by: _Optional[str] = ..., paused_unix_ns: _Optional[int] = ..., breaker_open: _Optional[bool] = ..., breaker_reason: _Optional[str] = ..., actions_in_window: _Optional[int] = ..., max_actions: _Optional[int] = ..., isolated_nodes: _Optional[_Iterable[str]] = ...) -> None: ...
