"""The node's holder table: host PID -> who it is and how it holds each GPU device file.

Fed by events (BPF and procfs speak the same SourceEvent) and corrected by full /proc scans.
It never reads /proc or the kernel itself: identity arrives through the `identify` callable and
process existence through `exists`, so the whole table is testable with plain data.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from ghostgpu.tracer.events import DeviceHold, EventKind, Holder, ProcessInfo, ProcView, SourceEvent

log = logging.getLogger(__name__)

Identify = Callable[[int, int], ProcessInfo | None]

CHANGE_KINDS = ("holder_added", "holder_removed", "device_added", "device_removed", "device_updated")
# Bound on the "touched after the scan started" memory when no scan prunes it (procfs source off).
_TOUCHED_MAX = 65536
_K = TypeVar("_K")


@dataclass
class Change:
    """One change of the table for the sinks.

    `holder` is a snapshot: after the change for *_added/device_updated, the last state before
    the change for *_removed. A new holder gives holder_added then device_added per device; a
    holder that goes gives device_removed per device then holder_removed.
    """

    kind: str
    pid: int
    holder: Holder
    device_path: str | None = None


def copy_holder(holder: Holder) -> Holder:
    """A copy the classifier and sinks may keep while the table moves on."""
    holds = {
        path: replace(hold, fds=set(hold.fds)) for path, hold in holder.holds.items()
    }
    return Holder(process=replace(holder.process), holds=holds, ioctl_counts=dict(holder.ioctl_counts),
                  gpu_work=holder.gpu_work, memory=holder.memory)


def _proc_exists(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


@dataclass
class _Reconciling:
    """One reconcile under way: when its scan began, and what it applied so far."""

    ts_ns: int
    events: list[SourceEvent]
    changes: list[Change]


class HolderTable:
    def __init__(self, identify: Identify, exists: Callable[[int], bool] | None = None) -> None:
        self.holders: dict[int, Holder] = {}
        self._identify = identify
        self._exists = exists or _proc_exists
        # An identity read while checking for PID reuse, handed to the holder that replaces the old one.
        self._fresh: dict[int, ProcessInfo] = {}
        # When an event last touched (pid, path) / when a pid exited: a scan that started before
        # that saw an older truth and must not undo the event.
        self._touched_ns: dict[tuple[int, str], int] = {}
        self._exited_ns: dict[int, int] = {}

    # --- identity -------------------------------------------------------------------------

    def _who(self, pid: int, cgroup_id: int) -> ProcessInfo | None:
        try:
            return self._identify(pid, cgroup_id)
        except (OSError, ValueError) as exc:  # a process that exits mid-read is normal
            log.debug("identify(%d) failed: %s", pid, exc)
            return None

    def _still_there(self, pid: int) -> bool:
        try:
            return self._exists(pid)
        except OSError:
            return False

    def _new_holder(self, pid: int, cgroup_id: int) -> Holder:
        info = self._fresh.pop(pid, None) or self._who(pid, cgroup_id)
        # No identity at all: the process went before anything could be read; keep the hold anyway.
        return Holder(process=info if info is not None else ProcessInfo(pid=pid, alive=False))

    def _check_reuse(self, pid: int, cgroup_id: int) -> list[Change]:
        """Re-identify a holder; finish it if its PID now belongs to another process."""
        holder = self.holders.get(pid)
        if holder is None:
            return []
        fresh = self._who(pid, cgroup_id)
        if fresh is None:
            return []
        old_ticks = holder.process.start_ticks
        if old_ticks is not None and fresh.start_ticks is not None and fresh.start_ticks != old_ticks:
            self._fresh[pid] = fresh
            return self._finish(pid)
        if fresh.alive:  # an identity from the cgroup id alone is poorer than what we have
            holder.process = fresh
        return []

    def refresh(self, pid: int) -> bool:
        """Re-read a holder's identity after it renamed itself; False when it is not a holder or
        its PID now names another process (the next event or scan settles that, as for any reuse)."""
        holder = self.holders.get(pid)
        fresh = self._who(pid, 0) if holder is not None else None
        if holder is None or fresh is None or not fresh.alive:
            return False
        old_ticks = holder.process.start_ticks
        if old_ticks is not None and fresh.start_ticks is not None and fresh.start_ticks != old_ticks:
            return False
        holder.process = fresh
        return True

    # --- events ---------------------------------------------------------------------------

    def apply(self, event: SourceEvent) -> list[Change]:
        """Apply one event; return what changed. Repeats and events for non-holders are no-ops."""
        return self._apply(event, check_reuse=True)

    def _apply(self, ev: SourceEvent, check_reuse: bool, fds: set[int] | None = None) -> list[Change]:
        changes: list[Change] = []
        try:
            # Only events that may start or re-read a holder pay for an identity read: a CLOSE or
            # EXIT is always of the cached process (the BPF side drops a tgid's fds at its exit).
            if check_reuse and ev.kind in (EventKind.OPEN, EventKind.MMAP, EventKind.EXEC, EventKind.FORK):
                changes += self._check_reuse(ev.pid, ev.cgroup_id)
            if ev.kind in (EventKind.OPEN, EventKind.MMAP):
                changes += self._hold(ev, fds)
            elif ev.kind in (EventKind.CLOSE, EventKind.UNMAP):
                changes += self._release(ev)
            elif ev.kind is EventKind.FORK:
                changes += self._fork(ev)
            elif ev.kind is EventKind.EXIT and ev.pid in self.holders:
                self._exited_ns[ev.pid] = ev.ts_ns
                changes += self._finish(ev.pid)
        finally:
            self._fresh.clear()
        if len(self._touched_ns) + len(self._exited_ns) > _TOUCHED_MAX:
            self._trim()
        return changes

    def _hold(self, ev: SourceEvent, fds: set[int] | None) -> list[Change]:
        if ev.device is None:
            return []
        path = ev.device.path
        self._touched_ns[(ev.pid, path)] = ev.ts_ns
        new_fds = set(fds) if fds is not None else ({ev.fd} if ev.fd >= 0 else set())
        mapped = ev.kind is EventKind.MMAP
        changes: list[Change] = []
        holder = self.holders.get(ev.pid)
        if holder is None:
            holder = self._new_holder(ev.pid, ev.cgroup_id)
            self.holders[ev.pid] = holder
            changes.append(Change("holder_added", ev.pid, holder, path))
        hold = holder.holds.get(path)
        if hold is None:
            holder.holds[path] = DeviceHold(ev.device, new_fds, mapped, ev.ts_ns, ev.source)
            changes.append(Change("device_added", ev.pid, holder, path))
        elif not new_fds <= hold.fds or (mapped and not hold.mapped):
            hold.fds |= new_fds
            hold.mapped = hold.mapped or mapped
            changes.append(Change("device_updated", ev.pid, holder, path))
        return self._snap(changes)

    def _release(self, ev: SourceEvent) -> list[Change]:
        holder = self.holders.get(ev.pid)
        if holder is None or ev.device is None or ev.device.path not in holder.holds:
            return []
        path = ev.device.path
        self._touched_ns[(ev.pid, path)] = ev.ts_ns
        hold = holder.holds[path]
        if ev.kind is EventKind.CLOSE:
            keep = ev.mapped  # the last fd is gone; a mapping may still pin the device
            if keep and (hold.fds or not hold.mapped):
                hold.fds, hold.mapped = set(), True
                return self._snap([Change("device_updated", ev.pid, holder, path)])
        else:  # UNMAP: the mapping went; open fds still hold it
            keep = bool(hold.fds)
            if keep and hold.mapped:
                hold.mapped = False
                return self._snap([Change("device_updated", ev.pid, holder, path)])
        if keep:
            return []
        last = copy_holder(holder)
        del holder.holds[path]
        changes = [Change("device_removed", ev.pid, last, path)]
        if not holder.holds:
            del self.holders[ev.pid]
            changes.append(Change("holder_removed", ev.pid, last, path))
        return changes

    def _fork(self, ev: SourceEvent) -> list[Change]:
        parent = self.holders.get(ev.pid)
        child_pid = ev.child_pid
        if parent is None or child_pid <= 0 or child_pid == ev.pid:
            return []
        inherited = {path: hold for path, hold in parent.holds.items() if hold.held}
        if not inherited:
            return []
        # A holder already under the child's PID is a dead process whose exit we missed.
        changes = self._finish(child_pid) if child_pid in self.holders else []
        child = self._new_holder(child_pid, ev.cgroup_id)
        for path, hold in inherited.items():
            child.holds[path] = DeviceHold(hold.device, set(hold.fds), hold.mapped, ev.ts_ns, ev.source)
            self._touched_ns[(child_pid, path)] = ev.ts_ns
        self.holders[child_pid] = child
        snap = copy_holder(child)
        changes.append(Change("holder_added", child_pid, snap))
        changes += [Change("device_added", child_pid, snap, path) for path in sorted(child.holds)]
        return changes

    def _finish(self, pid: int) -> list[Change]:
        holder = self.holders.pop(pid)
        last = copy_holder(holder)
        changes = [Change("device_removed", pid, last, path) for path in sorted(holder.holds)]
        changes.append(Change("holder_removed", pid, last))
        return changes

    @staticmethod
    def _snap(changes: list[Change]) -> list[Change]:
        """Freeze the changes of one event, all about one live holder, onto one shared copy."""
        if not changes:
            return changes
        snap = copy_holder(changes[0].holder)
        return [replace(c, holder=snap) for c in changes]

    # --- scans ----------------------------------------------------------------------------

    def reconcile(
        self,
        view: ProcView,
        ts_ns: int,
        scanned_pids: set[int] | None = None,
        changes: list[Change] | None = None,
        exit_reported: set[int] | None = None,
        keep_since_ns: int | None = None,
    ) -> list[SourceEvent]:
        """Bring the table in line with a /proc scan that started at ts_ns; return the events applied.

        With scanned_pids, only those PIDs (and the ones in view) were scanned. Holds an event
        touched at or after ts_ns are left alone: the event is newer than what the scan read.
        Table changes are appended to `changes` when given. A pid in exit_reported that is gone
        is left as it is: the kernel reports its EXIT, with the exact time (the caller waits for it).
        keep_since_ns: the start of a scan still in progress around this one (a FORK/EXEC rescan
        run while that scan applied the kernel's events): the marks it needs are kept.
        """
        rec = _Reconciling(ts_ns, [], changes if changes is not None else [])
        for pid in sorted(view):
            if self._exited_ns.get(pid, -1) < ts_ns:  # else an EXIT newer than the scan said it all
                self._reconcile_seen(pid, view[pid], rec)
        scope = set(self.holders) if scanned_pids is None else set(scanned_pids)
        for pid in sorted(scope - set(view)):
            self._reconcile_unseen(pid, rec, exit_reported)
        self._prune(ts_ns if keep_since_ns is None else min(ts_ns, keep_since_ns))
        return rec.events

    def _reconcile_seen(self, pid: int, found_holds: dict[str, DeviceHold], rec: _Reconciling) -> None:
        """A process the scan read: its PID reused, then each device it holds, then what it closed."""
        seen = {path: hold for path, hold in found_holds.items() if hold.held}
        if pid in self.holders:
            reused = self._check_reuse(pid, 0)
            if reused:
                rec.changes.extend(reused)
                rec.events.append(SourceEvent(EventKind.EXIT, "procfs", rec.ts_ns, pid))
        for path, found in sorted(seen.items()):
            if self._touched_ns.get((pid, path), -1) < rec.ts_ns:  # else an event newer than the scan
                self._reconcile_hold(pid, path, found, rec)
        held = self.holders.get(pid)
        holds = held.holds if held is not None else {}
        for path in sorted(holds):
            if path not in seen and self._stale(pid, path, rec.ts_ns):
                self._apply_scanned(rec, SourceEvent(EventKind.CLOSE, "procfs", rec.ts_ns, pid,
                                                     device=holds[path].device))

    def _reconcile_hold(self, pid: int, path: str, found: DeviceHold, rec: _Reconciling) -> None:
        """One device the scan found held: a new hold is opened (and mapped); a known one takes the
        fds and mappings the scan read, unless an event touched it since the scan began."""
        ts_ns = rec.ts_ns
        held = self.holders.get(pid)
        hold = held.holds.get(path) if held is not None else None
        if hold is None:
            if found.fds:
                self._apply_scanned(rec, SourceEvent(EventKind.OPEN, "procfs", ts_ns, pid, fd=min(found.fds),
                                                     device=found.device), fds=found.fds)
            if found.mapped:
                self._apply_scanned(rec, SourceEvent(EventKind.MMAP, "procfs", ts_ns, pid,
                                                     device=found.device))
            if pid in self.holders and path in self.holders[pid].holds:
                self.holders[pid].holds[path].via_tasks = found.via_tasks
            return
        if not self._stale(pid, path, ts_ns):
            return
        if hold.fds != found.fds or hold.via_tasks != found.via_tasks:
            # fds moved within a device (dup, close of one of several): not an event.
            # Before any UNMAP, so that a mapped-only hold reopened since keeps its device.
            hold.fds, hold.via_tasks = set(found.fds), found.via_tasks
            rec.changes.append(Change("device_updated", pid, copy_holder(self.holders[pid]), path))
        if found.mapped and not hold.mapped:
            self._apply_scanned(rec, SourceEvent(EventKind.MMAP, "procfs", ts_ns, pid, device=found.device))
        elif hold.mapped and not found.mapped:
            self._apply_scanned(rec, SourceEvent(EventKind.UNMAP, "procfs", ts_ns, pid, device=found.device))

    def _reconcile_unseen(self, pid: int, rec: _Reconciling, exit_reported: set[int] | None) -> None:
        """A holder in scope the scan did not find: gone (its EXIT, unless the kernel reports it),
        its PID reused (an EXIT too), or still there holding nothing (a CLOSE per stale hold)."""
        holder = self.holders.get(pid)
        if holder is None:
            return
        old = [path for path in sorted(holder.holds) if self._stale(pid, path, rec.ts_ns)]
        if not old:
            return
        gone = not self._still_there(pid)
        if gone and exit_reported and pid in exit_reported:
            return
        if gone or self._reused(pid):
            self._apply_scanned(rec, SourceEvent(EventKind.EXIT, "procfs", rec.ts_ns, pid))
            return
        for path in old:
            self._apply_scanned(rec, SourceEvent(EventKind.CLOSE, "procfs", rec.ts_ns, pid,
                                                 device=holder.holds[path].device))

    def _apply_scanned(self, rec: _Reconciling, ev: SourceEvent, fds: set[int] | None = None) -> None:
        rec.events.append(ev)
        rec.changes.extend(self._apply(ev, check_reuse=False, fds=fds))

    def _stale(self, pid: int, path: str, ts_ns: int) -> bool:
        """Neither opened nor touched by an event since the scan began at ts_ns."""
        hold = self.holders[pid].holds[path]
        return hold.first_seen_ns < ts_ns and self._touched_ns.get((pid, path), 0) < ts_ns

    def _reused(self, pid: int) -> bool:
        """Does the PID now belong to another process than the cached one? (no table change)"""
        fresh = self._who(pid, 0)
        old_ticks = self.holders[pid].process.start_ticks
        return (fresh is not None and old_ticks is not None and fresh.start_ticks is not None
                and fresh.start_ticks != old_ticks)

    def _prune(self, before_ns: int) -> None:
        # Scans are reconciled in the order they started, but for one nested in another (the
        # caller says so with keep_since_ns): marks older than the oldest start can no longer
        # shadow anything. Dropping an EXIT's or a CLOSE's mark the outer scan still needs would
        # let its older view bring the holder or the hold back.
        self._touched_ns = {k: t for k, t in self._touched_ns.items() if t >= before_ns}
        self._exited_ns = {k: t for k, t in self._exited_ns.items() if t >= before_ns}
        self._fresh.clear()

    def _trim(self) -> None:
        # No scan has pruned for long (procfs source off?): keep the newest half of the marks.
        _keep_newest_half(self._touched_ns)
        _keep_newest_half(self._exited_ns)

    # --- the agent's other inputs ---------------------------------------------------------

    def set_ioctl_counts(self, pid: int, counts: dict[int, int]) -> None:
        holder = self.holders.get(pid)
        if holder is not None:
            holder.ioctl_counts = dict(counts)

    def holders_snapshot(self) -> list[Holder]:
        return [copy_holder(self.holders[pid]) for pid in sorted(self.holders)]


def _keep_newest_half(marks: dict[_K, int]) -> None:
    """Keep the newer half of `marks` (key -> when, ns)."""
    newest = sorted(marks.items(), key=lambda kv: kv[1])[len(marks) // 2:]
    marks.clear()
    marks.update(newest)
