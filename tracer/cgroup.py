"""Container identity from cgroup paths, and cgroup v2 id -> path resolution.

The parser follows section 3 of docs/reference/cgroup-paths.md (names as created by
kubelet, containerd 2.x, CRI-O 1.36, moby and podman); its vectors are the unit tests.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from string import hexdigits

_LOWER_HEX = "".join(sorted(set(hexdigits.lower())))

# Leaf-upward component rules: (prefix, suffix ".scope" required, runtime). The -conmon- forms come
# first because "crio-conmon-<id>" also starts with "crio-" (it must never yield id "conmon-...").
_COMPONENT_RULES: tuple[tuple[str, bool, str], ...] = (
    ("crio-conmon-", False, "crio-conmon"),
    ("libpod-conmon-", False, "podman-conmon"),
    ("cri-containerd-", True, "containerd"),
    ("crio-", False, "crio"),
    ("docker-", True, "docker"),
    ("libpod-", False, "podman"),
)
_SLICE_CONTAINERD = ".slice:cri-containerd:"  # containerd with runc on cgroupfs under a systemd kubelet


@dataclass(frozen=True)
class CgroupIdentity:
    runtime: str  # containerd | crio | crio-conmon | docker | podman | podman-conmon | "" (unknown)
    container_id: str  # 64 lower-case hex, "" outside a container
    pod_uid: str  # RFC 4122 with dashes, or 32 hex for static pods; "" outside a pod
    path: str  # the cgroup path the id (or pod UID) came from; "" if none


NO_IDENTITY = CgroupIdentity("", "", "", "")


def _is_hex(text: str, length: int) -> bool:
    return len(text) == length and not text.strip(_LOWER_HEX)


def _is_uuid(text: str) -> bool:
    """8-4-4-4-12 lower-case hex with dashes."""
    if len(text) != 36:
        return False
    groups = text.split("-")
    return [len(g) for g in groups] == [8, 4, 4, 4, 12] and all(_is_hex(g, len(g)) for g in groups)


def _container_in(component: str, parent: str) -> tuple[str, str] | None:
    """(runtime, id) when one path component names a container, else None."""
    scoped = component.endswith(".scope")
    stem = component[: -len(".scope")] if scoped else component
    for prefix, needs_scope, runtime in _COMPONENT_RULES:
        if stem.startswith(prefix) and (scoped or not needs_scope):
            cid = stem[len(prefix) :]
            return (runtime, cid) if _is_hex(cid, 64) else None
    idx = component.find(_SLICE_CONTAINERD)
    if idx > 0:
        cid = component[idx + len(_SLICE_CONTAINERD) :]
        return ("containerd", cid) if _is_hex(cid, 64) else None
    if _is_hex(component, 64):
        # cgroupfs: containerd and cri-dockerd both use a bare id under the pod; only plain
        # docker's /docker/<id> says which runtime it is.
        return ("docker" if parent == "docker" else "", component)
    return None


def _pod_uid_in(component: str) -> str:
    """The pod UID a kubelet pod cgroup component carries, or ""."""
    if component.startswith("pod"):
        uid = component[3:]
        if _is_uuid(uid) or _is_hex(uid, 32):
            return uid
    # systemd driver: ...-pod<uid with _>.slice, possibly followed by ":cri-containerd:<id>".
    end = component.find(".slice")
    while end >= 0:
        head = component[:end]
        for length in (36, 32):
            if head[-length - 3 : -length] == "pod" and len(head) >= length + 3:
                uid = head[-length:].replace("_", "-")
                if (length == 36 and _is_uuid(uid)) or (length == 32 and _is_hex(uid, 32)):
                    return uid
        end = component.find(".slice", end + 1)
    return ""


def parse_cgroup_path(path: str) -> CgroupIdentity:
    """Identity from one cgroup path (v2 path from a BPF cgroup id, or the path of one v1 line)."""
    parts = [p for p in path.split("/") if p and p != ".."]
    runtime = cid = ""
    for i in range(len(parts) - 1, -1, -1):  # leaf upwards: crun's container/, cri-o's exec/ below
        found = _container_in(parts[i], parts[i - 1] if i > 0 else "")
        if found is not None:
            runtime, cid = found
            break
    pod_uid = ""
    for part in parts:
        pod_uid = _pod_uid_in(part)
        if pod_uid:
            break
    if not cid and not pod_uid:
        return NO_IDENTITY
    return CgroupIdentity(runtime, cid, pod_uid, path)


def _line_rank(hierarchy: str, controllers: str) -> int:
    if hierarchy == "0" and controllers == "":
        return 0
    if controllers == "name=systemd":
        return 1
    return 2


def parse_proc_cgroup(text: str) -> CgroupIdentity:
    """Identity from the whole /proc/PID/cgroup (v1, v2 or hybrid); never raises."""
    lines: list[tuple[int, int, str]] = []
    for order, raw in enumerate(text.splitlines()):
        fields = raw.strip().split(":", 2)  # the path itself may contain ':' (T20)
        if len(fields) != 3 or not fields[2].startswith("/"):
            continue
        lines.append((_line_rank(fields[0], fields[1]), order, fields[2]))
    lines.sort()
    pod_only = NO_IDENTITY
    for _rank, _order, path in lines:
        ident = parse_cgroup_path(path)
        if ident.container_id:
            return ident
        if ident.pod_uid and not pod_only.pod_uid:
            pod_only = ident
    return pod_only


def unified_path(text: str) -> str:
    """The cgroup v2 path (the `0::` line) of /proc/PID/cgroup content, or ""."""
    for raw in text.splitlines():
        if raw.startswith("0::"):
            return raw.strip()[3:]
    return ""


def _cgroup2_mounts(mountinfo_path: str = "/proc/self/mountinfo") -> set[str]:
    out: set[str] = set()
    try:
        with open(mountinfo_path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                left, sep, right = line.partition(" - ")
                if sep and right.split(" ", 1)[0] == "cgroup2":
                    fields = left.split(" ")
                    if len(fields) >= 5:  # mount point is field 5; spaces are escaped as \040
                        out.add(fields[4].replace("\\040", " "))
    except OSError:
        pass
    return out


def find_cgroup2_root(cgroup_root: str = "/sys/fs/cgroup") -> str | None:
    """Where the cgroup2 hierarchy is: cgroup_root itself (pure v2) or cgroup_root/unified (hybrid)."""
    candidates = (cgroup_root, os.path.join(cgroup_root, "unified"))
    mounts = _cgroup2_mounts()
    for cand in candidates:
        if os.path.realpath(cand) in mounts or cand in mounts:
            return cand
    # mountinfo of our own namespace may not show a host mount by that name (bind mounts in a pod):
    # cgroup.controllers exists only at the root of a cgroup2 hierarchy, never in v1.
    for cand in candidates:
        if os.path.exists(os.path.join(cand, "cgroup.controllers")):
            return cand
    return None


class CgroupIdResolver:
    """cgroup v2 id (bpf_get_current_cgroup_id(), the directory's inode) -> path under the v2 root."""

    RESCAN_MIN_INTERVAL_S = 0.1

    def __init__(self, cgroup_root: str = "/sys/fs/cgroup") -> None:
        self.root = find_cgroup2_root(cgroup_root)
        self.error = "" if self.root else (
            f"no cgroup2 hierarchy at {cgroup_root} or {cgroup_root}/unified; "
            "mount the host's /sys/fs/cgroup to attribute processes by cgroup id"
        )
        self._paths: dict[int, str] = {}
        self._last_scan_s = -1e9

    def rescan(self) -> int:
        """Walk the whole v2 tree (iteratively) and refresh the cache; returns how many cgroups it saw."""
        self._last_scan_s = time.monotonic()
        if not self.root:
            return 0
        seen: dict[int, str] = {}
        try:
            seen[os.stat(self.root).st_ino] = "/"
        except OSError:
            return 0
        stack: list[tuple[str, str]] = [(self.root, "")]
        while stack:
            directory, rel = stack.pop()
            try:
                with os.scandir(directory) as it:
                    for entry in it:
                        # a cgroup removed mid-walk is normal: is_dir()/inode() then simply fail
                        try:
                            if entry.is_dir(follow_symlinks=False):
                                child_rel = f"{rel}/{entry.name}"
                                seen[entry.inode()] = child_rel
                                stack.append((entry.path, child_rel))
                        except OSError:
                            continue
            except OSError:
                continue
        # Keep ids of cgroups removed since the last walk: a process can be gone (and its cgroup
        # rmdir'd) before we ask. cgroup ids are 64-bit and not reused, so old entries stay right;
        # only bound the memory.
        if len(self._paths) > 2 * len(seen) + 4096:
            self._paths = seen
        else:
            self._paths.update(seen)
        return len(seen)

    def path_for(self, cgroup_id: int) -> str | None:
        if cgroup_id <= 0:  # 0: the event carried no cgroup id; not worth a walk
            return None
        path = self._paths.get(cgroup_id)
        if path is None and time.monotonic() - self._last_scan_s >= self.RESCAN_MIN_INTERVAL_S:
            self.rescan()
            path = self._paths.get(cgroup_id)
        return path

    def ids_of_containers(self, container_ids: Iterable[str]) -> set[int]:
        """The ids of every cgroup (at any depth) of these containers, from a fresh walk: what a
        trace session's scope is in the kernel. An id may be a prefix of the full 64-hex id."""
        wanted = tuple(cid for cid in container_ids if cid)
        if not wanted:
            return set()
        self.rescan()
        out: set[int] = set()
        for cgroup_id, path in list(self._paths.items()):
            cid = parse_cgroup_path(path).container_id
            if cid and cid.startswith(wanted):
                out.add(cgroup_id)
        return out

    def identity_for(self, cgroup_id: int) -> CgroupIdentity | None:
        path = self.path_for(cgroup_id)
        if path is None:
            return None
        ident = parse_cgroup_path(path)
        return ident if ident.path else CgroupIdentity("", "", "", path)
