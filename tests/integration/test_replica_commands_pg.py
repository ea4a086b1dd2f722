"""Two collector replicas on one PostgreSQL (the real server, tests/helpers/postgres.py): a trace
started on replica A for a pod whose node streams to replica B. A resolves the scope through B (a
CRI call handed over in replica_commands), B's tracer receives the trace_start, the records it sends
are stored by B and read back on A, a container started since reaches it as trace_update, and a
stop on A reaches B's tracer (collector/replica_commands.py,
collector/trace_guests.py). And the hand-over on NOTIFY alone, polls and sweeps kept out of reach."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import grpc
import pytest
from ghostgpu.collector.main import Collector
from ghostgpu.collector.notify import Notifier
from ghostgpu.collector.replica_commands import ReplicaCommand, ReplicaCommands, ReplicaTiming
from ghostgpu.collector.store import Store

from ghostgpu.v1 import trace_pb2
from tests.helpers.cri_fake import FakeCri
from tests.helpers.polling import wait_until
from tests.helpers.replicas import TRAINER_CID
from tests.helpers.replicas import replica as shared_replica
from tests.helpers.sim_tracer import SimTracer, trace_record
from tests.helpers.trace_env import FAST, TRACE_CAPS, TraceClient, cri_via

pytestmark = pytest.mark.postgres

CID, CID2 = TRAINER_CID, "cd" * 32
DEADLINE_S = 20.0  # a hand-over takes a sweep (0.1 s) and a poll; generous for a loaded 2-core VM
S = trace_pb2.TraceStatus


def replica(tmp_path: Path, dsn: str, name: str,
            **settings: Any) -> contextlib.AbstractContextManager[Collector]:
    return shared_replica(tmp_path, dsn, name, settings=settings, trace_timing=FAST)


def test_a_trace_started_on_one_replica_runs_on_the_tracer_of_another(
        tmp_path: Path, postgres_dsn: str, trainer_runtime: FakeCri) -> None:
    with replica(tmp_path, postgres_dsn, "a") as a, replica(tmp_path, postgres_dsn, "b") as b, \
            TraceClient(a.address) as qa, SimTracer(b.address, "gpu-7", cri=cri_via(trainer_runtime),
                                                    capabilities=TRACE_CAPS) as t:
        t.connect()
        wait_until(lambda: "gpu-7" in b.leases.held, "replica b holding gpu-7's lease", DEADLINE_S)
        s = qa.start(namespace="ml", pod="trainer-0", duration_ms=60_000)
        assert (s.status, list(s.nodes), list(s.container_ids)) == (S.TRACE_STATUS_RUNNING, ["gpu-7"], [CID])
        start = t.wait_trace_command("trace_start", s.id).trace_start
        assert (list(start.container_ids), start.deadline_unix_ns) == ([CID], s.deadline_unix_ns)
        assert t.commands[0][0] == "ListContainers"  # a's scope, resolved through b (again as it runs)

        t.send_trace(s.id, [trace_record(container_id=CID) for _ in range(3)])
        wait_until(lambda: qa.session(s.id).records_total == 3, "replica a counting what b stored",
                   DEADLINE_S)
        records, shown = qa.show(s.id)
        assert [(r.seq, r.node, r.namespace, r.pod, r.container) for r in records] == [
            (n, "gpu-7", "ml", "trainer-0", "train") for n in (1, 2, 3)]
        assert shown.requested_by == s.requested_by

        trainer_runtime.add_container(CID2, "sb-ml-trainer-0", "sidecar")  # a container started since
        update = t.wait_trace_command("trace_update", s.id, timeout_s=DEADLINE_S).trace_update
        assert sorted(update.container_ids) == sorted([CID, CID2])
        t.send_trace(s.id, [trace_record(container_id=CID2)])
        wait_until(lambda: qa.session(s.id).records_total == 4, "the sidecar's record counted", DEADLINE_S)
        assert qa.show(s.id)[0][-1].container == "sidecar"  # named, as on a node of its own

        stopped = qa.stop(s.id)
        assert t.wait_trace_command("trace_stop", s.id).trace_stop.session == s.id
        assert (stopped.status, stopped.records_total) == (S.TRACE_STATUS_STOPPED, 4)
        assert [e.action for e in a.trace_audit(s.id)] == ["start", "stop"]  # audited where the user called


def test_the_tracer_refusing_on_another_replica_is_the_callers_error(
        tmp_path: Path, postgres_dsn: str, trainer_runtime: FakeCri) -> None:
    with replica(tmp_path, postgres_dsn, "a") as a, replica(tmp_path, postgres_dsn, "b") as b, \
            TraceClient(a.address) as qa, SimTracer(b.address, "gpu-7", cri=cri_via(trainer_runtime),
                                                    capabilities=TRACE_CAPS) as t:
        t.connect()
        wait_until(lambda: "gpu-7" in b.leases.held, "replica b holding gpu-7's lease", DEADLINE_S)
        t.trace_errors["trace_start"] = "limit: node gpu-7 runs 4 trace sessions, the limit"
        code, details = qa.start_error(pid=4242, node="gpu-7")
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert details == "node gpu-7 runs 4 trace sessions, the limit"
        (failed,) = qa.sessions()
        assert failed.status == S.TRACE_STATUS_FAILED and "limit" in failed.status_detail


class FakeStream:
    node, active, cri_relay = "gpu-7", True, True


def test_a_command_is_handed_over_and_answered_on_notices_alone(postgres_dsn: str) -> None:
    """The sweep and the sender's polls an hour apart: only the NOTIFY of the row and of its answer
    can bring it back within the deadline."""
    notice_only = ReplicaTiming(sweep_s=3600.0, first_poll_s=3600.0, max_poll_s=3600.0)
    stores = {name: Store(postgres_dsn, 1000, 7, replica_id=name) for name in ("a", "b")}
    notifiers = {name: Notifier(store.url, None, name, wait_s=0.05) for name, store in stores.items()}

    async def main() -> bytes:
        loop = asyncio.get_running_loop()
        a = ReplicaCommands(stores["a"], notifiers["a"], "a", {}, timing=notice_only)
        b = ReplicaCommands(stores["b"], notifiers["b"], "b", {"gpu-7": FakeStream()}, timing=notice_only)

        async def upper(cmd: ReplicaCommand) -> bytes:
            return cmd.payload.upper()

        b.handle("upper", upper)
        for name, r in (("a", a), ("b", b)):
            notifiers[name].start(loop)
            r.start()
        try:
            for n in notifiers.values():
                assert await asyncio.to_thread(n.wait_listening, DEADLINE_S)
            # the command's own deadline an hour away too: it is answered within ours, or not at all
            sent = a.send("gpu-7", "upper", b"through the notices", 3600.0)
            return await asyncio.wait_for(sent, DEADLINE_S)
        finally:
            a.close()
            b.close()

    try:
        assert asyncio.run(main()) == b"THROUGH THE NOTICES"
    finally:
        for n in notifiers.values():
            n.stop()
        for store in stores.values():
            store.close()
