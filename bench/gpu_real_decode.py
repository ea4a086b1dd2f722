"""The Python half of bench/gpu_real_check.sh: decodes a recording of driver calls (bench/nvrecord.c)
with the project's own decoder (tracer/memcall_decode.py) and memory accountant (tracer/gpu_memory.py),
compares what the process holds with the driver's own figure (NVML's per-process used memory, or the
FUSE fake driver's truth file), checks that CARD_INFO's minor numbers are the device instances the
process allocated, checks `ghostgpu snapshot -o json`, and writes bench/results/gpu_real.json.

Runs with a bare python3 (no venv: a GPU machine has the driver, python3 and a compiler, and
nothing else is assumed): when `ghostgpu` is not installed, the repository's folders are mapped in
as ghostgpu.tracer and ghostgpu.cli, as pyproject.toml's package-dir does.

    python3 bench/gpu_real_decode.py decode --recording REC [--pid PID] [--nvml-apps CSV]
        [--nvml-gpus CSV] [--truth JSON] [--snapshot JSON] ... --out bench/results/gpu_real.json
    python3 bench/gpu_real_decode.py snapshot          # ghostgpu snapshot -o json, through the mapping
    .venv/bin/python bench/gpu_real_decode.py fake-record --out-dir DIR   # root, FUSE: see below
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GOAL_PCT = 5.0  # the goal: the driver-call figure within 5% of NVML's
MIB = 1 << 20
GIB = 1 << 30


def map_repository() -> None:
    """Make ghostgpu.tracer / ghostgpu.cli importable from this checkout when ghostgpu is not
    installed: the repository root joins the package's path (pyproject.toml maps tracer/ and cli/
    in as ghostgpu.tracer and ghostgpu.cli)."""
    try:
        import ghostgpu.tracer.memcalls
        return
    except ImportError:
        pass
    sys.path.insert(0, str(ROOT))
    import ghostgpu

    if str(ROOT) not in ghostgpu.__path__:
        ghostgpu.__path__.append(str(ROOT))


def fail(message: str) -> int:
    print(f"gpu_real_decode: {message}", file=sys.stderr)
    return 2


# --- reading the recording -------------------------------------------------------------------


def read_lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, JSON object) of each line; a torn last line (the program was still writing)
    is left out, any other bad line is an error naming it."""
    lines = path.read_text().splitlines()
    for n, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            yield n, json.loads(text)
        except json.JSONDecodeError as exc:
            if n == len(lines):
                return
            raise ValueError(f"{path}:{n}: not a JSON line ({exc.msg}): record it again") from None


def decode_recording(path: Path, driver: str | None, max_objects: int | None,
                     fallback: str | None = None) -> dict[str, Any]:
    """Everything the recording says: the MemCalls (decoded as the kernel side would), the
    accountant fed with them, CARD_INFO's GPUs, GET_ID_INFO(_V2)'s device instances, the device
    instances the process allocated, and the device files it opened."""
    map_repository()
    from ghostgpu.tracer.gpu_memory import MemoryAccountant
    from ghostgpu.tracer.memcall_decode import (
        RecordedIoctl,
        RecordError,
        RecordingDecoder,
        card_infos,
        gpu_id_instance,
        parse_record,
    )
    from ghostgpu.tracer.memcalls import MemCallKind

    objects = list(read_lines(path))
    starts = [o for _, o in objects if o.get("ev") == "start"]
    if driver is None:  # the recording's (nvrecord reads /sys/module/nvidia/version), else NVML's
        driver = next((str(o["driver"]) for o in starts if o.get("driver")), fallback)
    decoder = RecordingDecoder(driver)
    accountant = MemoryAccountant(max_objects) if max_objects else MemoryAccountant()
    kinds: Counter[str] = Counter()
    errors: list[str] = []
    cards: dict[int, dict[str, Any]] = {}
    id_info: dict[int, int] = {}
    instances: set[int] = set()
    opened: set[str] = set()
    ioctls = 0
    for n, obj in objects:
        if obj.get("ev") == "open" and obj.get("dev"):
            opened.add(str(obj["dev"]))
        try:
            rec = parse_record(obj)
            if rec is None:
                continue
            call = decoder.feed(rec)
        except RecordError as exc:
            errors.append(f"line {n}: {exc}")
            continue
        if isinstance(rec, RecordedIoctl):
            ioctls += 1
            for card in card_infos(rec):
                cards[card.gpu_id] = {"gpu_id": card.gpu_id, "minor": card.minor,
                                      "pci_bus_id": card.pci_bus_id}
            pair = gpu_id_instance(rec, decoder.offsets)
            if pair is not None:
                id_info[pair[0]] = pair[1]
        if call is None:
            continue
        kinds[MemCallKind(call.kind).name] += 1
        if call.kind == MemCallKind.ALLOC and call.h_class == 0x80 and call.instance is not None:
            instances.add(call.instance)
        accountant.apply(call)
    return {"driver": driver, "accountant": accountant, "kinds": dict(sorted(kinds.items())),
            "errors": errors, "lines": len(objects), "ioctls": ioctls,
            "cards": sorted(cards.values(), key=lambda c: c["minor"]), "id_info": id_info,
            "instances": sorted(instances), "opened": sorted(opened), "params_unread": decoder.params_unread,
            "pids": list(dict.fromkeys(int(o["pid"]) for o in starts if "pid" in o))}  # in order


# --- the driver's own figures ----------------------------------------------------------------


def bus_key(bus_id: str) -> str:
    """A PCI bus id as one key: nvidia-smi writes 00000000:3B:00.0, CARD_INFO's decode 0000:3b:00.0."""
    parts = bus_id.strip().lower().split(":")
    if len(parts) != 3:
        return bus_id.strip().lower()
    return f"{int(parts[0], 16):04x}:{parts[1]}:{parts[2]}"


def nvml_apps(csv_path: Path) -> dict[int, dict[str, int]]:
    """nvidia-smi --query-compute-apps=pid,gpu_bus_id,used_memory (MiB) -> {pid: {bus key: bytes}}."""
    out: dict[int, dict[str, int]] = {}
    for line in csv_path.read_text().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 3 or not fields[0].isdigit() or not fields[2].isdigit():
            continue
        per_bus = out.setdefault(int(fields[0]), {})
        per_bus[bus_key(fields[1])] = per_bus.get(bus_key(fields[1]), 0) + int(fields[2]) * MIB
    return out


def nvml_of(listed: dict[int, dict[str, int]], pid: int) -> dict[str, int] | None:
    """NVML's figures for the process; None when NVML does not list its PID. NVML reports PIDs as
    the driver's (host) PID namespace sees them: a check run in a PID namespace of its own sees
    another number, and any other process NVML lists is not this one, so nothing is compared."""
    return listed.get(pid)


def nvml_gpus(csv_path: Path) -> list[dict[str, Any]]:
    """nvidia-smi --query-gpu=index,uuid,pci.bus_id,name,memory.used,memory.total,driver_version."""
    gpus = []
    for line in csv_path.read_text().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 7 or not fields[0].isdigit():
            continue
        used, total = (int(f) * MIB if f.isdigit() else None for f in fields[4:6])
        gpus.append({"index": int(fields[0]), "uuid": fields[1], "pci_bus_id": bus_key(fields[2]),
                     "name": fields[3], "memory_used_bytes": used, "memory_total_bytes": total,
                     "driver_version": fields[6]})
    return gpus


def read_truth(truth_path: Path) -> dict[str, Any]:
    """The FUSE fake driver's state file (fake-record's truth.json); ValueError, one line, when it is
    not one."""
    try:
        state = json.loads(truth_path.read_text())
    except OSError as exc:
        raise ValueError(f"--truth {truth_path}: cannot read it ({exc.strerror or exc})") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"--truth {truth_path}: not JSON ({exc.msg}, line {exc.lineno}): give the fake "
                         "driver's state file (fake-record's truth.json)") from exc
    if not isinstance(state, dict) or not isinstance(state.get("clients", []), list):
        raise ValueError(f"--truth {truth_path}: not the fake driver's state file (no \"clients\" list): "
                         "give fake-record's truth.json")
    return state


def truth_held(state: dict[str, Any], pid: int) -> dict[int, int]:
    """The FUSE fake driver's state -> {GPU: bytes} held by the clients of pid."""
    out: dict[int, int] = {}
    try:
        for client in state.get("clients", []):
            if int(client.get("pid", -1)) != pid:
                continue
            for gpu, held in (client.get("gpus") or {}).items():
                out[int(gpu)] = out.get(int(gpu), 0) + int(held)
    except (AttributeError, TypeError, ValueError) as exc:
        raise ValueError(f"--truth: a client entry is not the fake driver's ({exc}): give fake-record's "
                         "truth.json") from exc
    return out


# --- comparing -------------------------------------------------------------------------------


def diff_pct(decoded: int | None, reference: int | None) -> float | None:
    """(decoded - reference) in % of the reference; 0 when both are 0, None when only one is."""
    if decoded is None or reference is None:
        return None
    if reference == 0:
        return 0.0 if decoded == 0 else None
    return round(100.0 * (decoded - reference) / reference, 3)


def snapshot_check(snapshot_path: Path | None, error: str, pid: int, apps: dict[str, int],
                   gpus: list[dict[str, Any]], bus_of_minor: dict[int, str]) -> dict[str, Any]:
    """Whether `ghostgpu snapshot -o json` carried NVML's figure for the process and its GPUs."""
    if snapshot_path is None or not snapshot_path.exists() or error:
        return {"ok": False, "error": error or "no snapshot was taken"}
    try:
        consumers = json.loads(snapshot_path.read_text() or "null")
    except json.JSONDecodeError as exc:
        return {"ok": False, "error": f"snapshot output is not JSON: {exc.msg}"}
    if not isinstance(consumers, list):
        return {"ok": False, "error": "snapshot output is not a list of consumers"}
    mine = [c for c in consumers if c.get("pid") == pid]
    rows = []
    for c in mine:
        minor = c.get("gpu_minor")
        nvml = apps.get(bus_of_minor.get(minor, "")) if minor is not None else None
        rows.append({"gpu": c.get("gpu"), "gpu_minor": minor, "gpu_uuid": c.get("gpu_uuid"),
                     "class": c.get("class"), "gpu_memory_bytes": c.get("gpu_memory_bytes"),
                     "allocated_bytes": c.get("allocated_bytes"), "nvml_bytes": nvml,
                     "nvml_figure_through": nvml is not None and c.get("gpu_memory_bytes") is not None
                     and abs(int(c["gpu_memory_bytes"]) - nvml) < MIB})
    seen_uuids = sorted({str(c.get("gpu_uuid")) for c in consumers if c.get("gpu_uuid")})
    listed = sorted(g["uuid"] for g in gpus)
    lost = any(not r["nvml_figure_through"] for r in rows)
    problems = [f"no consumer with PID {pid} in the snapshot" if not rows else "",
                "NVML's figure did not come through" if lost else "",
                "GPUs NVML does not list" if not set(seen_uuids) <= set(listed) else ""]
    return {"ok": not any(problems), "error": "; ".join(p for p in problems if p),
            "consumers_total": len(consumers), "process_rows": rows, "gpu_uuids_seen": seen_uuids,
            "gpu_uuids_nvml": listed}


def machine(driver: str | None, gpus: list[dict[str, Any]]) -> dict[str, Any]:
    return {"kernel": platform.release(), "driver_version": driver,
            "gpu_name": ", ".join(sorted({g["name"] for g in gpus})) or None, "gpus": len(gpus),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def cmd_decode(args: argparse.Namespace) -> int:
    recording = Path(args.recording)
    if not recording.is_file():
        return fail(f"no recording at {recording}: record one with bench/gpu_real_check.sh, or give its path")
    gpus = nvml_gpus(Path(args.nvml_gpus)) if args.nvml_gpus else []
    try:
        found = decode_recording(recording, args.driver, args.max_objects,
                                 next((g["driver_version"] for g in gpus), None))
    except (OSError, ValueError) as exc:
        return fail(str(exc))
    pid = args.pid if args.pid is not None else (found["pids"][0] if found["pids"] else None)
    if pid is None:
        return fail(f"{recording} has no start line naming the process: pass --pid PID")
    accountant = found["accountant"]
    held: dict[int | None, int] = accountant.held(pid)
    bus_of_minor = {c["minor"]: bus_key(c["pci_bus_id"]) for c in found["cards"]}
    for g in gpus:  # without CARD_INFO in the recording, NVML's index stands for the minor
        bus_of_minor.setdefault(g["index"], g["pci_bus_id"])
    if args.truth:
        reference_name = "fake driver's state file"
        try:
            state = read_truth(Path(args.truth))
            reference = truth_held(state, pid)
        except ValueError as exc:
            return fail(str(exc))
        fake_version = state.get("driver", "?")
        apps: dict[str, int] = {}
    elif args.nvml_apps:
        reference_name = "NVML per-process used memory (nvidia-smi --query-compute-apps, MiB)"
        listed = nvml_apps(Path(args.nvml_apps))
        found_apps = nvml_of(listed, pid)
        if found_apps is None:
            return fail(f"NVML lists no PID {pid} (it lists {sorted(listed) or 'none'}): run the check in "
                        "the host's PID namespace, or pass --pid with the PID NVML shows for the program")
        apps = found_apps
        minor_of_bus = {bus: minor for minor, bus in bus_of_minor.items()}
        reference = {minor_of_bus.get(bus, -1): b for bus, b in apps.items()}
    else:
        return fail("nothing to compare with: pass --nvml-apps CSV (a GPU run) or --truth JSON "
                    "(the fake driver)")
    # The decoded figure is per device instance; the reference per GPU minor. Instance == minor is
    # the assumption checked below (instances_vs_minors).
    per_gpu = []
    for gpu in sorted({*(k for k in held if k is not None), *reference}):
        decoded, ref = held.get(gpu, 0), reference.get(gpu)
        pct = diff_pct(decoded, ref)
        per_gpu.append({"gpu": gpu, "decoded_bytes": decoded, "reference_bytes": ref, "diff_pct": pct,
                        "within_goal": pct is not None and abs(pct) <= GOAL_PCT})
    decoded_total = sum(held.values())
    reference_total = sum(reference.values())
    total_pct = diff_pct(decoded_total, reference_total)
    minors = {c["gpu_id"]: c["minor"] for c in found["cards"]}
    pairs = [{"gpu_id": gid, "device_instance": inst, "minor": minors.get(gid)}
             for gid, inst in sorted(found["id_info"].items())]
    checked = [p for p in pairs if p["minor"] is not None]
    # Without GET_ID_INFO(_V2) in the recording, the weaker check: the GPU files the process opened
    # (/dev/nvidiaN: minor N) are the device instances it allocated.
    opened_minors = sorted({int(name[len("nvidia"):]) for name in (Path(d).name for d in found["opened"])
                            if name.startswith("nvidia") and name[len("nvidia"):].isdigit()})
    result = {
        "what": "GPU memory per process from the driver's calls (tracer/memcall_decode.py + "
                "tracer/gpu_memory.py on an LD_PRELOAD recording) against the driver's own figure",
        "driver": args.driver_label or f"NVIDIA {found['driver'] or 'unknown'}",
        "machine": machine(found["driver"], gpus) if not args.truth else {
            **machine(None, []), "driver_version": f"none: the fake driver answered {fake_version}'s layouts",
            "gpu_name": "none: tests/helpers/fakedriver (FUSE) served nvidiactl, nvidia0, nvidia1"},
        "note": ("NOT a GPU run: the calls went to the FUSE fake driver, whose own state file stands in "
                 "for NVML" if args.truth else "a real NVIDIA driver and GPU"),
        "program": args.program,
        "requested": json.loads(args.requested) if args.requested else None,
        "pid": pid,
        "reference": reference_name,
        "goal": f"decoded within {GOAL_PCT:g}% of the reference",
        "per_gpu": per_gpu,
        "total": {"decoded_bytes": decoded_total, "reference_bytes": reference_total, "diff_pct": total_pct,
                  "within_goal": total_pct is not None and abs(total_pct) <= GOAL_PCT},
        "held_unattributed_bytes": held.get(None, 0),
        "shared_bytes": sum(accountant.shared(pid).values()),
        "incomplete": accountant.incomplete(pid),
        "recording": {"file": str(recording), "lines": found["lines"], "ioctls": found["ioctls"],
                      "memcalls": found["kinds"], "decode_errors": found["errors"][:20],
                      "decode_errors_total": len(found["errors"]),
                      "alloc_params_unread": found["params_unread"],
                      "objects_tracked": accountant.objects,
                      "objects_dropped": accountant.dropped_objects_total},
        "instances_vs_minors": {
            "card_info": found["cards"], "gpu_id_to_instance": pairs,
            "device_instances_allocated": found["instances"], "device_files_opened": found["opened"],
            "instance_equals_minor": (all(p["device_instance"] == p["minor"] for p in checked)
                                      if checked else None),
            "gpu_files_opened_minors": opened_minors,
            "opened_minors_are_instances": (opened_minors == found["instances"]
                                            if opened_minors and found["instances"] else None),
            "instances_listed_by_card_info": (set(found["instances"]) <= {c["minor"] for c in found["cards"]}
                                              if found["cards"] and found["instances"] else None),
        },
        "kernel_side": (json.loads(Path(args.kernel_check).read_text()) if args.kernel_check
                        else {"ran": False, "note": "not run: this check needs no BPF"}),
        "snapshot": snapshot_check(Path(args.snapshot) if args.snapshot else None, args.snapshot_error or "",
                                   pid, apps, gpus, bus_of_minor) if not args.truth else
        {"ok": None, "error": "not run: the fake driver has no NVML (tests/fakenvml is another fake)"},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"wrote {out}")
    return 0 if result["total"]["within_goal"] else 1


def print_table(result: dict[str, Any]) -> None:
    print(f"driver: {result['driver']}; program: {result['program']}; pid {result['pid']}")
    print(f"{'gpu':>4} {'decoded MiB':>12} {'reference MiB':>14} {'diff %':>8}  goal")
    for row in [*result["per_gpu"], {"gpu": "all", **result["total"]}]:
        ref = row["reference_bytes"]
        print(f"{row['gpu']!s:>4} {row['decoded_bytes'] / MIB:>12.1f} "
              f"{'-' if ref is None else f'{ref / MIB:.1f}':>14} "
              f"{'-' if row['diff_pct'] is None else row['diff_pct']:>8}  "
              f"{'ok' if row['within_goal'] else 'MISSED'}")
    check = result["instances_vs_minors"]
    print(f"reference: {result['reference']}; memcalls {result['recording']['memcalls']}; "
          f"instance == minor (GET_ID_INFO(_V2)): {check['instance_equals_minor']}; opened /dev/nvidiaN == "
          f"instances: {check['opened_minors_are_instances']}; snapshot ok: {result['snapshot'].get('ok')}; "
          f"kernel side's MemCalls equal: {result['kernel_side'].get('equal', 'not run')}")


def cmd_snapshot(_args: argparse.Namespace) -> int:
    map_repository()
    from ghostgpu.cli.main import main

    return main(["snapshot", "-o", "json"])


# What rmplan does in the fake driver's run: the calls a CUDA process makes to start and to
# cudaMalloc 1, 4 and 16 GiB, then cudaFree of the 4 GiB one (one RM_ALLOC of
# NV01_MEMORY_LOCAL_USER per allocation under the device; RM_FREE of it), with a context's own
# buffers (an RM_ALLOC and a VID_HEAP_CONTROL allocation), a VA space and a system-memory
# allocation (neither counts), one allocation the driver refuses (NV_ERR_NO_MEMORY: counts
# nothing), and one wrapped in XFER and one in NVOS64 (the other block paths). "FAIL" marks the
# step the driver is told to fail first.
FAKE_PLAN = (
    "open ctl", "version", "card-info", "client", "attach", "open gpu 0", "register-fd 0",
    "device 0 as dev", "subdevice", "control", "alloc 0x90F1 parent=$dev",
    "alloc-mem 0 2097152", "heap-alloc 0 1048576", "alloc-mem none 65536 class=0x3E",
    "alloc-mem 0 1073741824 as m1", "alloc-mem 0 4294967296 xfer as m4",
    "FAIL alloc-mem 0 34359738368", "alloc-mem 0 17179869184 nvos64 as m16", "free $m4",
)
FAKE_REQUESTED = {"alloc_gib": [1, 4, 16], "free_gib": [4], "refused_gib": [32],
                  "context_bytes": {"rm_alloc": 2 << 20, "heap_alloc_rounded_up_from": 1 << 20},
                  "not_counted": ["FERMI_VASPACE_A (0x90F1)", "NV01_MEMORY_SYSTEM (0x3E) 64 KiB"]}


def start_kernel_side(prefix: Path) -> tuple[Any, str]:
    """The tracer's kernel side (BpfSource) watching the fake driver's files, or why it cannot run
    (no root, no bcc, ...): the fake run then also says whether it reported the same MemCalls."""
    map_repository()
    try:
        from ghostgpu.tracer.bpf_source import BpfSource, BpfUnavailable
    except ImportError as exc:
        return None, f"not run: {exc}"
    source = BpfSource((str(prefix),), max_fds=4096, ringbuf_pages=16)
    try:
        source.start()
    except BpfUnavailable as exc:
        return None, f"not run: {exc}"
    return source, ""


def kernel_check(source: Any, note: str, held: bytes, pid: int, driver_version: str,
                 timeout_s: float = 5.0) -> dict[str, Any]:
    """The kernel side's MemCalls for pid against the decoder's from the recording (timestamps
    aside: the kernel stamps at the syscall's entry, nvrecord just before it). The decoder reads the
    blocks with the layouts of the version the fake driver answered (tracer/nvabi.py), as the kernel
    side does."""
    if source is None:
        return {"ran": False, "note": note}
    from dataclasses import asdict, replace

    from ghostgpu.tracer.memcall_decode import RecordingDecoder, parse_record

    decoder = RecordingDecoder(driver_version)
    decoded = [c for c in (decoder.feed(r) for r in (parse_record(json.loads(line))
                                                     for line in held.decode().splitlines() if line.strip())
                           if r is not None) if c is not None]
    kernel: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while len(kernel) < len(decoded) and time.monotonic() < deadline:
        source.poll(50)  # waits up to 50 ms for the ring buffer
        kernel.extend(c for c in source.take_memcalls() if c.pid == pid)
    bare = [replace(c, ts_ns=0) for c in kernel], [replace(c, ts_ns=0) for c in decoded]
    mismatches = [{"kernel": asdict(k), "decoder": asdict(d)} for k, d in zip(*bare, strict=False) if k != d]
    return {"ran": True, "kernel_memcalls": len(kernel), "decoder_memcalls": len(decoded),
            "equal": bare[0] == bare[1], "mismatches": mismatches[:10]}


def cmd_fake_record(args: argparse.Namespace) -> int:
    """A recording through the FUSE fake driver (tests/helpers/fakedriver.py): rmplan, under
    nvrecord, runs FAKE_PLAN; the driver's state file, read while rmplan holds, is the truth.
    Writes recording.jsonl, truth.json, program.txt and requested.json into --out-dir. Root,
    FUSE and the project venv (the fake driver's wrapper lives in tests/helpers)."""
    sys.path.insert(0, str(ROOT))
    from tests.helpers.fakedriver import FakeDriver, FakeDriverError, fuse_unavailable
    from tests.helpers.rmplan import RmPlan

    reason = fuse_unavailable()
    if reason is not None:
        return fail(f"the fake driver cannot run here: {reason}")
    out_dir = Path(args.out_dir)
    recording = out_dir / "recording.jsonl"
    recording.unlink(missing_ok=True)
    try:
        with FakeDriver() as driver:
            source, kernel_note = start_kernel_side(driver.mount_dir / "nvidia")
            try:
                env = {**os.environ, "LD_PRELOAD": str(Path(args.nvrecord).resolve()),
                       "NVRECORD_OUT": str(recording), "NVRECORD_MATCH": str(driver.mount_dir)}
                with RmPlan(None, dev_dir=str(driver.mount_dir), driver=driver.driver, env=env) as plan:
                    for step in FAKE_PLAN:
                        refuse = step.startswith("FAIL ")
                        if refuse:
                            driver.fail_alloc(1)
                        got = plan.step(step.removeprefix("FAIL "))
                        if refuse != (got.get("status") not in (None, 0)):
                            return fail(f"fake driver run: step {step!r} answered {got}")
                    plan.step("ready")
                    truth = driver.state().raw
                    held = recording.read_bytes()  # every call so far: nvrecord writes before returning
                    (out_dir / "truth.json").write_text(json.dumps({**truth, "pid": plan.pid}, indent=1))
                    check = kernel_check(source, kernel_note, held, plan.pid, driver.driver)
                    (out_dir / "kernel_check.json").write_text(json.dumps(check, indent=1))
                    plan.finish()
            finally:
                if source is not None:
                    source.close()
    except FakeDriverError as exc:
        return fail(str(exc))
    recording.write_bytes(held)
    program = "tests/helpers/rmplan.c under bench/nvrecord.c: " + "; ".join(FAKE_PLAN)
    (out_dir / "program.txt").write_text(program)
    (out_dir / "requested.json").write_text(json.dumps(FAKE_REQUESTED))
    print(f"recorded {len(held.splitlines())} lines through the fake driver at {driver.mount_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    dec = sub.add_parser("decode", help="decode a recording and compare it with the driver's figure")
    dec.add_argument("--recording", required=True)
    dec.add_argument("--pid", type=int, help="the process to compare (default: the recording's first)")
    dec.add_argument("--driver", help="driver version for the block layouts (default: the recording's)")
    dec.add_argument("--driver-label", help="what the JSON's `driver` says (default: NVIDIA <version>)")
    dec.add_argument("--nvml-apps", help="nvidia-smi --query-compute-apps=pid,gpu_bus_id,used_memory CSV")
    dec.add_argument("--nvml-gpus", help="nvidia-smi --query-gpu=index,uuid,pci.bus_id,name,memory.used,"
                     "memory.total,driver_version CSV")
    dec.add_argument("--truth", help="the FUSE fake driver's state JSON, instead of NVML")
    dec.add_argument("--snapshot", help="ghostgpu snapshot -o json output taken while the process held")
    dec.add_argument("--snapshot-error", help="why no snapshot could be taken")
    dec.add_argument("--program", default="", help="what made the allocations")
    dec.add_argument("--requested", help='JSON: what the program asked for, e.g. {"alloc_gib": [1, 4, 16]}')
    dec.add_argument("--kernel-check", help="fake-record's kernel_check.json (the kernel side's MemCalls)")
    dec.add_argument("--max-objects", type=int, help="the accountant's bound (default: its own)")
    dec.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_real.json"))
    sub.add_parser("snapshot", help="ghostgpu snapshot -o json, with the repository mapped in")
    fake = sub.add_parser("fake-record", help="record through the FUSE fake driver (root)")
    fake.add_argument("--out-dir", required=True)
    fake.add_argument("--nvrecord", required=True, help="the built nvrecord.so")
    args = parser.parse_args(argv)
    handlers = {"decode": cmd_decode, "snapshot": cmd_snapshot, "fake-record": cmd_fake_record}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
