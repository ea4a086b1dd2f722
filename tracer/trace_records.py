"""Kernel trace records (tracer/trace_kernel.RawTrace) -> TraceRecords: who made the call, on which
device and GPU, and what the call was (tracer/call_decode.py for ioctls).

Identities are read once per process from /proc (NSpid and comm of /proc/PID/status) and once per
cgroup (the container id, from the cgroup path): a session records thousands of calls of a few
processes. A process gone before its first record was read keeps what the kernel said (pid, tid,
cgroup id). Flag names come from Python's os and mmap modules: the values of the running ABI.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from typing import TypedDict

from ghostgpu.tracer.call_decode import DecodedCall, DriverLayout, IoctlCapture, decode_call, layout_for
from ghostgpu.tracer.cgroup import CgroupIdResolver
from ghostgpu.tracer.procfs import parse_status, read_bytes
from ghostgpu.tracer.trace_kernel import TF_STATUS, TF_XFER, TRACE_KINDS, RawTrace

from ghostgpu.common.model.consumers import DeviceKind, DeviceRef
from ghostgpu.common.model.trace import TraceRecord

_OPEN_FLAGS = [(getattr(os, n), n) for n in ("O_CREAT", "O_EXCL", "O_NOCTTY", "O_TRUNC", "O_APPEND",
                                             "O_NONBLOCK", "O_DSYNC", "O_DIRECT", "O_LARGEFILE",
                                             "O_DIRECTORY", "O_NOFOLLOW", "O_NOATIME", "O_CLOEXEC", "O_PATH")
               if hasattr(os, n)]
_PROT = [(mmap.PROT_READ, "PROT_READ"), (mmap.PROT_WRITE, "PROT_WRITE"), (mmap.PROT_EXEC, "PROT_EXEC")]
_MAP = [(getattr(mmap, n), n) for n in ("MAP_SHARED", "MAP_PRIVATE", "MAP_FIXED", "MAP_ANONYMOUS",
                                        "MAP_POPULATE", "MAP_NORESERVE", "MAP_LOCKED") if hasattr(mmap, n)]
_CACHE_MAX = 4096  # identities kept; a session of a pod sees a few dozen processes


def open_flags(flags: int) -> str:
    """O_RDWR|O_CLOEXEC, as strace writes them."""
    acc = {os.O_RDONLY: "O_RDONLY", os.O_WRONLY: "O_WRONLY", os.O_RDWR: "O_RDWR"}.get(flags & os.O_ACCMODE,
                                                                                     hex(flags & 3))
    return "|".join([acc, *(name for bit, name in _OPEN_FLAGS if flags & bit and bit & ~os.O_ACCMODE)])


def bit_names(value: int, names: list[tuple[int, str]], none: str) -> str:
    parts = [name for bit, name in names if bit and value & bit == bit]
    rest = value & ~sum(bit for bit, _ in names if value & bit == bit)
    if rest:
        parts.append(hex(rest))
    return "|".join(parts) or none


def read_identity(proc_root: str, pid: int) -> tuple[int | None, str]:
    """(the PID inside the process's own namespace, comm) from /proc/PID/status; (None, "") if gone."""
    data = read_bytes(f"{proc_root}/{pid}/status")
    status = parse_status(data.decode("utf-8", "replace")) if data is not None else None
    return (status.ns_pid, status.name) if status is not None else (None, "")


class _Common(TypedDict):
    """The TraceRecord fields every kind of record fills the same way."""

    session: str
    node: str
    seq: int
    ts_ns: int
    kind: str
    pid: int
    tid: int
    ns_pid: int | None
    comm: str
    container_id: str
    gpu: str
    device: str
    ret: int
    duration_ns: int


class RecordMaker:
    def __init__(self, node: str, proc_root: str, cgroups: CgroupIdResolver,
                 device_ref: Callable[[str], DeviceRef], dev_paths: Callable[[], dict[int, str]],
                 gpu_names: Callable[[int], tuple[str, str]],
                 known_identity: Callable[[int], tuple[int | None, str] | None] = lambda pid: None) -> None:
        self.node, self.proc_root, self.cgroups = node, proc_root, cgroups
        # What the agent read when the process opened its device: a 20 ms job is often gone by the
        # time its first trace record is read here.
        self.known_identity = known_identity
        self.device_ref, self.dev_paths, self.gpu_names = device_ref, dev_paths, gpu_names
        self._layout: DriverLayout = layout_for(None)  # the session manager sets the running driver's
        self._paths: dict[int, str] = {}
        self._who: dict[int, tuple[int | None, str]] = {}
        self._containers: dict[int, str] = {}
        self._decoded: dict[tuple[object, ...], DecodedCall] = {}  # of self.layout: cleared when it changes

    @property
    def layout(self) -> DriverLayout:
        return self._layout

    @layout.setter
    def layout(self, layout: DriverLayout) -> None:
        if layout != self._layout:
            self._decoded.clear()
        self._layout = layout

    def forget_all(self) -> None:
        self._who.clear()
        self._containers.clear()

    def forget(self, pid: int) -> None:
        self._who.pop(pid, None)

    def _identity(self, pid: int) -> tuple[int | None, str]:
        who = self._who.get(pid)
        if who is None:
            if len(self._who) >= _CACHE_MAX:
                self._who.clear()
            who = read_identity(self.proc_root, pid)
            if who == (None, ""):
                who = self.known_identity(pid) or who
            self._who[pid] = who
        return who

    def _container(self, cgroup_id: int) -> str:
        cid = self._containers.get(cgroup_id)
        if cid is None:
            ident = self.cgroups.identity_for(cgroup_id)
            if len(self._containers) >= _CACHE_MAX:
                self._containers.clear()
            cid = self._containers[cgroup_id] = ident.container_id if ident is not None else ""
        return cid

    def _device(self, dev_id: int) -> DeviceRef | None:
        if not dev_id:
            return None
        path = self._paths.get(dev_id)
        if path is None:
            self._paths = self.dev_paths()
            path = self._paths.get(dev_id)
        return self.device_ref(path) if path is not None else None

    def make(self, raw: RawTrace, session: str, seq: int, offset_ns: int, gpu_filter: str = "",
             ) -> TraceRecord | None:
        """The record for one session, or None when the session's --gpu filter leaves it out."""
        device = self._device(raw.dev_id)
        gpu = ""
        if device is not None and device.gpu_minor is not None:
            index, uuid = self.gpu_names(device.gpu_minor)
            gpu = index
            per_gpu = device.kind in (DeviceKind.GPU, DeviceKind.MIG)
            if gpu_filter and per_gpu and gpu_filter not in (index, uuid):
                return None
        ns_pid, comm = self._identity(raw.tgid)
        kind = TRACE_KINDS.get(raw.kind, f"kind{raw.kind}")
        base = _Common(session=session, node=self.node, seq=seq, ts_ns=raw.ts_ns + offset_ns, kind=kind,
                       pid=raw.tgid, tid=raw.tid, ns_pid=ns_pid, comm=comm,
                       container_id=self._container(raw.cgroup_id), gpu=gpu,
                       device=device.path if device is not None else "", ret=raw.ret, duration_ns=raw.dur_ns)
        if kind == "ioctl":
            return self._ioctl(raw, base, device)
        fd = raw.fd if raw.fd >= 0 else None
        args: dict[str, str] = {}
        child = None
        if kind == "open":
            args = {"path": base["device"], "flags": open_flags(raw.a0)}
        elif kind == "mmap":
            args = {"length": str(raw.a0), "prot": bit_names(raw.a1 >> 32, _PROT, "PROT_NONE"),
                    "flags": bit_names(raw.a1 & 0xFFFFFFFF, _MAP, "0"), "offset": hex(raw.a2)}
            if not -4095 <= raw.ret < 0:
                args["addr"] = hex(raw.ret & 0xFFFFFFFFFFFFFFFF)
        elif kind == "munmap":
            args = {"addr": hex(raw.a0), "length": str(raw.a1)}
        elif kind == "fork":
            child = raw.a2
        return TraceRecord(**base, call=kind, fd=fd, args=args, child_pid=child)

    def _ioctl(self, raw: RawTrace, base: _Common, device: DeviceRef | None) -> TraceRecord:
        xfer = bool(raw.flags & TF_XFER)
        kind = str(device.kind) if device is not None else "other"
        status = raw.status if raw.flags & TF_STATUS else None
        block = raw.block_bytes
        # A process repeats the same calls (a training loop's controls): decode each distinct one once.
        key = (raw.request, kind, block, status, raw.ret, raw.xfer_nr if xfer else None,
               raw.xfer_size if xfer else None)
        call = self._decoded.get(key)
        if call is None:
            cap = IoctlCapture(request=raw.request, device_kind=kind, block=block, status=status, ret=raw.ret,
                               xfer_nr=key[5], xfer_size=key[6])
            call = decode_call(cap, self._layout)
            if len(self._decoded) >= _CACHE_MAX:
                self._decoded.clear()
            self._decoded[key] = call
        return TraceRecord(**base, fd=raw.fd, call=call.call, request=raw.request, escape=call.escape,
                           cmd=call.cmd, cmd_name=call.cmd_name, h_class=call.h_class,
                           class_name=call.class_name, nv_status=call.nv_status,
                           nv_status_name=call.nv_status_name, args=dict(call.args), notes=tuple(call.notes))
