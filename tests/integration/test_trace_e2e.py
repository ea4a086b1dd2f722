"""`ghostgpu trace` end to end, as a user runs it: the real CLI asks a real collector, which starts
the session on a real tracer (BPF), whose records come back decoded, live and afterwards
(`trace show`), with `trace list`, a Chrome trace file, and the collector killed mid-session (the
tracer still ends the session at its deadline)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers.collector_proc import REPO, CollectorProcess, _clean_env
from tests.helpers.fake_collector import FakeCollector
from tests.helpers.fakenvml import FakeNvml
from tests.helpers.gpucalls import NODES_MMAP, GpuCalls, GpuCallsOptions
from tests.helpers.polling import wait_until
from tests.helpers.tracer_proc import TracerProcess

pytestmark = pytest.mark.usefixtures("root_bpf")


class LiveTrace:
    """`ghostgpu trace ...` running, its stderr read as it comes (the "running until" line says the
    session is started on the tracers: StartTrace has returned)."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "ghostgpu.cli", "trace", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                     env=_clean_env())
        self.err: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line)

    def wait_running(self) -> None:
        wait_until(lambda: any("running until" in line for line in self.err), what="the session started",
                   timeout_s=30)

    def finish(self, timeout_s: float = 30.0) -> tuple[int, str, str]:
        assert self.proc.stdout is not None
        out = self.proc.stdout.read()
        rc = self.proc.wait(timeout_s)
        self._reader.join(timeout_s)
        return rc, out, "".join(self.err)


def cli(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ghostgpu.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=REPO, env=_clean_env())


def test_trace_a_process_from_the_cli_and_show_it_again(tmp_path: Path, fake_nvml: FakeNvml) -> None:
    chrome = tmp_path / "trace.json"
    with CollectorProcess(tmp_path, unix=False) as coll, \
            TracerProcess(tmp_path, ["--grace-s", "0.5"], fake_nvml.env(), node_name="n1",
                          collector=coll.address) as tracer:
        tracer.wait_ready()
        opts = GpuCallsOptions(driver=fake_nvml.driver_version, private_dev=NODES_MMAP)
        with GpuCalls(opts) as run:
            pid = run.wait_ready().pid
            live = LiveTrace("--collector", coll.address, "--node", "n1", "--pid", str(pid), "--for", "4s",
                             "-o", "jsonl", "--chrome-trace", str(chrome))
            live.wait_running()
            assert "running" in cli("trace", "list", "--collector", coll.address).stdout
            run.release()
            issued = run.finish()
            rc, out, err = live.finish()
        assert rc == 0, err
        records = [json.loads(line) for line in out.splitlines()]
        want = [(x["tid"], x["call"], x["cmd_name"], x["class_name"], x["nv_status_name"])
                for x in issued if x["kind"] == "ioctl"]
        got = [(r["tid"], r["call"], r["cmd_name"], r["class_name"], r["nv_status_name"])
               for r in records if r["kind"] == "ioctl"]
        assert sorted(got) == sorted(want) and len(got) == 27
        for tid in {t for t, *_ in want}:
            assert [g for g in got if g[0] == tid] == [w for w in want if w[0] == tid]  # per thread, in order
        session = records[0]["session"]
        shown = cli("trace", "show", session, "--collector", coll.address, "-o", "json")
        assert shown.returncode == 0, shown.stderr
        doc = json.loads(shown.stdout)
        assert doc["session"]["status"] == "completed" and len(doc["records"]) == len(records)
        assert doc["session"]["requested_by"] == "uid:0"  # the loopback socket's owner (collector/peers.py)
        events = json.loads(chrome.read_text())["traceEvents"]
        slices = [e for e in events if e["ph"] == "X"]
        assert len(slices) == 27 and all(e["dur"] > 0 and e["pid"] == pid for e in slices)


def test_a_session_ends_at_its_deadline_with_the_collector_gone(tmp_path: Path, fake_nvml: FakeNvml) -> None:
    """The collector that started it is killed: the tracer still ends the session on time."""
    from ghostgpu.v1 import stream_pb2, trace_pb2

    with FakeCollector() as fc, TracerProcess(tmp_path, [], fake_nvml.env(), collector=fc.target) as tracer:
        tracer.wait_ready()
        wait_until(lambda: any("trace" in r.msg.hello.capabilities for r in fc.messages("hello")),
                   what="Hello", timeout_s=15)
        fc.send_command(stream_pb2.Command(id=7, trace_start=trace_pb2.TraceStart(
            session="t-gone", pid=tracer.proc.pid, deadline_unix_ns=time.time_ns() + 1_500_000_000)))
        wait_until(lambda: fc.messages("result"), what="the start answered", timeout_s=10)
        fc.stop()
        wait_until(lambda: "trace session t-gone ended (deadline)" in tracer.stderr(),
                   what="the tracer ending the session itself", timeout_s=10)


def test_a_tracer_lost_mid_session_ends_it_as_node_lost_with_records_kept(tmp_path: Path,
                                                                          fake_nvml: FakeNvml) -> None:
    with CollectorProcess(tmp_path, unix=False) as coll, \
            TracerProcess(tmp_path, ["--grace-s", "0.5"], fake_nvml.env(), node_name="n1",
                          collector=coll.address) as tracer:
        tracer.wait_ready()
        opts = GpuCallsOptions(driver=fake_nvml.driver_version, private_dev=NODES_MMAP, hold=True)
        with GpuCalls(opts) as run:
            pid = run.wait_ready().pid
            live = LiveTrace("--collector", coll.address, "--node", "n1", "--pid", str(pid), "--for", "60s",
                             "-o", "jsonl")
            live.wait_running()
            run.release()
            run.wait_done()

            def stored() -> int:
                listed = json.loads(cli("trace", "list", "--collector", coll.address, "-o", "json").stdout)
                return listed[0]["records_total"] if listed else 0

            wait_until(lambda: stored() >= 27, what="the records stored", timeout_s=20)
            tracer.kill()
            _rc, out, err = live.finish()
            run.release()
        session = json.loads(out.splitlines()[0])["session"]
        shown = json.loads(cli("trace", "show", session, "--collector", coll.address, "-o", "json").stdout)
        assert shown["session"]["status"] == "node lost" and "n1" in shown["session"]["status_detail"]
        assert len(shown["records"]) == shown["session"]["records_total"] >= 27
        assert "node lost" in err
