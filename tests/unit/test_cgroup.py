"""Container identity from /proc/PID/cgroup and cgroup v2 id -> path resolution."""

from __future__ import annotations

import ctypes
import json
import os
import struct
import uuid
from pathlib import Path
from typing import Any

import pytest
from ghostgpu.tracer import cgroup
from ghostgpu.tracer.cgroup import (
    CgroupIdentity,
    CgroupIdResolver,
    find_cgroup2_root,
    parse_cgroup_path,
    parse_proc_cgroup,
    unified_path,
)

from tests.conftest import require_root

# The cgroup vectors live in the repository (tests/data/cgroup_vectors.json, described in
# docs/reference/cgroup-paths.md). A missing or unreadable file fails collection: never a skip.
VECTOR_FILE = Path(__file__).resolve().parents[1] / "data" / "cgroup_vectors.json"
VECTOR_DOC = json.loads(VECTOR_FILE.read_text())
VECTORS: list[dict[str, Any]] = VECTOR_DOC["vectors"]


def _hierarchy(lines: list[str]) -> str:
    v2 = any(line.startswith("0::") for line in lines)
    v1 = any(not line.startswith("0::") for line in lines)
    return "hybrid" if v1 and v2 else ("v2" if v2 else "v1")


@pytest.mark.parametrize("vec", VECTORS, ids=[v["id"] for v in VECTORS])
def test_reference_vectors(vec: dict[str, Any]) -> None:
    got = parse_proc_cgroup("\n".join(vec["proc_cgroup"]))
    want = vec["expect"]
    expected = (want["runtime"], want["container_id"], want["pod_uid"])
    assert (got.runtime, got.container_id, got.pod_uid) == expected
    if got.container_id:
        assert got.container_id in got.path  # the path the id came from
    assert vec["hierarchy"] == _hierarchy(vec["proc_cgroup"])
    assert vec["basis"] in ("source", "inferred", "negative") and vec["why"]


def test_vector_file_is_complete() -> None:
    assert len(VECTORS) >= 24 and {v["id"] for v in VECTORS} >= {f"T{i:02d}" for i in range(1, 25)}
    assert len({v["id"] for v in VECTORS}) == len(VECTORS)  # no id twice
    assert VECTOR_DOC["source"]  # the upstream code that names these cgroups


CID = "19646ab960cf9e821c34e5f392e4e58e6979cbd4ab7c485b8f7091d741aa8626"
CID2 = "3d273284cb94e68f4b085ae789394cad01a492373c7eec8be1d7f6bdaaa7d51a"
UID = "9beda87f-4b79-41fb-a5d6-ec253a2529f2"
SLICE = f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice"

EXTRA = [
    # (id, content, runtime, container id, pod uid)
    ("crun-container-child-containerd", f"0::{SLICE}/cri-containerd-{CID}.scope/container",
     "containerd", CID, UID),
    ("crio-exec-child", f"0::{SLICE}/crio-{CID}.scope/exec", "crio", CID, UID),
    ("crio-exec-under-container", f"0::{SLICE}/crio-{CID}.scope/container/exec", "crio", CID, UID),
    ("podman-conmon", f"0::/machine.slice/libpod-conmon-{CID}.scope", "podman-conmon", CID, ""),
    ("crio-conmon-cgroupfs", f"0::/kubepods/pod{UID}/crio-conmon-{CID}", "crio-conmon", CID, UID),
    ("garbage-lines-around", f"garbage\n::\nnot:a\n0::{SLICE}/crio-{CID}.scope\n\x00\x01", "crio", CID, UID),
    ("empty", "", "", "", ""),
    ("only-newlines", "\n\n", "", "", ""),
    ("windows-line-endings", f"1:name=systemd:/docker/{CID2}\r\n0::/\r\n", "docker", CID2, ""),
    ("63-hex-is-not-an-id", f"0::/system.slice/docker-{CID2[:63]}.scope", "", "", ""),
    ("65-hex-is-not-an-id", f"0::/docker/{CID2}a", "", "", ""),
    ("upper-case-hex-is-not-an-id", f"0::/docker/{CID2.upper()}", "", "", ""),
    ("docker-without-scope-is-not-systemd-form", f"0::/system.slice/docker-{CID2}", "", "", ""),
    ("cri-containerd-without-scope", f"0::{SLICE}/cri-containerd-{CID}", "", "", UID),
    ("pod-only", f"0::{SLICE}", "", "", UID),
    ("v2-pod-only-then-v1-container", f"0::{SLICE}\n4:memory:/docker/{CID2}", "docker", CID2, ""),
    ("name-systemd-before-other-v1", f"4:memory:/docker/{CID}\n1:name=systemd:/docker/{CID2}", "docker", CID2,
     ""),
    ("v2-before-v1", f"1:name=systemd:/docker/{CID2}\n0::/docker/{CID}", "docker", CID, ""),
    ("static-pod-cgroupfs", f"0::/kubepods/besteffort/pod45b9379cb84b96491679c51082923b3c/{CID}", "", CID,
     "45b9379cb84b96491679c51082923b3c"),
    ("bad-uuid-shape", "0::/kubepods/besteffort/pod9beda87f-4b79-41fb-a5d6ec253a2529f2-", "", "", ""),
    ("colon-in-path-v1", f"3:cpu:/x.slice:cri-containerd:{CID}", "containerd", CID, ""),
]


@pytest.mark.parametrize(("content", "runtime", "cid", "pod_uid"), [r[1:] for r in EXTRA],
                         ids=[r[0] for r in EXTRA])
def test_extra_rows(content: str, runtime: str, cid: str, pod_uid: str) -> None:
    got = parse_proc_cgroup(content)
    assert (got.runtime, got.container_id, got.pod_uid) == (runtime, cid, pod_uid)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        (f"{SLICE}/cri-containerd-{CID}.scope",
         CgroupIdentity("containerd", CID, UID, f"{SLICE}/cri-containerd-{CID}.scope")),
        (f"/docker/{CID2}", CgroupIdentity("docker", CID2, "", f"/docker/{CID2}")),
        ("/", CgroupIdentity("", "", "", "")),
        ("", CgroupIdentity("", "", "", "")),
        ("/system.slice/containerd.service", CgroupIdentity("", "", "", "")),
        (f"/../../crio-{CID}.scope", CgroupIdentity("crio", CID, "", f"/../../crio-{CID}.scope")),
    ],
    ids=["systemd-containerd", "docker-cgroupfs", "root", "empty", "host-daemon", "relative"],
)
def test_parse_cgroup_path(path: str, expected: CgroupIdentity) -> None:
    assert parse_cgroup_path(path) == expected


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("12:memory:/a\n0::/kubepods/x\n", "/kubepods/x"),
        ("0::/\n", "/"),
        ("4:memory:/a\n", ""),
        ("", ""),
        ("0::/a b\r\n", "/a b"),
    ],
)
def test_unified_path(content: str, expected: str) -> None:
    assert unified_path(content) == expected


def make_tree(root: Path, rels: list[str]) -> dict[str, int]:
    """A directory tree standing for a cgroup2 hierarchy; returns path -> inode."""
    (root / "cgroup.controllers").write_text("cpu memory\n")
    out = {"/": os.stat(root).st_ino}
    for rel in rels:
        (root / rel.lstrip("/")).mkdir(parents=True)
        out[rel] = os.stat(root / rel.lstrip("/")).st_ino
    return out


@pytest.mark.parametrize(
    ("layout", "expected_rel"),
    [("pure-v2", ""), ("hybrid", "unified"), ("none", None)],
)
def test_find_cgroup2_root_by_controllers_file(tmp_path: Path, layout: str, expected_rel: str | None) -> None:
    if layout == "pure-v2":
        (tmp_path / "cgroup.controllers").write_text("")
    elif layout == "hybrid":
        (tmp_path / "memory").mkdir()
        (tmp_path / "unified").mkdir()
        (tmp_path / "unified" / "cgroup.controllers").write_text("")
    got = find_cgroup2_root(str(tmp_path))
    assert got == (None if expected_rel is None else str(tmp_path / expected_rel))


def test_resolver_on_a_fake_tree(tmp_path: Path) -> None:
    leaf = f"/kubepods.slice/kubepods-burstable.slice/{SLICE.rsplit('/', 1)[1]}/cri-containerd-{CID}.scope"
    inodes = make_tree(tmp_path, ["/system.slice", leaf])
    resolver = CgroupIdResolver(str(tmp_path))
    assert resolver.root == str(tmp_path) and resolver.error == ""
    assert resolver.path_for(inodes[leaf]) == leaf
    assert resolver.path_for(inodes["/"]) == "/"
    ident = resolver.identity_for(inodes[leaf])
    assert ident is not None
    assert (ident.runtime, ident.container_id, ident.pod_uid) == ("containerd", CID, UID)
    host = resolver.identity_for(inodes["/system.slice"])
    assert host == CgroupIdentity("", "", "", "/system.slice")  # the path, even with no container


def test_resolver_rescans_at_most_every_100ms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_tree(tmp_path, ["/a"])
    resolver = CgroupIdResolver(str(tmp_path))
    scans: list[int] = []
    real_rescan = resolver.rescan
    monkeypatch.setattr(resolver, "rescan", lambda: scans.append(1) or real_rescan())
    assert resolver.path_for(999_999_999) is None  # first miss: one walk
    assert resolver.path_for(999_999_998) is None  # within 100 ms: no second walk
    assert len(scans) == 1
    (tmp_path / "b").mkdir()
    new_id = os.stat(tmp_path / "b").st_ino
    resolver._last_scan_s -= CgroupIdResolver.RESCAN_MIN_INTERVAL_S  # as if 100 ms had passed
    assert resolver.path_for(new_id) == "/b"
    assert len(scans) == 2
    assert resolver.path_for(new_id) == "/b" and len(scans) == 2  # cached: no walk


def test_resolver_keeps_removed_cgroups_and_survives_vanishing_dirs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inodes = make_tree(tmp_path, ["/gone", "/live/child", "/racy/x"])
    resolver = CgroupIdResolver(str(tmp_path))
    assert resolver.rescan() == 6  # root, gone, live, live/child, racy, racy/x
    os.rmdir(tmp_path / "gone")
    real_scandir = os.scandir

    def racy_scandir(path: str):  # type: ignore[no-untyped-def]
        if str(path).endswith("racy"):
            raise FileNotFoundError(path)  # removed between listing its parent and opening it
        return real_scandir(path)

    monkeypatch.setattr(cgroup.os, "scandir", racy_scandir)
    assert resolver.rescan() == 4  # root, live, live/child, racy (its children unreadable)
    assert resolver.path_for(inodes["/gone"]) == "/gone"  # a process may be gone with its cgroup
    assert resolver.path_for(inodes["/live/child"]) == "/live/child"


def test_resolver_without_cgroup2_says_what_to_do(tmp_path: Path) -> None:
    resolver = CgroupIdResolver(str(tmp_path))
    assert resolver.root is None
    assert "no cgroup2 hierarchy" in resolver.error and "mount" in resolver.error
    assert resolver.path_for(1) is None and resolver.identity_for(1) is None


def kernel_cgroup_id(path: str) -> int:
    """The kernel's 64-bit id of a cgroup2 directory: its file handle (FILEID_KERNFS) is that id."""
    libc = ctypes.CDLL(None, use_errno=True)
    handle = ctypes.create_string_buffer(8 + 128)
    struct.pack_into("=Ii", handle, 0, 128, 0)  # struct file_handle { handle_bytes; handle_type; }
    mount_id = ctypes.c_int()
    at_fdcwd = -100
    if libc.name_to_handle_at(at_fdcwd, path.encode(), handle, ctypes.byref(mount_id), 0) != 0:
        raise OSError(ctypes.get_errno(), "name_to_handle_at", path)
    size, _kind = struct.unpack_from("=Ii", handle, 0)
    assert size == 8
    return struct.unpack_from("=Q", handle, 8)[0]


@pytest.mark.root
def test_resolver_on_the_real_cgroup2_mount() -> None:
    require_root()
    root = find_cgroup2_root("/sys/fs/cgroup")
    if root is None:
        pytest.skip("no cgroup2 hierarchy on this host (pure cgroup v1)")
    name = f"ghostgpu-test-{uuid.uuid4().hex[:12]}"
    path = os.path.join(root, name)
    os.mkdir(path)
    try:
        cgroup_id = os.stat(path).st_ino
        assert kernel_cgroup_id(path) == cgroup_id  # what bpf_get_current_cgroup_id() reports
        resolver = CgroupIdResolver("/sys/fs/cgroup")
        assert resolver.root == root
        assert resolver.path_for(cgroup_id) == f"/{name}"
        child = os.path.join(path, "cri-containerd-" + CID + ".scope")
        os.mkdir(child)
        try:
            resolver._last_scan_s -= CgroupIdResolver.RESCAN_MIN_INTERVAL_S
            ident = resolver.identity_for(os.stat(child).st_ino)
            assert ident is not None and (ident.runtime, ident.container_id) == ("containerd", CID)
            assert ident.path == f"/{name}/cri-containerd-{CID}.scope"
        finally:
            os.rmdir(child)
    finally:
        os.rmdir(path)
