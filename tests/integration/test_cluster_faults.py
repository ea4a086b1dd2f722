"""Faults across the cluster, with real parts only: a collector killed mid-stream, a tracer killed
and restarted, containerd stopped and started again.

The collector is the real `ghostgpu collector` process (killed with SIGKILL, restarted on the same
database and port), tracers are real `ghostgpu tracer --collector` processes (BPF, /proc, a fake
NVML) that also write their JSON lines, and the CRI runtime is the real containerd of
tests/helpers/containerd.py, reached through the tracer's relay only.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.collector_env import QueryClient
from tests.helpers.collector_proc import CollectorProcess, cluster_rows, ghostgpu_cli, ps_json, wait_rows
from tests.helpers.container import FakeContainer
from tests.helpers.containerd import Containerd
from tests.helpers.fakenvml import FakeNvml
from tests.helpers.polling import wait_until
from tests.helpers.tracer_proc import Record, TracerProcess
from tests.helpers.wire_decode import event_to_record
from tests.helpers.workload import gpuwork_image, job_command
from tests.integration.conftest import GPU0_UUID

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns, pytest.mark.usefixtures("root_bpf")]

FAST = ["--grace-s", "0.5"]
DEADLINE_S = 30.0  # generous: a 2-core VM shared with other test runs
ROUNDS = 120  # open/close rounds per workload phase (gpuwork keeps at most 256 fds in its table)
NS = "ghost-faults"


def no_cri(tmp_path: Path) -> list[str]:
    """A CRI socket that does not exist: the holders' classes stay the node's own."""
    return ["--cri-endpoint", f"unix://{tmp_path}/no-runtime.sock"]


def connected(q: QueryClient, node: str) -> bool:
    return any(s.node == node and s.connected for s in q.status())


def all_events(q: QueryClient, node: str, instance_id: str) -> list[Any]:
    """ListEvents for one tracer instance, every page."""
    out: list[Any] = []
    while True:
        page = q.events(node=node, instance_id=instance_id, after_seq=out[-1].event.seq if out else 0,
                        limit=1000)  # ~2 MB a page: long command lines
        if not page:
            return out
        out.extend(page)


def event_key(rec: Record) -> tuple[Any, ...]:
    return (rec["event"], rec["ts"], rec.get("pid"), rec.get("device"), rec.get("class"), rec.get("what"))


def churn(first_fd: int) -> list[str]:
    """ROUNDS short holds of /dev/nvidia0: each is an open, a close and the consumer's finding and
    resolved records (pending within the grace period)."""
    steps: list[str] = []
    for i in range(first_fd, first_fd + ROUNDS):
        steps += ["open", "/dev/nvidia0", "sleep", "8", "close", str(i), "sleep", "8"]
    return steps


def test_collector_killed_mid_stream_and_restarted_gets_every_event_exactly_once(
        tmp_path: Path, fake_nvml: FakeNvml) -> None:
    node = "node-crash"
    (tmp_path / "tracer").mkdir()
    col = CollectorProcess(tmp_path / "collector")
    try:
        with TracerProcess(tmp_path / "tracer", [*FAST, *no_cri(tmp_path)], fake_nvml.env(), node,
                           col.address) as tracer, FakeContainer() as c:
            tracer.wait_ready(DEADLINE_S)
            with QueryClient(col.address) as q:
                wait_until(lambda: connected(q, node), "the tracer connected", DEADLINE_S)
                instance = q.node(node).instance_id
                # Phase 1 runs while the collector is killed and while it is away; phase 2 after it is back.
                p = c.run(["ready", *churn(0), "ready", "wait", *churn(ROUNDS), "ready", "wait"])
                p.wait_ready()

                def opens(kind: str = "open") -> list[Record]:
                    return tracer.matching(lambda r: r.get("event") == kind and r.get("pid") == p.host_pid)

                wait_until(lambda: len(opens()) >= 10, "the workload under way", DEADLINE_S)
                stored_before_kill = len(tracer.streamed())
                wait_until(lambda: q.node(node).last_seq >= stored_before_kill,
                           "the collector storing the workload's first events", DEADLINE_S)
            col.kill()
            at_kill = len(tracer.streamed())
            wait_until(lambda: len(tracer.streamed()) >= at_kill + 100, "events while the collector is away",
                       DEADLINE_S)
            col.start()  # the same database, port and socket
            restarted_s = time.time()
            p.wait_ready(DEADLINE_S)  # phase 1 done
            p.release()
            p.wait_ready(DEADLINE_S)  # phase 2 done, with the collector back
            wait_until(lambda: len(opens("close")) == 2 * ROUNDS, "the tracer's record of every close",
                       DEADLINE_S)

            with QueryClient(col.address) as q:  # a new channel: the old one backs off after the kill
                n_seen = 0

                def delivered() -> bool:
                    nonlocal n_seen
                    n_seen = len(tracer.streamed())
                    st = q.node(node)
                    return st.connected and st.instance_id == instance and st.last_seq == n_seen

                wait_until(delivered, "every streamed record stored after the restart", DEADLINE_S)
                stored = all_events(q, node, instance)
                st = q.node(node)
            records = tracer.streamed()  # read after: other tests' holders may have added some since

        seqs = [e.event.seq for e in stored]
        assert seqs == list(range(1, len(seqs) + 1)), "each seq once, none missing"
        assert n_seen <= len(seqs) <= len(records)
        assert all(e.instance_id == instance and e.node == node for e in stored)
        # The same records, by content: what the tracer wrote is what the collector stored.
        stored_keys = Counter(event_key(event_to_record(e.event, node).to_json()) for e in stored)
        assert stored_keys == Counter(event_key(r) for r in records[:len(seqs)])
        assert (st.events_lost_total, st.stats.spool_dropped_total) == (0, 0)
        assert st.events_ingested_total >= n_seen and st.stats.reconnects_total >= 1
        # The kill was mid-stream: the workload generated events before it, while the collector was
        # away, and after it came back.
        assert stored_before_kill <= at_kill < len(records)
        after = [r for r in records if r["event"] == "open" and r.get("pid") == p.host_pid
                 and r["ts"] > restarted_s]
        assert len(after) >= ROUNDS
        workload = Counter(e.event.holder.kind for e in stored
                           if e.event.HasField("holder") and e.event.holder.process.pid == p.host_pid)
        assert sorted(workload.values()) == [2 * ROUNDS, 2 * ROUNDS]  # every open and close, once
        assert col.starts == 2
    finally:
        col.stop()


def test_tracer_killed_and_restarted_recovers_the_nodes_state_from_its_snapshot(
        tmp_path: Path, fake_nvml: FakeNvml) -> None:
    node = "node-restart"
    args = [*FAST, *no_cri(tmp_path)]
    with CollectorProcess(tmp_path / "collector") as col, FakeContainer() as c1, FakeContainer() as c2, \
            QueryClient(col.unix_address) as q:
        stays = c1.run(["open", "/dev/nvidia0", "ready", "wait"])
        leaves = c2.run(["open", "/dev/nvidia0", "ready", "wait"])
        stays.wait_ready()
        leaves.wait_ready()
        pids = {stays.host_pid, leaves.host_pid}

        def hidden_pids() -> set[int]:
            rows = cluster_rows(q, node=node)
            return {r["pid"] for r in rows if r["pid"] in pids and r["class"] == "hidden"}

        (tmp_path / "t1").mkdir()
        first = TracerProcess(tmp_path / "t1", args, fake_nvml.env(), node, col.unix_address)
        try:
            wait_until(lambda: hidden_pids() == pids, "both holders hidden under the first tracer",
                       DEADLINE_S)
            first_instance = q.node(node).instance_id
            opened = {f.consumer.consumer.process.pid: f.id for f in q.findings(node=node)
                      if not f.resolved_unix_ns and f.consumer.consumer.process.pid in pids}
            assert set(opened) == pids
            first.kill()
            wait_until(lambda: not connected(q, node), "the node disconnected", DEADLINE_S)
            leaves.release()  # exits while no tracer watches: no event will ever say so
            wait_until(lambda: not c2.pids(), "the second holder gone", DEADLINE_S)
        finally:
            first.kill()

        (tmp_path / "t2").mkdir()
        with TracerProcess(tmp_path / "t2", args, fake_nvml.env(), node, col.unix_address):
            wait_until(lambda: connected(q, node) and q.node(node).instance_id != first_instance,
                       "the new tracer instance connected", DEADLINE_S)
            wait_until(lambda: hidden_pids() == {stays.host_pid}, "the state of the new snapshot", DEADLINE_S)
            rows = {r["pid"]: r for r in ps_json(col.address, "--node", node) if r["pid"] in pids}
            assert list(rows) == [stays.host_pid]
            assert (rows[stays.host_pid]["container_id"], rows[stays.host_pid]["gpu_uuid"]) == (
                c1.container_id, GPU0_UUID)
            st = q.node(node)
            assert st.connected and st.instance_id not in ("", first_instance)

            out = ghostgpu_cli("findings", "--collector", col.address, "-o", "json", "--node", node)
            assert out.returncode == 0, out.stderr
            history = {f["id"]: f for f in json.loads(out.stdout) if f["pid"] in pids}
        gone, held = history[opened[leaves.host_pid]], history[opened[stays.host_pid]]
        assert gone["pid"] == leaves.host_pid and gone["resolved"] is not None
        # The held consumer's finding never closed: the new snapshot held it again, same class.
        assert (held["pid"], held["class"], held["resolved"]) == (stays.host_pid, "hidden", None)
        assert [f["id"] for f in history.values() if f["pid"] == stays.host_pid] == [held["id"]]


# A GPU job that starts when told: the shell waits for /tmp/go, then execs gpuwork, which opens
# /dev/nvidia0 and allocates on it (one that only opened would be a `monitor`, not `hidden`).
LATE_HOLD = ["/bin/sh", "-c", "while [ ! -e /tmp/go ]; do sleep 0.05; done; exec " + " ".join(job_command())]


def test_containerd_down_events_flow_unresolved_then_resolve_when_it_returns(
        tmp_path: Path, fake_nvml: FakeNvml, containerd: Containerd) -> None:
    node = "node-ctd"
    (tmp_path / "tracer").mkdir()
    pod = containerd.run_pod("late-0", NS)
    try:
        # Created while containerd runs; it opens its /dev/nvidia0 only when told, once containerd is down.
        cid = containerd.create_container(pod, "cuda", LATE_HOLD, devices=[("/dev/null", "/dev/nvidia0")],
                                          image=containerd.import_variant(gpuwork_image()))
        init_pid = containerd.container_host_pid(cid)
        with CollectorProcess(tmp_path / "collector") as col, \
                TracerProcess(tmp_path / "tracer", [*FAST, "--cri-endpoint", containerd.endpoint],
                              fake_nvml.env(), node, col.address) as tracer, \
                QueryClient(col.address) as q:
            tracer.wait_ready(DEADLINE_S)
            wait_until(lambda: connected(q, node), "the tracer connected", DEADLINE_S)
            containerd.stop()
            try:
                Path(f"/proc/{init_pid}/root/tmp/go").touch()
                tracer.wait_for(lambda r: r.get("event") == "open" and r.get("container_id") == cid,
                                DEADLINE_S, "the holder's open")
                down = wait_rows(q, lambda r: r["container_id"] == cid and r["class"] == "hidden"
                                 and r["resolution"] == "unresolved" and "UNAVAILABLE" in r["cri_error"],
                                 "the holder hidden and unresolved", DEADLINE_S, node=node)
                instance = q.node(node).instance_id
                opened = [e for e in all_events(q, node, instance)
                          if e.event.HasField("holder") and e.event.holder.process.container_id == cid]
                assert opened, "the holder's events reach the collector while CRI is away"
                rows = [r for r in ps_json(col.address, "--node", node) if r["container_id"] == cid]
                assert {r["pid"] for r in down} <= {r["pid"] for r in rows}
                for r in rows:
                    assert (r["namespace"], r["pod"], r["container"], r["allocated"]) == (
                        "", "", "", "unknown")
                    assert (r["resolution"], r["class"], r["node_class"]) == (
                        "unresolved", "hidden", "hidden")
                    assert "CRI unreachable for node node-ctd" in r["cri_error"]
            finally:
                containerd.start()  # the same root: it recovers the running container
            back = wait_rows(q, lambda r: r["container_id"] == cid and r["resolution"] == "resolved",
                             "the holder resolved once containerd is back", DEADLINE_S, node=node)
            for r in back:
                assert (r["namespace"], r["pod"], r["container"], r["container_state"]) == (
                    NS, "late-0", "cuda", "CONTAINER_RUNNING")
                assert r["pod_uid"] == pod.uid and r["cri_error"] == "" and r["class"] == "hidden"
            assert containerd.container_host_pid(cid) == init_pid
    finally:
        containerd.start()
        containerd.remove_pod(pod.id)
