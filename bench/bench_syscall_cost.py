"""What the ghostgpu BPF programs add to non-GPU syscalls, next to an empty program on the same
tracepoints and, for opens, a program of opensnoop's shape; and what a GPU ioctl that allocates
nothing costs against the programs of an earlier commit, side by side. Run as root:
python bench/bench_syscall_cost.py [--iterations N] [--open-iterations N] [--reps R] [--base REV].

Loops run in C (compiled here with gcc) so that interpreter overhead does not drown ~100 ns
differences. Per operation: ioctl(/dev/null, FIONREAD) (fails fast with ENOTTY; the syscall and
its tracepoints still run), an openat+close pair of /etc/hostname, and `gpu`: a holder's
RM_CONTROL (_IOWR('F', 0x2A, 32) with a 32-byte NVOS54 block) on a `c 1 3` node the programs watch
as a GPU device (it fails with ENOTTY like the others; the entry programs' GPU path and the ioctl
exit run in full). The loop opens the node itself, after its mode's programs were attached, so it
is a holder they saw open. --base REV (default 63cb2c5, the last commit before the ioctl exit was
always attached) loads that commit's programs with that commit's tracer/bpf_source.py (`git
archive` into a temporary directory, loaded in a subprocess) as mode `ghostgpu_base`, taking turns
with the others; `--base ''` leaves it out. A loop is timed in its own
CPU time (CLOCK_THREAD_CPUTIME_ID: BPF programs run in the syscall, so they are in it, and time the
loop spent preempted by other work on a shared machine is not); its wall time is kept in the JSON
(`rounds_wall`). Each mode reports the best of R rounds of N iterations; the modes take turns
within every round, in an order that rotates (programs are loaded once and only attached for their
turn), so drift of the machine does not favour one, and a round is discarded when another process
has BPF programs loaded or an ftrace syscall event is enabled: either puts every syscall on the
tracepoint slow path in every mode, "none" included, and the empty program's added cost collapses.
The opensnoop-shaped peer (bench/opensnoop_peer.bpf.c) runs in the open rounds only.
Writes bench/results/syscall_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ghostgpu.tracer.bpf_build import OPTIONAL_SYSCALLS, find_tracefs  # noqa: E402
from ghostgpu.tracer.bpf_source import BpfSource  # noqa: E402

LOOP_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

static double now_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc != 5) { fprintf(stderr, "usage: loop ioctl|open|gpu ITERATIONS REPS GPU_NODE\n"); return 2; }
    int open_mode = strcmp(argv[1], "open") == 0, gpu_mode = strcmp(argv[1], "gpu") == 0;
    long n = atol(argv[2]);
    int reps = atoi(argv[3]);
    /* gpu: the watched node (c 1 3), opened by absolute path as a CUDA process opens nvidiactl */
    int fd = open(gpu_mode ? argv[4] : "/dev/null", O_RDWR);
    if (fd < 0) { perror("open"); return 3; }
    int avail = 0;
    unsigned long request = gpu_mode ? 0xC020462AUL : FIONREAD; /* _IOWR('F', 0x2A, 32): RM_CONTROL */
    unsigned char block[32] = {0}; /* NVOS54_PARAMETERS: 32 bytes (docs/reference/nvidia-ioctl-abi.md 3.2) */
    void *arg = gpu_mode ? (void *)block : (void *)&avail;
    double best = 1e300, best_wall = 1e300;
    for (int r = 0; r < reps; r++) {
        double t0 = now_ns(CLOCK_THREAD_CPUTIME_ID), w0 = now_ns(CLOCK_MONOTONIC);
        for (long i = 0; i < n; i++) {
            if (open_mode) {
                int f = open("/etc/hostname", O_RDONLY);
                close(f);
            } else {
                ioctl(fd, request, arg);
            }
        }
        double per_op = (now_ns(CLOCK_THREAD_CPUTIME_ID) - t0) / n;
        double per_op_wall = (now_ns(CLOCK_MONOTONIC) - w0) / n;
        if (per_op < best) best = per_op;
        if (per_op_wall < best_wall) best_wall = per_op_wall;
    }
    printf("%.2f %.2f\n", best, best_wall);
    return 0;
}
"""

OPS = ("ioctl", "open", "gpu")
BASE_REV = "63cb2c5"  # the last commit whose ioctl exit was attached only during trace sessions

# Run by the .venv's python in a subprocess: load an earlier commit's kernel side through its own
# bpf_source.py (the editable install maps ghostgpu.tracer to this checkout, so the old tree's
# packages are put in place by hand), then attach or detach it on command, one line each.
BASE_LOADER = r"""
import importlib.util, sys
from pathlib import Path
base, prefix = Path(sys.argv[1]), sys.argv[2]
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f)]
sys.path.insert(0, str(base))
import ghostgpu
for sub in ("tracer",):  # the tracer imports only itself and ghostgpu.common
    spec = importlib.util.spec_from_file_location(
        f"ghostgpu.{sub}", base / sub / "__init__.py", submodule_search_locations=[str(base / sub)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[f"ghostgpu.{sub}"] = mod
    spec.loader.exec_module(mod)
from ghostgpu.tracer.bpf_source import BpfSource
assert BpfSource.__module__ and sys.modules["ghostgpu.tracer.bpf_source"].__file__.startswith(str(base))
source = BpfSource((prefix,))
source.start()
bpf = source._bpf
tps = sorted(tp.decode() if isinstance(tp, bytes) else tp for tp in bpf.tracepoint_fds)
for tp in list(bpf.tracepoint_fds):
    bpf.detach_tracepoint(tp)
print("ready", len(tps), round(source.start_s, 2), flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "attach":
        for tp in tps:
            group, event = tp.split(":")
            bpf.attach_tracepoint(tp=tp, fn_name=f"tracepoint__{group}__{event}")
    elif cmd == "detach":
        for tp in list(bpf.tracepoint_fds):
            bpf.detach_tracepoint(tp)
    else:
        break
    print("ok", flush=True)
source.close()
"""


def build_loop(workdir: Path) -> Path:
    src, exe = workdir / "loop.c", workdir / "loop"
    src.write_text(LOOP_C)
    subprocess.run(["gcc", "-O2", "-o", str(exe), str(src)], check=True)
    return exe


def run_loop(exe: Path, op: str, iterations: int, reps: int, gpu_node: str) -> tuple[float, float]:
    """(CPU ns, wall ns) per operation, each the best of `reps` runs inside the C program."""
    # Pinned to one CPU so every mode runs its loop under the same cache and frequency conditions.
    cmd = [str(exe), op, str(iterations), str(reps), gpu_node]
    if shutil.which("taskset") and (os.cpu_count() or 1) > 1:
        cmd = ["taskset", "-c", "1", *cmd]
    cpu, wall = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()
    return float(cpu), float(wall)


class Attachment:
    """The tracepoints of one loaded bcc program, detached and re-attached without recompiling,
    so modes can take turns round after round and machine drift hits them all alike."""

    def __init__(self, bpf: Any) -> None:
        self.bpf = bpf
        # bcc keys tracepoint_fds by b"group:event"
        self.tracepoints = sorted(tp.decode() if isinstance(tp, bytes) else tp for tp in bpf.tracepoint_fds)
        self.detach()

    def attach(self) -> None:
        for tp in self.tracepoints:
            group, event = tp.split(":")
            self.bpf.attach_tracepoint(tp=tp, fn_name=f"tracepoint__{group}__{event}")

    def detach(self) -> None:
        for tp in list(self.bpf.tracepoint_fds):
            self.bpf.detach_tracepoint(tp)


class BaseAttachment:
    """An earlier commit's kernel side, loaded by that commit's code in a subprocess (BASE_LOADER),
    attached and detached on command like Attachment."""

    def __init__(self, tree: Path, prefix: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", BASE_LOADER, str(tree), prefix],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(tree))
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "ready":
            raise RuntimeError(f"the base programs did not load (exit {self.proc.wait()}): see stderr")
        self.tracepoints = int(line[1])
        self.start_s = float(line[2])

    def _command(self, cmd: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        if self.proc.stdout.readline().strip() != "ok":
            raise RuntimeError(f"the base programs' loader did not answer {cmd!r}")

    def attach(self) -> None:
        self._command("attach")

    def detach(self) -> None:
        self._command("detach")

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def base_tree(rev: str, into: Path) -> Path:
    """The kernel side and tracer of commit `rev`, extracted with git archive under `into`."""
    tree = into / "base"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "bpf", "tracer", "ghostgpu"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def bench_program(name: str = "empty.bpf.c") -> Any:
    """A program of bench/ (the empty reference, the opensnoop peer) built for this kernel's syscalls."""
    from bcc import BPF

    tracefs = find_tracefs() or "/sys/kernel/tracing"
    present = [n for n in OPTIONAL_SYSCALLS if os.path.isdir(f"{tracefs}/events/syscalls/sys_enter_{n}")]
    cflags = [f"-DGG_HAVE_SYS_{n.upper()}=1" for n in present]
    return BPF(text=(ROOT / "bench" / name).read_text(), cflags=cflags)


def empty_program() -> Any:
    return bench_program("empty.bpf.c")


def ftrace_syscall_events() -> list[str]:
    """Syscall events enabled through tracefs (ftrace, trace-cmd): like a foreign BPF program, they
    turn on the syscall tracepoint slow path for every process."""
    tracefs = find_tracefs() or "/sys/kernel/tracing"
    try:
        return [ln for ln in Path(f"{tracefs}/set_event").read_text().split() if ln.startswith("syscalls:")]
    except OSError:
        return []


OWN_PIDS: set[int] = set()  # the base loader's: its programs are a mode of this run


def foreign_bpf_programs() -> int:
    """BPF program fds held by other processes: another tracer attached meanwhile (a test run on
    this shared machine) would add its cost to every mode, "none" included."""
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid() or int(pid) in OWN_PIDS:
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fdinfo")
        except OSError:
            continue
        for fd in fds:
            try:
                count += "prog_id:" in Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
            except OSError:
                continue
    return count


def foreign_activity() -> int:
    """BPF programs of other processes, plus ftrace syscall events enabled: 0 on a quiet machine."""
    return foreign_bpf_programs() + len(ftrace_syscall_events())


def wait_quiet(deadline: float) -> bool:
    """Wait (polling) until no other process traces syscalls; False at the deadline."""
    while foreign_activity():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def measure_round(exe: Path, modes: dict[str, Any], op: str, iterations: int,
                  turn: int, gpu_node: str) -> tuple[dict[str, float], dict[str, float]]:
    """One run of `op` per mode, back to back, so they share the machine's state of the moment;
    the order rotates with `turn`. (CPU ns, wall ns) per operation and mode."""
    names = list(modes)
    names = names[turn % len(names):] + names[:turn % len(names)]
    cpu: dict[str, float] = {}
    wall: dict[str, float] = {}
    for mode in names:
        attachment = modes[mode]
        if attachment:
            attachment.attach()
        try:
            cpu[mode], wall[mode] = run_loop(exe, op, iterations, 1, gpu_node)
        finally:
            if attachment:
                attachment.detach()
    return {m: cpu[m] for m in modes}, {m: wall[m] for m in modes}


def summarize(rounds: dict[str, list[dict[str, float]]], mode: str, ref: str, op: str) -> dict[str, float]:
    """Added ns of `mode` and of `ref` (best of the rounds, minus the best with no BPF) and their
    ratio; the ratio also as the median of per-round ratios, which machine drift cannot bias."""
    rows = rounds[op]
    best = {m: min(r[m] for r in rows) for m in (mode, ref, "none")}
    added, added_ref = best[mode] - best["none"], best[ref] - best["none"]
    # A round where the reference added nothing measurable (it ran no slower than no BPF) has no ratio.
    per_round = sorted((r[mode] - r["none"]) / (r[ref] - r["none"]) for r in rows if r[ref] > r["none"])
    if not per_round:
        per_round = [float("nan")]
    # The spread of the per-round ratios: on a shared VM one loop's time jitters by tens of ns, as
    # much as the few ns a filter adds over the empty programs; a ratio is only as good as this.
    quartiles = statistics.quantiles(per_round, n=4) if len(per_round) > 1 else [per_round[0]] * 3
    return {"added_ns": added, "ref_added_ns": added_ref, "ratio": added / max(added_ref, 1e-9),
            "ratio_median_of_rounds": statistics.median(per_round),
            "ratio_rounds_q1_q3": [quartiles[0], quartiles[2]]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=2_000_000, help="ioctl loop length")
    parser.add_argument("--open-iterations", type=int, default=500_000, help="openat+close loop length")
    parser.add_argument("--gpu-iterations", type=int, default=2_000_000, help="GPU RM_CONTROL loop length")
    parser.add_argument("--base", default=BASE_REV, help="commit whose programs run beside ('' for none)")
    parser.add_argument("--ops", default=",".join(OPS), help="operations to measure, of " + ",".join(OPS))
    parser.add_argument("--reps", type=int, default=7, help="rounds kept per operation")
    parser.add_argument("--max-wait-s", type=float, default=900, help="give up waiting for a quiet machine")
    parser.add_argument("--ignore-foreign", action="store_true",
                        help="keep rounds while others trace syscalls (a sanity check, not a figure)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "syscall_cost.json")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench_syscall_cost: needs root to load BPF programs", file=sys.stderr)
        return 2
    ops = tuple(op for op in OPS if op in args.ops.split(","))
    iterations = {"ioctl": args.iterations, "open": args.open_iterations, "gpu": args.gpu_iterations}
    workdir = Path(tempfile.mkdtemp(prefix="gg-bench-", dir="/tmp"))  # short: a device prefix
    gpu_node = str(workdir / "nvidiactl")
    os.mknod(gpu_node, 0o666 | 0o020000, os.makedev(1, 3))
    prefix = str(workdir / "nvidia")
    sources = [BpfSource((prefix,), holder_filter=f) for f in (True, False)]
    empty, peer = bench_program("empty.bpf.c"), bench_program("opensnoop_peer.bpf.c")
    peer[b"peer_events"].open_perf_buffer(lambda *_: None)  # opened, never read: see the peer's header
    rounds: dict[str, list[dict[str, float]]] = {op: [] for op in ops}
    rounds_wall: dict[str, list[dict[str, float]]] = {op: [] for op in ops}
    discarded, quiet = 0, (lambda: True) if args.ignore_foreign else (lambda: foreign_activity() == 0)
    base: BaseAttachment | None = None
    try:
        start_s = []
        for source in sources:
            source.start()
            start_s.append(source.start_s)
        modes: dict[str, Any] = {
            "none": None,
            "empty": Attachment(empty),
            "ghostgpu": Attachment(sources[0]._bpf),
            "ghostgpu_no_filter": Attachment(sources[1]._bpf),
        }
        if args.base:
            base = BaseAttachment(base_tree(args.base, workdir), prefix)
            OWN_PIDS.add(base.proc.pid)
            modes["ghostgpu_base"] = base
        tracepoints = {name: len(a.tracepoints) if isinstance(a, Attachment) else a.tracepoints
                       for name, a in modes.items() if a}
        exe = build_loop(workdir)
        deadline = time.monotonic() + args.max_wait_s
        for op in ops:
            op_modes = {**modes, "opensnoop": Attachment(peer)} if op == "open" else modes
            while len(rounds[op]) < args.reps and (args.ignore_foreign or wait_quiet(deadline)):
                cpu, wall = measure_round(exe, op_modes, op, iterations[op], len(rounds[op]) + discarded,
                                          gpu_node)
                if quiet():
                    rounds[op].append(cpu)
                    rounds_wall[op].append(wall)
                else:
                    discarded += 1
    finally:
        empty.cleanup()
        peer.cleanup()
        for source in sources:
            source.close()
        if base is not None:
            base.close()
        shutil.rmtree(workdir, ignore_errors=True)
    if not all(rounds.values()):
        print("bench_syscall_cost: other BPF programs stayed loaded; no clean round", file=sys.stderr)
        return 1

    best = {op: {m: min(r[m] for r in rounds[op]) for m in rounds[op][0]} for op in ops}
    all_modes = list(dict.fromkeys(m for op in ops for m in best[op]))
    summary: dict[str, Any] = {"ns_per_op": {m: {op: best[op].get(m) for op in ops} for m in all_modes},
                               "clock": "CLOCK_THREAD_CPUTIME_ID",
                               "iterations": {op: iterations[op] for op in ops}}
    print(f"{'CPU ns/op, best of ' + str(args.reps):<30}" + "".join(f"{op:>12}" for op in ops))
    for mode in all_modes:
        print(f"{mode:<30}" + "".join(f"{best[op][mode]:>12.1f}" if mode in best[op] else f"{'-':>12}"
                                      for op in ops))
    for mode in all_modes[1:]:
        summary[f"added_ns_{mode}"] = {op: best[op][mode] - best[op]["none"]
                                       for op in ops if mode in best[op]}
    for mode in ("ghostgpu", "ghostgpu_no_filter", "ghostgpu_base"):
        if mode not in all_modes:
            continue
        per_op = {op: summarize(rounds, mode, "empty", op) for op in ops}
        summary[f"ratio_{mode}_vs_empty"] = {op: per_op[op]["ratio"] for op in ops}
        summary[f"ratio_{mode}_vs_empty_median_of_rounds"] = {
            op: per_op[op]["ratio_median_of_rounds"] for op in ops}
        summary[f"ratio_{mode}_vs_empty_rounds_q1_q3"] = {op: per_op[op]["ratio_rounds_q1_q3"] for op in ops}
    if "open" in ops:
        vs_peer = summarize(rounds, "ghostgpu", "opensnoop", "open")
        summary["ratio_ghostgpu_vs_opensnoop"] = {"open": vs_peer["ratio"]}
        summary["ratio_ghostgpu_vs_opensnoop_median_of_rounds"] = {"open": vs_peer["ratio_median_of_rounds"]}
    if "ghostgpu_base" in all_modes:
        # What this tree adds to each operation against the base commit, side by side: the
        # difference of the bests, and the median of the per-round differences (drift-proof).
        summary["base_rev"] = args.base
        summary["added_ns_vs_base"] = {op: best[op]["ghostgpu"] - best[op]["ghostgpu_base"] for op in ops}
        summary["added_ns_vs_base_median_of_rounds"] = {
            op: statistics.median(r["ghostgpu"] - r["ghostgpu_base"] for r in rounds[op]) for op in ops}
    for name in all_modes[1:]:
        added = summary[f"added_ns_{name}"]
        print(f"{'added ' + name:<30}" + "".join(f"{added[op]:>12.1f}" if op in added else f"{'-':>12}"
                                                 for op in ops))
    for key in ("ratio_ghostgpu_vs_empty", "ratio_ghostgpu_vs_empty_median_of_rounds",
                "ratio_ghostgpu_vs_opensnoop", "ratio_ghostgpu_vs_opensnoop_median_of_rounds",
                "added_ns_vs_base", "added_ns_vs_base_median_of_rounds"):
        if key in summary:
            print(f"{key.replace('_median_of_rounds', ' (median)'):<45}"
                  + "  ".join(f"{op} {v:.2f}" for op, v in summary[key].items()))
    summary["goal_ratio"] = 1.3
    summary["goal_ratio_ioctl"] = 1.1  # the non-GPU ioctl, the busiest path the programs filter
    summary["goal_vs_opensnoop_below"] = 1.0
    summary["goal_gpu_added_ns_vs_base"] = 20
    summary["rounds"], summary["rounds_wall"] = rounds, rounds_wall
    summary["discarded_rounds"] = discarded
    summary["foreign_activity_ignored"] = args.ignore_foreign
    summary["tracepoints"] = tracepoints
    summary["start_s"] = start_s
    if base is not None:
        summary["start_s_base"] = base.start_s
    summary["machine"] = {"kernel": os.uname().release, "cpus": os.cpu_count(), "ts": time.time(),
                          "loadavg_1m_at_end": round(os.getloadavg()[0], 2)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {args.out} ({discarded} rounds discarded for other syscall tracing)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
