"""Trace sessions on the node: the collector's start/update/stop commands, the tracer's own limits,
deadlines, and the thread that turns kernel trace records into TraceRecords and TraceBatches.

The tracer enforces every limit itself and ends a session at its deadline whether or not a
collector is there to hear it. One thread does all the work (drain the trace ring buffer, decode,
batch, expire); commands arrive on the stream's command threads and only change the table of
sessions under a lock. Records are made once here (kernel record -> decoded call -> TraceRecord ->
ghostgpu.v1.TraceRecord) and leave in batches through `emit`, which the stream sends after the
attribution events queued before them (tracer/stream.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ghostgpu.tracer.call_decode import DriverLayout, layout_for
from ghostgpu.tracer.cgroup import CgroupIdResolver, parse_proc_cgroup, unified_path
from ghostgpu.tracer.config import TracerConfig
from ghostgpu.tracer.events import boot_ns
from ghostgpu.tracer.procfs import parse_stat, read_bytes
from ghostgpu.tracer.trace_kernel import SLOTS, TraceKernel, slot_bits, unpack_trace
from ghostgpu.tracer.trace_records import RecordMaker

from ghostgpu.common.model.trace import TraceRecord
from ghostgpu.common.wire.convert_trace import record_into
from ghostgpu.v1 import stream_pb2, trace_pb2

log = logging.getLogger("ghostgpu.trace")

POLL_MS = 100  # the thread's wait for records; also how late a deadline can be noticed
FLUSH_S = 0.1  # a batch leaves at most this long after its first record
BATCH_RECORDS = 512  # ~200 KB a batch: far under the 8 MiB gRPC message limit (common/wire/protocol.py)
# Prefixes of a refusal the collector turns into a gRPC code (collector/trace_commands.py).
LIMIT_PREFIX = "limit: "  # over a configured limit: RESOURCE_EXHAUSTED
NOT_FOUND_PREFIX = "not found: "  # the pid or container is not on this node: NOT_FOUND
DENIED_PREFIX = "denied: "  # the pid is outside the caller's containers: PERMISSION_DENIED
GPU_FILTER_HEADROOM = 16  # a --gpu session's kernel budget, in multiples of its own limit
TK_EXEC, TK_EXIT = 7, 8  # bpf/trace.bpf.c GG_TK_*


def process_tree(proc_root: str, root: int) -> set[int]:
    """`root` and every live descendant (a --pid scope takes in what it already forked), from the
    parent field of /proc/PID/stat; empty when `root` does not exist. A process gone mid-walk is
    skipped."""
    children: dict[int, list[int]] = {}
    found = False
    with contextlib.suppress(OSError), os.scandir(proc_root) as it:
        for entry in it:
            if not entry.name.isdigit():
                continue
            data = read_bytes(f"{entry.path}/stat")
            stat = parse_stat(data.decode("utf-8", "replace")) if data is not None else None
            if stat is None:
                continue
            found = found or stat.pid == root
            children.setdefault(stat.ppid, []).append(stat.pid)
    if not found:
        return set()
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo.extend(children.get(pid, ()))
    return tree


@dataclass(frozen=True)
class NodeTraceLimits:
    """The tracer's own trace limits: a slice of TracerConfig (its trace_* settings)."""

    max_sessions: int  # --trace-max-sessions (at most SLOTS)
    max_duration_s: float  # --trace-max-duration
    max_records: int  # --trace-max-records, per session

    @classmethod
    def of(cls, cfg: TracerConfig) -> NodeTraceLimits:
        return cls(cfg.trace_max_sessions, cfg.trace_max_duration_s, cfg.trace_max_records)


@dataclass(frozen=True)
class _Scope:
    """What a start's scope is on this node: container cgroups, the process tree, and the cgroups a
    pid scope keeps to."""

    cgroup_ids: set[int] = field(default_factory=set)
    tgids: set[int] = field(default_factory=set)
    pins: set[int] = field(default_factory=set)


@dataclass
class _Session:
    id: str
    slot: int
    deadline_ns: int  # unix ns
    max_records: int
    gpu: str
    pid: int
    container_ids: frozenset[str] = frozenset()
    seq: int = 0
    transport_dropped: int = 0
    over_limit: int = 0  # past max_records in user space (--gpu sessions)
    pending: list[TraceRecord] = field(default_factory=list)
    first_pending_s: float = 0.0
    end_reason: str = ""  # set when it must end (stop command, deadline)


class TraceSessions:
    def __init__(self, kernel: TraceKernel, node: str, limits: NodeTraceLimits, maker: RecordMaker,
                 cgroups: CgroupIdResolver, emit: Callable[[stream_pb2.TracerMessage], bool],
                 driver_version: Callable[[], str | None]) -> None:
        self.kernel, self.node, self.limits, self.maker = kernel, node, limits, maker
        self.cgroups, self.emit, self.driver_version = cgroups, emit, driver_version
        self._lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}
        self._layout: DriverLayout | None = None
        self._next_slot = 0
        self._stopped: deque[str] = deque(maxlen=256)  # ids stopped (or ended) lately
        self._wake = threading.Event()
        self._idle = threading.Event()  # set while no session runs
        self._idle.set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ghostgpu-trace", daemon=True)
        self._thread.start()

    # --- commands (any thread) --------------------------------------------------------------------

    def handle(self, command: stream_pb2.Command) -> trace_pb2.TraceCommandResult:
        body = command.WhichOneof("body")
        try:
            if body == "trace_start":
                return self._start(command.trace_start)
            if body == "trace_update":
                return self._update(command.trace_update)
            if body == "trace_stop":
                return self._end(command.trace_stop.session, "stopped")
        except Exception as exc:  # one bad command never takes the tracer down
            log.exception("trace command failed")
            return trace_pb2.TraceCommandResult(error=f"tracer on {self.node}: {exc}")
        return trace_pb2.TraceCommandResult(error=f"tracer on {self.node}: unknown trace command")

    def _start(self, cmd: trace_pb2.TraceStart) -> trace_pb2.TraceCommandResult:
        result = trace_pb2.TraceCommandResult(session=cmd.session)
        result.error = self._refusal(cmd)
        if result.error:
            return result
        # What the scope is on this node, read before anything is written to the kernel.
        scope, result.error = self._scope(cmd)
        if result.error:
            return result
        with self._lock:
            if cmd.session in self._sessions:
                return result  # a retried command: already running
            if len(self._sessions) >= min(self.limits.max_sessions, SLOTS):
                result.error = (f"{LIMIT_PREFIX}node {self.node} runs {len(self._sessions)} trace sessions, "
                                f"the limit (--trace-max-sessions {self.limits.max_sessions})")
                return result
            slot = self._next_free_slot()
            max_records = min(cmd.max_records or self.limits.max_records, self.limits.max_records)
            session = _Session(cmd.session, slot, cmd.deadline_unix_ns, max_records, cmd.gpu, cmd.pid,
                               frozenset(cmd.container_ids))
            if self._layout is None or not self._sessions:  # the driver may have changed since
                self._read_layout()
            # --gpu filters in user space: the kernel's budget leaves room for the other GPUs' calls,
            # and the session's own limit is kept exactly here (_take).
            self._open_slot(slot, max_records * GPU_FILTER_HEADROOM if cmd.gpu else max_records, scope)
            self._sessions[cmd.session] = session
            self._idle.clear()
        # At warning level: sessions are rare, user-started, and belong in the DaemonSet's log.
        log.warning("trace session %s started (slot %d, %s, until %s)", cmd.session, slot,
                    f"pid {cmd.pid} and {len(scope.tgids) - 1} descendants" if cmd.pid else
                    f"{len(cmd.container_ids)} containers",
                    time.strftime("%H:%M:%S", time.localtime(cmd.deadline_unix_ns / 1e9)))
        self._wake.set()
        return result

    def _scope(self, cmd: trace_pb2.TraceStart) -> tuple[_Scope, str]:
        """(what the start's scope is on this node, "") or (_, why it cannot start: not found, denied)."""
        cgroup_ids = self._cgroup_ids(frozenset(cmd.container_ids)) if cmd.container_ids else set()
        if cmd.container_ids and not cgroup_ids:
            ids = ", ".join(c[:12] for c in cmd.container_ids)
            return _Scope(), (f"{NOT_FOUND_PREFIX}no cgroup of container {ids} on node {self.node} "
                              f"(cgroup v2 under {self.cgroups.root or 'nowhere'})")
        tgids = process_tree(self.maker.proc_root, cmd.pid) if cmd.pid else set()
        if cmd.pid and not tgids:
            return _Scope(), f"{NOT_FOUND_PREFIX}no process {cmd.pid} on node {self.node}"
        pins: set[int] = set()
        if cmd.pid:
            pins, error = self._pid_pins(cmd.pid, frozenset(cmd.pid_containers))
            if error:
                return _Scope(), error
        return _Scope(cgroup_ids, tgids, pins), ""

    def _next_free_slot(self) -> int:
        """Round robin, not the lowest free slot: a call in flight when a session ended (entered
        before, exits after) carries that slot's bit, and must not land in a new session. Under _lock."""
        used = {s.slot for s in self._sessions.values()}
        slot = next(i % SLOTS for i in range(self._next_slot, self._next_slot + SLOTS)
                    if i % SLOTS not in used)
        self._next_slot = slot + 1
        return slot

    def _read_layout(self) -> None:
        """The running driver's parameter-block layouts, for the kernel and the decoder."""
        self._layout = layout_for(self.driver_version())
        self.kernel.set_layouts(self._layout.kernel_layouts())
        self.maker.layout = self._layout
        self.maker.forget_all()  # pids seen by earlier sessions may have been reused

    def _open_slot(self, slot: int, kernel_max_records: int, scope: _Scope) -> None:
        """Write the session's slot and scope to the kernel, or nothing: never a slot left recording
        for nobody."""
        try:
            self.kernel.open_slot(slot, kernel_max_records)
            if scope.pins:  # before the tgids: no call of a descendant elsewhere is taken meanwhile
                self.kernel.pin(slot, scope.pins)
            for tgid in sorted(scope.tgids):
                self.kernel.add_tgid(slot, tgid)
            if scope.cgroup_ids:
                self.kernel.set_cgroups(slot, scope.cgroup_ids)
        except Exception:
            self.kernel.close_slot(slot)
            raise

    def _pid_pins(self, pid: int, allowed: frozenset[str]) -> tuple[set[int], str]:
        """(the cgroup ids a pid scope keeps to, "") or (_, the refusal). The scope keeps to the
        cgroups of the process's container (every cgroup of it), or to its own cgroup on the host:
        a descendant that joins another container leaves it (bpf/trace.bpf.c trace_pincg).
        `allowed` non-empty (a caller who is not admin): the process must be in one of these
        containers, and its cgroup must be known; else "denied: ..." (fail closed)."""
        text = read_bytes(f"{self.maker.proc_root}/{pid}/cgroup")
        content = text.decode("utf-8", "replace") if text is not None else ""
        ident = parse_proc_cgroup(content)
        path = unified_path(content)
        pins: set[int] = set()
        if ident.container_id:
            pins = self.cgroups.ids_of_containers([ident.container_id])
        elif path and self.cgroups.root:
            with contextlib.suppress(OSError):
                pins = {os.stat(os.path.join(self.cgroups.root, path.lstrip("/"))).st_ino}
        if allowed:
            where = f"container {ident.container_id[:12]}" if ident.container_id else (
                f"cgroup {path or 'unknown'}, no container")
            if ident.container_id not in allowed or not ident.container_id:
                return pins, (f"{DENIED_PREFIX}pid {pid} on node {self.node} is not in a container of the "
                              f"caller's namespaces (it is in {where})")
            if not pins:
                return pins, (f"{DENIED_PREFIX}pid {pid} on node {self.node}: the cgroups of its container "
                              f"{ident.container_id[:12]} cannot be read (cgroup v2 under "
                              f"{self.cgroups.root or 'nowhere'}), so its scope cannot be kept to it")
        elif not pins:
            log.warning("trace: the cgroup of pid %d is unknown: its scope follows its descendants anywhere",
                        pid)
        return pins, ""

    def _refusal(self, cmd: trace_pb2.TraceStart) -> str:
        left_s = (cmd.deadline_unix_ns - time.time_ns()) / 1e9
        if left_s > self.limits.max_duration_s + 5:  # 5 s: clock skew between collector and node
            return (f"{LIMIT_PREFIX}duration {left_s:.0f} s exceeds node {self.node}'s maximum of "
                    f"{self.limits.max_duration_s:g} s (--trace-max-duration)")
        if not cmd.container_ids and not cmd.pid:
            return f"tracer on {self.node}: a session needs container ids or a pid"
        with self._lock:
            if cmd.session in self._stopped:  # a start that arrived after its own stop
                return f"tracer on {self.node}: trace session {cmd.session} was already stopped"
        return ""

    def _update(self, cmd: trace_pb2.TraceUpdate) -> trace_pb2.TraceCommandResult:
        with self._lock:
            session = self._sessions.get(cmd.session)
            if session is None:
                return trace_pb2.TraceCommandResult(session=cmd.session,
                                                    error=f"no trace session {cmd.session} on {self.node}")
            session.container_ids = frozenset(cmd.container_ids)
            self.kernel.set_cgroups(session.slot, self._cgroup_ids(session.container_ids))
        return trace_pb2.TraceCommandResult(session=cmd.session)

    def _end(self, session_id: str, reason: str) -> trace_pb2.TraceCommandResult:
        with self._lock:
            self._stopped.append(session_id)
            session = self._sessions.get(session_id)
            if session is not None and not session.end_reason:
                session.end_reason = reason
        self._wake.set()
        return trace_pb2.TraceCommandResult(session=session_id)

    def end_all(self, reason: str) -> None:
        """End every session (the stream to the collector was replaced: it ended them as node lost)."""
        with self._lock:
            for session in self._sessions.values():
                session.end_reason = session.end_reason or reason
        self._wake.set()

    def _cgroup_ids(self, container_ids: frozenset[str]) -> set[int]:
        """The cgroup v2 ids of these containers (each container's directory and any below it)."""
        return self.cgroups.ids_of_containers(container_ids)

    def active(self) -> int:
        with self._lock:
            return len(self._sessions)

    # --- the session thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._step()
            except Exception:  # contained: the next step tries again
                log.exception("trace session step failed")
                self._stop.wait(POLL_MS / 1000)

    def _step(self) -> None:
        with self._lock:
            idle = not self._sessions
        if idle:
            self._wake.wait(1.0)
            self._wake.clear()
            return
        self._take(self.kernel.poll(POLL_MS))
        now_ns, now_s = time.time_ns(), time.monotonic()
        with self._lock:
            sessions = list(self._sessions.values())
        for session in sessions:
            if not session.end_reason and now_ns >= session.deadline_ns:
                session.end_reason = "deadline"
            if session.end_reason:
                self._finish(session)
            elif session.pending and (len(session.pending) >= BATCH_RECORDS
                                      or now_s - session.first_pending_s >= FLUSH_S):
                self._flush(session)

    def _take(self, raws: list[bytes]) -> None:
        if not raws:
            return
        offset_ns = time.time_ns() - boot_ns()  # CLOCK_BOOTTIME -> unix time, read once per batch
        with self._lock:
            by_slot = {s.slot: s for s in self._sessions.values()}
        now_s = time.monotonic()
        for data in raws:
            raw = unpack_trace(data)
            if raw is None:
                continue
            for slot in slot_bits(raw.slots):
                session = by_slot.get(slot)
                if session is None:
                    continue
                record = self.maker.make(raw, session.id, session.seq + 1, offset_ns, session.gpu)
                if record is None:  # filtered out (--gpu)
                    continue
                if session.seq >= session.max_records:
                    session.over_limit += 1  # only with --gpu: the kernel's budget is larger
                    continue
                session.seq += 1
                if not session.pending:
                    session.first_pending_s = now_s
                session.pending.append(record)
                if len(session.pending) >= BATCH_RECORDS:  # one poll can hold ~100k: keep messages small
                    self._flush(session)
            if raw.kind in (TK_EXEC, TK_EXIT):  # the pid's cached identity is stale from now on
                self.maker.forget(raw.tgid)

    def _flush(self, session: _Session, ended: bool = False) -> None:
        records, session.pending = session.pending, []
        _records, over_limit, drops = self.kernel.slot_counts(session.slot)
        batch = trace_pb2.TraceBatch(
            session=session.id, records_total=session.seq,
            dropped_limit_total=over_limit + session.over_limit,
            dropped_ringbuf_total=drops, dropped_transport_total=session.transport_dropped, ended=ended,
            end_reason=session.end_reason if ended else "")
        for record in records:
            record_into(batch.records.add(), record)
        if not self.emit(stream_pb2.TracerMessage(trace=batch)):
            session.transport_dropped += len(records)

    def _finish(self, session: _Session) -> None:
        """Close the slot, take what the ring buffer still holds for it, send the last batch."""
        self.kernel.close_slot(session.slot)
        self._take(self.kernel.poll(0))
        self._flush(session, ended=True)
        with self._lock:
            self._sessions.pop(session.id, None)
            self._stopped.append(session.id)
            if not self._sessions:
                self._idle.set()
        log.warning("trace session %s ended (%s): %d records", session.id, session.end_reason, session.seq)

    def close(self) -> None:
        """End every session now (the tracer is stopping) and stop the thread."""
        with self._lock:
            for session in self._sessions.values():
                session.end_reason = session.end_reason or "tracer stopped"
        self._wake.set()
        self._idle.wait(2.0)  # the thread finishes each one (last batch) within a step
        self._stop.set()
        self._wake.set()
        self._thread.join(2.0)
