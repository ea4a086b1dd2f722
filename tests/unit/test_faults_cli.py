"""`ghostgpu faults`: the table, wide and JSON views of stored GPU faults (pure functions of ClusterFault
messages, table-driven), and the command against a real collector fed by a simulated tracer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from ghostgpu.cli.faults import fault_json, faults_table, hit_note, pods_text, render
from ghostgpu.cli.main import main
from ghostgpu.collector import query

from ghostgpu.v1 import query_pb2
from tests.helpers.collector_env import running_collector
from tests.helpers.fault_events import TRAIN, Names, fault_event, fault_record, hit
from tests.helpers.sim_tracer import SimTracer

JSON_KEYS = ["id", "time", "node", "gpu", "gpu_uuid", "pci_bus_id", "xid", "severity", "meaning", "message",
             "pid", "process_name", "pods", "hits", "raw", "kmsg_seq", "fault_id", "origin"]
HIT_KEYS = ["pid", "comm", "named", "exited", "gpu", "container_id", "namespace", "pod", "container",
            "resolution", "container_state", "note"]


def _hit(pid: int, *, namespace: str = "", pod: str = "", container_id: str = "", resolution: str = "none",
         container_state: str = "", exited: bool = False, named: bool = False) -> query_pb2.FaultHit:
    h = query_pb2.FaultHit()
    h.consumer.process.pid, h.consumer.process.comm = pid, "python3"
    h.consumer.process.container_id = container_id
    h.consumer.named, h.consumer.exited, h.consumer.gpu = named, exited, 0
    h.k8s.namespace, h.k8s.pod, h.k8s.container = namespace, pod, "trainer" if pod else ""
    h.k8s.resolution, h.k8s.container_state = resolution, container_state
    return h


def _fault(*hits: query_pb2.FaultHit, xid: int = 79, gpu: int = 0, fid: int = 1,
           ts_unix_ns: int = 1_700_000_000_000_000_000) -> query_pb2.ClusterFault:
    cf = query_pb2.ClusterFault(id=fid, node="gpu-node-1", ts_unix_ns=ts_unix_ns)
    f = cf.fault
    f.xid, f.gpu, f.gpu_uuid, f.severity = xid, gpu, "GPU-0", "critical"
    # The message as tracer/xid.py hands it on: the driver's pid= and name= fields read apart.
    f.meaning, f.message = "GPU has fallen off the bus", "GPU has fallen off the bus."
    f.raw = "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python3, GPU has fallen off the bus."
    cf.hits.extend(hits)
    return cf


RUNNING = _hit(4242, namespace="ml", pod="train-7", container_id="1a" * 32, resolution="resolved",
               container_state="CONTAINER_RUNNING", named=True)
EXITED = _hit(99, namespace="ml", pod="eval-2", container_id="2b" * 32, resolution="resolved",
              container_state="CONTAINER_EXITED")
GONE = _hit(98, container_id="3c" * 32, resolution="not_found", exited=True)
PENDING = _hit(97, container_id="4d" * 32, resolution="unresolved")
HOST = _hit(7)


@pytest.mark.parametrize(("hit", "note"), [
    (RUNNING, ""), (EXITED, "container exited"), (GONE, "exited, container gone"),
    (PENDING, "CRI did not answer"), (HOST, ""),
])
def test_hit_note_says_what_became_of_it(hit: query_pb2.FaultHit, note: str) -> None:
    assert hit_note(hit) == note


@pytest.mark.parametrize(("hits", "text"), [
    ((RUNNING, EXITED), "ml/train-7, ml/eval-2 (container exited)"),
    ((RUNNING, RUNNING), "ml/train-7"),  # one pod once
    ((GONE, HOST), "container 3c3c3c3c3c3c3 (exited, container gone), host"),
    ((), "-"),
])
def test_pods_text_names_each_pod_once_named_first(hits: tuple[query_pb2.FaultHit, ...], text: str) -> None:
    assert pods_text(_fault(*hits)) == text


def test_table_has_one_row_per_fault_oldest_first_and_wide_adds_pids_containers_message() -> None:
    later = _fault(HOST, xid=-1, gpu=-1, fid=2, ts_unix_ns=1_700_000_060_000_000_000)
    later.fault.meaning = later.fault.message = ""
    lines = faults_table([later, _fault(RUNNING, EXITED)]).splitlines()
    assert lines[0].split() == ["TIME", "NODE", "GPU", "XID", "SEVERITY", "MEANING", "PODS"]
    assert "gpu-node-1  0    79   critical  GPU has fallen off the bus  ml/train-7, ml/eval-2" in lines[1]
    assert "gpu-node-1  -    ?    critical  line did not parse" in lines[2]
    wide = faults_table([_fault(RUNNING)], wide=True).splitlines()
    assert wide[0].split()[-4:] == ["PIDS", "CONTAINERS", "ORIGIN", "MESSAGE"]
    assert wide[1].endswith("4242(python3)  trainer     kernel  GPU has fallen off the bus.")
    assert faults_table([]).splitlines()[-1] == "(no GPU faults in this window)"


def test_a_user_written_line_says_so_in_the_table_wide_and_json() -> None:
    drill = _fault(RUNNING)
    drill.fault.origin = "user"
    line = faults_table([drill]).splitlines()[1]
    assert "GPU has fallen off the bus (written by user space)  ml/train-7" in line
    assert "  user    GPU has fallen off the bus." in faults_table([drill], wide=True).splitlines()[1]
    assert fault_json(drill)["origin"] == "user"
    assert fault_json(_fault(RUNNING))["origin"] == "kernel"  # unset (an older tracer): the driver's


def test_json_is_a_list_of_objects_with_stable_keys() -> None:
    (row,) = json.loads(render([_fault(RUNNING, GONE)], "json"))
    assert list(row) == JSON_KEYS
    assert (row["xid"], row["gpu"], row["severity"], row["pods"]) == (79, 0, "critical", ["ml/train-7"])
    assert [list(h) for h in row["hits"]] == [HIT_KEYS, HIT_KEYS]
    assert row["hits"][1]["note"] == "exited, container gone"
    unparsed = fault_json(_fault(xid=-1, gpu=-1))
    assert (unparsed["xid"], unparsed["gpu"], unparsed["pid"], unparsed["hits"]) == (None, None, None, [])


# ---- the command against a real collector ----------------------------------------------------------------


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["faults", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_faults_names_the_pods_a_fault_hit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with running_collector(tmp_path, resolver_factory=Names) as c:
        with SimTracer(c.address, "gpu-node-1") as t:
            t.connect()
            xid = fault_record(affected=(hit(4242, TRAIN, named=True), hit(7)))
            other = fault_record(xid=13, severity="warning", affected=(hit(7),), origin="user")
            t.wait_acked(t.send_events([fault_event(1, xid), fault_event(2, other)]))
        code, out, err = _run(capsys, "--collector", c.address, "-o", "json")
        assert (code, err) == (0, "")
        rows: list[dict[str, Any]] = json.loads(out)
        assert [(r["xid"], r["pods"], r["origin"]) for r in rows] == [(79, ["ml/train-7"], "kernel"),
                                                                     (13, [], "user")]
        code, out, _ = _run(capsys, "--collector", c.address, "-n", "ml")
        assert code == 0 and len(out.splitlines()) == 2 and "ml/train-7, host" in out
        code, out, _ = _run(capsys, "--collector", c.address, "--since", "1s", "--node", "other")
        assert code == 0 and out.splitlines()[-1] == "(no GPU faults in this window)"


@pytest.mark.parametrize(("argv", "line"), [
    (["--since", "soon"], "ghostgpu: --since 'soon'"),
    (["--limit", "-1"], "ghostgpu: --limit -1: must be 0 (the collector's default) or more"),
    (["-o", "yaml"], "ghostgpu: -o 'yaml': not an output of ghostgpu faults; use one of table, wide, json"),
])
def test_a_bad_flag_is_one_line_and_exit_2(argv: list[str], line: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "--collector", "127.0.0.1:1", *argv)
    assert (code, out) == (2, "") and err.startswith(line) and err.count("\n") == 1


def test_an_unreachable_collector_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "--collector", "127.0.0.1:1")
    assert code == 1 and err.count("\n") == 1
    assert err.startswith("ghostgpu: cannot reach the collector at 127.0.0.1:1")


def test_faults_left_out_by_the_answer_size_are_said(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    one = fault_event(1, fault_record()).ByteSize()
    monkeypatch.setattr(query, "EVENTS_RESPONSE_BYTES", 2 * one + 200)  # room for the newest two
    with running_collector(tmp_path, resolver_factory=Names) as c:
        with SimTracer(c.address, "gpu-node-1") as t:
            t.connect()
            events = [fault_event(s, fault_record(xid=s), ts_unix_ns=s) for s in (1, 2, 3, 4)]
            t.wait_acked(t.send_events(events))
        code, out, err = _run(capsys, "--collector", c.address, "--since", "100000d", "-o", "json")
        assert code == 0 and [r["xid"] for r in json.loads(out)] == [3, 4]  # the newest that fit
        assert err == ("ghostgpu: 2 older faults left out to keep the answer within the message size: use "
                       "--since/--limit for fewer\n")


@pytest.mark.parametrize(("sizes", "budget", "kept"), [
    ((), 100, 0),
    ((10, 10, 10), 100, 3),  # each counts 8 bytes more (the field's tag and length)
    ((40, 40, 40), 100, 2),
    ((120, 10), 100, 1),  # one over the budget still goes alone
])
def test_within_bytes(sizes: tuple[int, ...], budget: int, kept: int) -> None:
    items = [query_pb2.ClusterFault(node="n" * (n - 2)) for n in sizes]  # n bytes: tag, length, n-2 chars
    assert [i.ByteSize() for i in items] == list(sizes)
    assert query.within_bytes(items, budget) == kept
