"""`ghostgpu faults`: the GPU faults (Xid) the collector stored, with the pods each one hit.

    ghostgpu faults [--since 1h] [-n NAMESPACE] [--node NODE] [-o table|wide|json]

One row per fault: when the tracer read it, the node, the GPU, the Xid, its severity and meaning
from the tracer's Xid catalogue, and the pods it hit (namespace/pod, the process the driver named
first); a line user space wrote to /dev/kmsg (a drill, a test: origin "user") says so in MEANING.
`-o wide` adds the PIDs, the containers, the ORIGIN and the driver's message; `-o json` is a list of
objects with the keys of `fault_json` (README.md, "ghostgpu faults"). A collector that cannot be
reached is one line and exit status 1; a bad flag one line and exit status 2. When the collector left
older faults out of its answer to keep it within the message size, a line on stderr says so.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from ghostgpu.cli.client import ClientError, Query
from ghostgpu.cli.view import Column, table

from ghostgpu.common.model.display import LISTING_ID_LEN, fault_id, hit_notes, hit_pods, hit_where, short_id
from ghostgpu.common.model.durations import LOOK_BACK, parse_duration_s
from ghostgpu.v1 import query_pb2

OUTPUTS = ("table", "wide", "json")


def _opt(value: int) -> int | None:
    """The proto's -1 (none) as None."""
    return None if value < 0 else value


def hit_note(hit: query_pb2.FaultHit) -> str:
    """What became of the hit's process or container by then ("" when it ran on), as findings say."""
    c, k8s = hit.consumer, hit.k8s
    return ", ".join(hit_notes(c.exited, k8s.resolution, k8s.container_state, c.process.container_id))


def pods_text(cf: query_pb2.ClusterFault) -> str:
    """The pods (or containers, or the host) a fault hit, each once, the named process's first."""
    out: dict[str, None] = {}
    for h in cf.hits:
        note = hit_note(h)
        where = hit_where(h.k8s.namespace, h.k8s.pod, h.consumer.process.container_id)
        out[where + (f" ({note})" if note else "")] = None
    return ", ".join(out) or "-"


def hit_json(hit: query_pb2.FaultHit) -> dict[str, Any]:
    c, k8s = hit.consumer, hit.k8s
    p = c.process
    return {"pid": p.pid, "comm": p.comm, "named": c.named, "exited": c.exited, "gpu": _opt(c.gpu),
            "container_id": p.container_id, "namespace": k8s.namespace, "pod": k8s.pod,
            "container": k8s.container, "resolution": k8s.resolution or "none",
            "container_state": k8s.container_state, "note": hit_note(hit)}


def fault_json(cf: query_pb2.ClusterFault) -> dict[str, Any]:
    """One fault as `-o json` prints it; these keys are a contract (README.md, "ghostgpu faults")."""
    f = cf.fault
    pods = [f"{ns}/{pod}" for ns, pod in hit_pods((h.k8s.namespace, h.k8s.pod) for h in cf.hits)]
    return {"id": cf.id, "time": cf.ts_unix_ns / 1e9, "node": cf.node, "gpu": _opt(f.gpu),
            "gpu_uuid": f.gpu_uuid, "pci_bus_id": f.pci_bus_id, "xid": _opt(f.xid), "severity": f.severity,
            "meaning": f.meaning, "message": f.message, "pid": f.pid or None, "process_name": f.process_name,
            "pods": pods, "hits": [hit_json(h) for h in cf.hits], "raw": f.raw, "kmsg_seq": f.kmsg_seq,
            "fault_id": fault_id(cf.boot_id, f.kmsg_seq, f.ts_ns), "origin": origin(cf)}


def origin(cf: query_pb2.ClusterFault) -> str:
    """Who wrote the fault's kernel log line: "kernel" (the driver; unset from an older tracer) or
    "user" (user space wrote it to /dev/kmsg: tracer/faults.py)."""
    return cf.fault.origin or "kernel"


def meaning_text(cf: query_pb2.ClusterFault) -> str:
    f = cf.fault
    text = f.meaning or ("line did not parse" if f.xid < 0 else "-")
    # A drill's line must not read as the driver's: the table says it in the row itself.
    return f"{text} (written by user space)" if origin(cf) == "user" else text


def _stamp(unix_ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix_ns / 1e9))


def _columns(wide: bool) -> list[Column[query_pb2.ClusterFault]]:
    cols: list[Column[query_pb2.ClusterFault]] = [
        ("TIME", lambda cf: _stamp(cf.ts_unix_ns)),
        ("NODE", lambda cf: cf.node),
        ("GPU", lambda cf: "-" if cf.fault.gpu < 0 else str(cf.fault.gpu)),
        ("XID", lambda cf: "?" if cf.fault.xid < 0 else str(cf.fault.xid)),
        ("SEVERITY", lambda cf: cf.fault.severity or "unknown"),
        ("MEANING", meaning_text),
        ("PODS", pods_text),
    ]
    if wide:
        cols += [
            ("PIDS", lambda cf: ",".join(f"{h.consumer.process.pid}({h.consumer.process.comm or '?'})"
                                         for h in cf.hits) or "-"),
            ("CONTAINERS", lambda cf: ",".join(dict.fromkeys(
                h.k8s.container or short_id(h.consumer.process.container_id, LISTING_ID_LEN) or "-"
                for h in cf.hits)) or "-"),
            ("ORIGIN", origin),
            ("MESSAGE", lambda cf: cf.fault.message or cf.fault.raw or "-"),
        ]
    return cols


def faults_table(faults: Sequence[query_pb2.ClusterFault], wide: bool = False) -> str:
    rows = sorted(faults, key=lambda cf: (cf.ts_unix_ns, cf.id))
    return table(_columns(wide), rows, "(no GPU faults in this window)")


def render(faults: Sequence[query_pb2.ClusterFault], output: str) -> str:
    if output == "json":
        rows = sorted(faults, key=lambda cf: (cf.ts_unix_ns, cf.id))
        return json.dumps([fault_json(cf) for cf in rows], indent=2)
    return faults_table(faults, wide=output == "wide")


def check_output(output: str) -> str:
    """-o's value, or a ValueError naming the flag and its choices (one line, exit status 2, as every
    bad flag of this command; argparse's `choices` would print the whole usage)."""
    if output not in OUTPUTS:
        raise ValueError(f"-o {output!r}: not an output of ghostgpu faults; use one of {', '.join(OUTPUTS)}")
    return output


def cmd_faults(args: argparse.Namespace) -> int:
    since_s = parse_duration_s(args.since, "--since", LOOK_BACK)  # bad flags fail before any connection
    output = check_output(args.output)
    if args.limit is not None and args.limit < 0:
        raise ValueError(f"--limit {args.limit}: must be 0 (the collector's default) or more")
    query = Query.from_args(args)
    try:
        since_ns = int((time.time() - since_s) * 1e9)
        answer = query.faults(since_ns, node=args.node or "", namespace=args.namespace or "",
                              limit=args.limit or 0)
    except ClientError as exc:
        print(f"ghostgpu: {exc}", file=sys.stderr)
        return 1
    finally:
        query.close()
    print(render(answer.faults, output))
    if answer.left_out:
        # On stderr: -o json stays one document on stdout.
        print(f"ghostgpu: {answer.left_out} older faults left out to keep the answer within the message "
              "size: use --since/--limit for fewer", file=sys.stderr)
    return 0
