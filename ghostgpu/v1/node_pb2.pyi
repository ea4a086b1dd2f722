from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ConsumerClass(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONSUMER_CLASS_UNSPECIFIED: _ClassVar[ConsumerClass]
    CONSUMER_CLASS_VISIBLE: _ClassVar[ConsumerClass]
    CONSUMER_CLASS_HIDDEN: _ClassVar[ConsumerClass]
    CONSUMER_CLASS_GHOST: _ClassVar[ConsumerClass]
    CONSUMER_CLASS_ORPHANED: _ClassVar[ConsumerClass]
    CONSUMER_CLASS_UNALLOCATED: _ClassVar[ConsumerClass]
    CONSUMER_CLASS_UNATTRIBUTED: _ClassVar[ConsumerClass]
    CONSUMER_CLASS_SYSTEM: _ClassVar[ConsumerClass]
    CONSUMER_CLASS_PENDING: _ClassVar[ConsumerClass]
    CONSUMER_CLASS_UNKNOWN: _ClassVar[ConsumerClass]
    CONSUMER_CLASS_MONITOR: _ClassVar[ConsumerClass]
CONSUMER_CLASS_UNSPECIFIED: ConsumerClass
CONSUMER_CLASS_VISIBLE: ConsumerClass
CONSUMER_CLASS_HIDDEN: ConsumerClass
CONSUMER_CLASS_GHOST: ConsumerClass
CONSUMER_CLASS_ORPHANED: ConsumerClass
CONSUMER_CLASS_UNALLOCATED: ConsumerClass
CONSUMER_CLASS_UNATTRIBUTED: ConsumerClass
CONSUMER_CLASS_SYSTEM: ConsumerClass
CONSUMER_CLASS_PENDING: ConsumerClass
CONSUMER_CLASS_UNKNOWN: ConsumerClass
CONSUMER_CLASS_MONITOR: ConsumerClass

class Process(_message.Message):
    __slots__ = ("pid", "ns_pid", "comm", "exe", "cmdline", "uid", "ppid", "start_time_ns", "state", "container_id", "pod_uid", "runtime", "cgroup_path", "alive")
    PID_FIELD_NUMBER: _ClassVar[int]
    NS_PID_FIELD_NUMBER: _ClassVar[int]
    COMM_FIELD_NUMBER: _ClassVar[int]
    EXE_FIELD_NUMBER: _ClassVar[int]
    CMDLINE_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    PPID_FIELD_NUMBER: _ClassVar[int]
    START_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    POD_UID_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    CGROUP_PATH_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    pid: int
    ns_pid: int
    comm: str
    exe: str
    cmdline: str
    uid: int
    ppid: int
    start_time_ns: int
    state: str
    container_id: str
    pod_uid: str
    runtime: str
    cgroup_path: str
    alive: bool
    def __init__(self, pid: _Optional[int] = ..., ns_pid: _Optional[int] = ..., comm: _Optional[str] = ..., exe: _Optional[str] = ..., cmdline: _Optional[str] = ..., uid: _Optional[int] = ..., ppid: _Optional[int] = ..., start_time_ns: _Optional[int] = ..., state: _Optional[str] = ..., container_id: _Optional[str] = ..., pod_uid: _Optional[str] = ..., runtime: _Optional[str] = ..., cgroup_path: _Optional[str] = ..., alive: _Optional[bool] = ...) -> None: ...

class Consumer(_message.Message):
    __slots__ = ("node", "process", "gpu", "gpu_uuid", "gpu_minor", "devices", "reason", "gpu_memory_bytes", "first_seen_ns", "mapped", "fds", "allowlisted", "system_places", "allocated_bytes", "allocated_reason")
    NODE_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    GPU_MINOR_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    CLASS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEEN_NS_FIELD_NUMBER: _ClassVar[int]
    MAPPED_FIELD_NUMBER: _ClassVar[int]
    FDS_FIELD_NUMBER: _ClassVar[int]
    ALLOWLISTED_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_PLACES_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_REASON_FIELD_NUMBER: _ClassVar[int]
    node: str
    process: Process
    gpu: int
    gpu_uuid: str
    gpu_minor: int
    devices: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    gpu_memory_bytes: int
    first_seen_ns: int
    mapped: bool
    fds: _containers.RepeatedScalarFieldContainer[int]
    allowlisted: str
    system_places: _containers.RepeatedScalarFieldContainer[str]
    allocated_bytes: int
    allocated_reason: str
    def __init__(self, node: _Optional[str] = ..., process: _Optional[_Union[Process, _Mapping]] = ..., gpu: _Optional[int] = ..., gpu_uuid: _Optional[str] = ..., gpu_minor: _Optional[int] = ..., devices: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ..., gpu_memory_bytes: _Optional[int] = ..., first_seen_ns: _Optional[int] = ..., mapped: _Optional[bool] = ..., fds: _Optional[_Iterable[int]] = ..., allowlisted: _Optional[str] = ..., system_places: _Optional[_Iterable[str]] = ..., allocated_bytes: _Optional[int] = ..., allocated_reason: _Optional[str] = ..., **kwargs) -> None: ...

class HolderEvent(_message.Message):
    __slots__ = ("kind", "source", "ts_ns", "process", "device", "fd", "cgroup_id", "child_pid", "mapped", "ioctls", "tid", "gpu", "gpu_uuid", "device_kind", "devices", "held_ns", "ioctls_counted")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[HolderEvent.Kind]
        KIND_OPEN: _ClassVar[HolderEvent.Kind]
        KIND_CLOSE: _ClassVar[HolderEvent.Kind]
        KIND_MMAP: _ClassVar[HolderEvent.Kind]
        KIND_UNMAP: _ClassVar[HolderEvent.Kind]
        KIND_FORK: _ClassVar[HolderEvent.Kind]
        KIND_EXEC: _ClassVar[HolderEvent.Kind]
        KIND_EXIT: _ClassVar[HolderEvent.Kind]
    KIND_UNSPECIFIED: HolderEvent.Kind
    KIND_OPEN: HolderEvent.Kind
    KIND_CLOSE: HolderEvent.Kind
    KIND_MMAP: HolderEvent.Kind
    KIND_UNMAP: HolderEvent.Kind
    KIND_FORK: HolderEvent.Kind
    KIND_EXEC: HolderEvent.Kind
    KIND_EXIT: HolderEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TS_NS_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    CGROUP_ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_PID_FIELD_NUMBER: _ClassVar[int]
    MAPPED_FIELD_NUMBER: _ClassVar[int]
    IOCTLS_FIELD_NUMBER: _ClassVar[int]
    TID_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    HELD_NS_FIELD_NUMBER: _ClassVar[int]
    IOCTLS_COUNTED_FIELD_NUMBER: _ClassVar[int]
    kind: HolderEvent.Kind
    source: str
    ts_ns: int
    process: Process
    device: str
    fd: int
    cgroup_id: int
    child_pid: int
    mapped: bool
    ioctls: _containers.RepeatedCompositeFieldContainer[IoctlCount]
    tid: int
    gpu: int
    gpu_uuid: str
    device_kind: str
    devices: _containers.RepeatedScalarFieldContainer[str]
    held_ns: int
    ioctls_counted: bool
    def __init__(self, kind: _Optional[_Union[HolderEvent.Kind, str]] = ..., source: _Optional[str] = ..., ts_ns: _Optional[int] = ..., process: _Optional[_Union[Process, _Mapping]] = ..., device: _Optional[str] = ..., fd: _Optional[int] = ..., cgroup_id: _Optional[int] = ..., child_pid: _Optional[int] = ..., mapped: _Optional[bool] = ..., ioctls: _Optional[_Iterable[_Union[IoctlCount, _Mapping]]] = ..., tid: _Optional[int] = ..., gpu: _Optional[int] = ..., gpu_uuid: _Optional[str] = ..., device_kind: _Optional[str] = ..., devices: _Optional[_Iterable[str]] = ..., held_ns: _Optional[int] = ..., ioctls_counted: _Optional[bool] = ...) -> None: ...

class IoctlCount(_message.Message):
    __slots__ = ("device", "cmd", "name", "count")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CMD_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    device: str
    cmd: int
    name: str
    count: int
    def __init__(self, device: _Optional[str] = ..., cmd: _Optional[int] = ..., name: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...
