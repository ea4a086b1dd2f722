"""Run the real `ghostgpu tracer` with a reduced capability set and see what it still does.

Used by bench/caps_probe.py (the measurement behind tracer/capabilities.py and the DaemonSet's
capability list) and tests/integration/test_capabilities.py. Needs root, bcc and gcc.

    with PlantedHolders(tmp) as holders:
        result = run_case(tmp / "case", {"CAP_BPF", "CAP_PERFMON", ...}, holders)
        result.broken   # [] when everything a tracer does still works

The tracer runs as uid 0, as the DaemonSet's does, under `setpriv --bounding-set -all,+X...
--inh-caps -all --no-new-privs`: root's exec then gives it exactly the bounding set as its permitted
and effective sets, which is what a container gets from `capabilities: {drop: [ALL], add: [X...]}`
and `allowPrivilegeEscalation: false`.

Planted before it starts, so only its first /proc scan can find them:
- `container_root`: a fake container's root process with every capability, holding /dev/nvidia0;
- `other_uid`: a host process running as uid 65534, holding PREFIX/nvidia0 (a c 1 3 node);
- `mapped_only`: a fake container process that mmapped /dev/nvidia0 (c 1 5) and closed the fd.
After `ready` one more container process opens /dev/nvidia0: only the kernel side reports that
within the wait (the next /proc scan is 30 s away). The tracer's `kmsg` notice says the kernel log
(the driver's Xid reports) could not be read.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Self

from ghostgpu.tracer.capabilities import CAP_BITS, CAP_NAMES

from tests.helpers.container import FakeContainer
from tests.helpers.httpget import http_get
from tests.helpers.tracer_proc import TracerProcess
from tests.helpers.workload import Workload, build_gpuwork

NOBODY_UID = 65534
NEW_HOLDER_WAIT_S = 5.0  # the kernel side reports an open within milliseconds
READY_TIMEOUT_S = 90.0  # bcc compiles the programs at start
_SERVING = re.compile(r"health: serving on (\S+)")
_MAP_FILES_CHECK = """
import os, sys
pid = int(sys.argv[1])
line = next(ln for ln in open(f"/proc/{pid}/maps") if "/dev/nvidia0" in ln)
start, end = (int(x, 16) for x in line.split()[0].split("-"))
try:
    st = os.stat(f"/proc/{pid}/map_files/{start:x}-{end:x}")
    print(f"ok {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}")
except OSError as e:
    print(f"failed {e.strerror}")
"""


def bounding_names() -> list[str]:
    """The capabilities this process may hand on (its bounding set): the 'full set' of a probe."""
    with open("/proc/self/status") as f:
        line = next(ln for ln in f if ln.startswith("CapBnd:"))
    mask = int(line.split()[1], 16)
    return [name for bit, name in enumerate(CAP_NAMES) if mask >> bit & 1]


def setpriv_argv(keep: Iterable[str], memlock_bytes: int | None = None) -> list[str]:
    """argv that runs a command as this uid with exactly `keep` (names as in capabilities(7))."""
    caps = ",".join(["-all", *(f"+{name.removeprefix('CAP_').lower()}" for name in sorted(keep))])
    for name in keep:
        if name not in CAP_BITS:
            raise ValueError(f"unknown capability {name}")
    prefix = ["prlimit", f"--memlock={memlock_bytes}:{memlock_bytes}"] if memlock_bytes is not None else []
    return [*prefix, "setpriv", f"--bounding-set={caps}", "--inh-caps=-all", "--no-new-privs"]


class PlantedHolders:
    """The three holders above, alive until close(); `tracer_args` point the tracer at them."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        # A short prefix (the kernel matcher takes at most 40 bytes), searchable by uid 65534.
        self.node_dir = Path(tempfile.mkdtemp(prefix="ggcaps-", dir="/tmp"))
        self.node_dir.chmod(0o755)
        self.prefix = f"{self.node_dir}/nvidia"
        self._stack = contextlib.ExitStack()
        self.container_root = self.other_uid = self.mapped_only = 0

    def __enter__(self) -> Self:
        try:
            node = self.node_dir / "nvidia0"
            os.mknod(node, 0o20666, os.makedev(1, 3))
            node.chmod(0o666)
            gpuwork = str(build_gpuwork())
            other = self._stack.enter_context(Workload(subprocess.Popen(
                ["setpriv", f"--reuid={NOBODY_UID}", f"--regid={NOBODY_UID}", "--clear-groups",
                 "--inh-caps=-all", "--bounding-set=-all", gpuwork, "open", str(node), "ready", "wait"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)))
            other.wait_ready()
            self.other_uid = other.pid
            held = self._stack.enter_context(FakeContainer())
            p = held.run(["open", "/dev/nvidia0", "ready", "wait"])
            p.wait_ready()
            self.container_root = p.host_pid
            mapped = self._stack.enter_context(FakeContainer(devices={"nvidia0": (1, 5)}))
            m = mapped.run(["open", "/dev/nvidia0", "mmap", "0", "close", "0", "ready", "wait"])
            m.wait_ready()
            self.mapped_only = m.host_pid
            self.later = self._stack.enter_context(FakeContainer())  # opens after each tracer's `ready`
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        shutil.rmtree(self.node_dir, ignore_errors=True)

    @property
    def tracer_args(self) -> list[str]:
        return ["--device-prefix", "/dev/nvidia", "--device-prefix", self.prefix, "--grace-s", "0.5"]

    @property
    def planted(self) -> dict[str, int]:
        return {"container_root": self.container_root, "other_uid": self.other_uid,
                "mapped_only": self.mapped_only}


@dataclass
class CaseResult:
    caps: list[str]
    started: bool = False
    bpf: bool = False
    readyz: int = 0
    found: dict[str, bool] = field(default_factory=dict)  # planted holder -> seen by the first scan
    new_holder_by_bpf: bool = False
    map_files: str = ""  # the map_files stat under the same set: "ok 1:5" or "failed <why>"
    capability_lines: list[str] = field(default_factory=list)  # what the tracer said at start
    bpf_error: str = ""
    kmsg_error: str = ""  # the tracer's `kmsg` notice: why it cannot read the kernel log (Xid faults)
    bcc_stderr: list[str] = field(default_factory=list)  # what bcc itself printed (the kernel's refusal)
    broken: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def run_case(workdir: Path, keep: Iterable[str], holders: PlantedHolders, memlock_bytes: int | None = None,
             ) -> CaseResult:
    """Start the tracer with exactly `keep`, record what worked, stop it."""
    keep = sorted(set(keep))
    workdir.mkdir(parents=True, exist_ok=True)
    result = CaseResult(caps=keep)
    wrapper = setpriv_argv(keep, memlock_bytes)
    args = [*holders.tracer_args, "--health-listen", "127.0.0.1:0"]
    with TracerProcess(workdir, args, wrapper=wrapper) as tracer:
        try:
            ready = tracer.wait_for(lambda r: r.get("event") == "ready", READY_TIMEOUT_S, "ready")
        except AssertionError as e:
            result.broken.append(f"no ready record: {str(e).splitlines()[0]}")
            return result
        result.started, result.bpf = True, bool(ready.get("bpf"))
        for name, pid in holders.planted.items():
            result.found[name] = bool(tracer.matching(
                lambda r, pid=pid: r.get("event") in ("open", "mmap") and r.get("pid") == pid))
        served = _SERVING.search(tracer.stderr())
        if served:
            result.readyz = http_get(f"http://{served.group(1)}/readyz")[0]
        p = holders.later.run(["open", "/dev/nvidia0", "ready", "wait"])
        p.wait_ready()
        with contextlib.suppress(AssertionError):
            tracer.wait_for(lambda r: r.get("event") == "open" and r.get("pid") == p.host_pid
                            and r.get("source") == "bpf", NEW_HOLDER_WAIT_S, "new holder")
            result.new_holder_by_bpf = True
        p.kill()
        notice = tracer.matching(lambda r: r.get("event") == "notice" and r.get("what") == "bpf")
        result.bpf_error = notice[0].get("message", "") if notice else ""
        kmsg = tracer.matching(lambda r: r.get("event") == "notice" and r.get("what") == "kmsg")
        result.kmsg_error = kmsg[0].get("message", "") if kmsg else ""
        stderr = tracer.stderr().splitlines()
        result.capability_lines = [ln.split("ghostgpu.tracer: ", 1)[-1] for ln in stderr
                                   if "CAP_" in ln and " missing: " in ln]
        result.bcc_stderr = [ln for ln in stderr if ln.strip() and not ln.startswith("ghostgpu:")][:3]
    check = subprocess.run([*wrapper, sys.executable, "-c", _MAP_FILES_CHECK, str(holders.mapped_only)],
                           capture_output=True, text=True, check=False)
    result.map_files = check.stdout.strip() or f"failed {(check.stderr.strip().splitlines() or ['?'])[-1]}"
    result.broken += _broken(result)
    return result


def _broken(r: CaseResult) -> list[str]:
    out = []
    if not r.bpf:
        out.append(f"BPF not loaded ({r.bpf_error or 'no notice'})")
    if r.readyz != 200:
        out.append(f"/readyz answered {r.readyz}")
    out += [f"{name} holder not found by the /proc scan" for name, seen in r.found.items() if not seen]
    if not r.new_holder_by_bpf:
        out.append("a holder opened after start was not reported by the kernel side")
    if not r.map_files.startswith("ok"):
        out.append(f"/proc/PID/map_files: {r.map_files}")
    if r.kmsg_error:
        out.append(f"kernel log not read ({r.kmsg_error})")
    return out



def socket_check(keep: Iterable[str], directory: Path) -> str:
    """Connect, with exactly `keep`, to a unix socket as the CRI runtime's and kubelet's are made
    (root:root, 0660, in a 0700 directory): "ok" or why not."""
    import socket

    sock_dir = directory / "sockdir"
    sock_dir.mkdir(mode=0o700, exist_ok=True)
    path = sock_dir / "runtime.sock"
    path.unlink(missing_ok=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        path.chmod(0o660)
        server.listen(1)
        code = "import socket,sys; socket.socket(socket.AF_UNIX).connect(sys.argv[1]); print('ok')"
        check = subprocess.run([*setpriv_argv(keep), sys.executable, "-c", code, str(path)],
                               capture_output=True, text=True, check=False)
    return check.stdout.strip() or f"failed {(check.stderr.strip().splitlines() or ['?'])[-1]}"


# The checkout (and the venv in it) may itself live under /tmp (a CI clone): it is held aside and
# bound back over the fresh tmpfs, so the tracer still runs from it.
_READONLY_SCRIPT = """
set -e
mount --make-rprivate /
hold=$(mktemp -d /dev/shm/ghostgpu-ro.XXXXXX)
mount --bind "$1" "$hold"
mount -t tmpfs tmpfs /tmp
mkdir -p "$1"
mount --bind "$hold" "$1"
for m in $(findmnt -rno TARGET -T "$1") / /sys/kernel/tracing; do mount -o remount,bind,ro "$m"; done
mkdir -p /tmp/w
"${@:2}" --jsonl /tmp/w/t.jsonl --node-name ro 2>/tmp/w/err &
pid=$!
for _ in $(seq 1 600); do grep -q '"event":"ready"' /tmp/w/t.jsonl 2>/dev/null && break; sleep 0.1; done
kill $pid 2>/dev/null; wait $pid || true
umount "$hold" && rmdir "$hold" || true
grep -h '"event":"ready"' /tmp/w/t.jsonl || tail -3 /tmp/w/err
"""


def readonly_check(keep: Iterable[str]) -> str:
    """The tracer with exactly `keep` in a private mount namespace where the root filesystem, the
    checkout and tracefs are read-only and /tmp is a tmpfs (the DaemonSet's readOnlyRootFilesystem,
    read-only tracefs mount and /tmp emptyDir): its `ready` record, or the end of its stderr."""
    root = Path(__file__).resolve().parents[2]
    tracer = [*setpriv_argv(keep), sys.executable, "-m", "ghostgpu.cli", "tracer"]
    check = subprocess.run(["unshare", "-m", "bash", "-c", _READONLY_SCRIPT, "readonly", str(root), *tracer],
                           capture_output=True, text=True, check=False, cwd=root, timeout=120)
    lines = (check.stdout.strip() or check.stderr.strip() or "no output").splitlines()
    return lines[-1]
