"""Measure the smallest capability set of the node tracer (tracer/capabilities.py, the DaemonSet).

    sudo .venv/bin/python bench/caps_probe.py            # every phase, about 5 minutes
    sudo .venv/bin/python bench/caps_probe.py --quick    # phases B-D only

Starts the real `ghostgpu tracer` as root under setpriv with a reduced bounding set (what a container
gets from `capabilities: {drop: [ALL], add: [...]}`), with GPU holders planted first
(tests/helpers/capsprobe.py), and records per run: BPF loaded, /readyz, each planted holder found
by the first /proc scan, a later open reported by the kernel side, /proc/PID/map_files readable,
and the tracer's own "CAP_X missing" lines.

- A: the full set (this process's bounding set) less one capability at a time. A capability whose
  loss breaks nothing here is either unneeded or covered by a broader one still present
  (CAP_SYS_ADMIN covers CAP_BPF and CAP_PERFMON), so A alone cannot find the set.
- B: exactly tracer/capabilities.NEEDED: everything must work.
- C: NEEDED less one at a time: each must break something, and the tracer must name it.
- E: NEEDED connects to a root:root 0660 unix socket in a 0700 directory (the CRI runtime's and
  kubelet's PodResources sockets): uid 0 owns them, so CAP_DAC_OVERRIDE is not needed.
- F: NEEDED in a mount namespace where / and tracefs are read-only and /tmp is a tmpfs (the DaemonSet's
  readOnlyRootFilesystem, read-only tracefs mount and /tmp emptyDir): BPF still loads.
- D: NEEDED with RLIMIT_MEMLOCK at 64 KiB: the BPF maps are charged to the memory cgroup (Linux
  >= 5.11), so CAP_SYS_RESOURCE (raising the limit) is not needed.
Prints a table; writes bench/results/caps.json. Exit 1 when B, C or D disagree with NEEDED.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ghostgpu.tracer.capabilities import NEEDED, NEEDED_NAMES  # noqa: E402

from bench.common import RESULTS_DIR, interrupt_on_sigterm, machine, preflight  # noqa: E402
from tests.helpers.capsprobe import (  # noqa: E402
    CaseResult,
    PlantedHolders,
    bounding_names,
    readonly_check,
    run_case,
    socket_check,
)

MEMLOCK_BYTES = 64 * 1024


def _row(phase: str, label: str, r: CaseResult) -> str:
    verdict = "ok" if not r.broken else "; ".join(r.broken)
    return f"{phase:<2} {label:<28} {verdict}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip phase A (the full set less one)")
    parser.add_argument("--out", default=str(RESULTS_DIR / "caps.json"))
    args = parser.parse_args(argv)
    missing = preflight()
    if missing:
        print(f"caps_probe: {missing}", file=sys.stderr)
        return 2
    interrupt_on_sigterm()
    full = bounding_names()
    needed = set(NEEDED_NAMES)
    out: dict[str, Any] = {"needed": list(NEEDED_NAMES), "full_set": full,
                           "not_in_this_bounding_set": sorted(set(NEEDED_NAMES) - set(full))}
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="caps-probe-") as tmp, PlantedHolders(Path(tmp)) as holders:
        work = Path(tmp)
        print(f"planted holders: {holders.planted}; full set: {len(full)} capabilities", flush=True)
        if not args.quick:
            out["full_less_one"] = {}
            for cap in full:
                r = run_case(work / f"a-{cap}", set(full) - {cap}, holders)
                out["full_less_one"][cap] = r.to_json()
                print(_row("A", f"-{cap}", r), flush=True)
        exact = run_case(work / "b", needed, holders)
        out["needed_only"] = exact.to_json()
        print(_row("B", "NEEDED only", exact), flush=True)
        if exact.broken or exact.capability_lines:
            problems.append(f"NEEDED alone is not enough: {exact.broken or exact.capability_lines}")
        out["needed_less_one"] = {}
        for need in (n for n in NEEDED if n.name in NEEDED_NAMES):  # CAP_SYSLOG only with --bpf off
            r = run_case(work / f"c-{need.name}", needed - {need.name}, holders)
            out["needed_less_one"][need.name] = r.to_json()
            print(_row("C", f"-{need.name}", r), flush=True)
            if not r.broken:
                problems.append(f"{need.name} is in NEEDED but nothing broke without it")
            if need.line not in r.capability_lines:
                problems.append(f"without {need.name} the tracer did not say {need.line!r}")
        out["needed_runtime_socket"] = socket_check(needed, work)
        print(f"E  NEEDED, root 0660 socket    {out['needed_runtime_socket']}", flush=True)
        if out["needed_runtime_socket"] != "ok":
            problems.append(f"the CRI/PodResources-like socket: {out['needed_runtime_socket']}")
        readonly = readonly_check(needed)
        out["needed_readonly_root_and_tracefs"] = readonly
        print(f"F  NEEDED, read-only / and tracefs  {readonly}", flush=True)
        if '"bpf":true' not in readonly:
            problems.append(f"read-only root filesystem and tracefs: {readonly}")
        memlock = run_case(work / "d", needed, holders, memlock_bytes=MEMLOCK_BYTES)
        out["needed_memlock_64k"] = memlock.to_json()
        print(_row("D", "NEEDED, memlock 64 KiB", memlock), flush=True)
        if memlock.broken:
            problems.append(f"with RLIMIT_MEMLOCK {MEMLOCK_BYTES}: {memlock.broken}")
    out["problems"] = problems
    out["machine"] = machine()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    for line in problems:
        print(f"PROBLEM: {line}")
    print(f"wrote {args.out}")
    return 1 if problems else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
