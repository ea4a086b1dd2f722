"""Connection floods against the real `ghostgpu collector` process, on 127.0.0.1 only,
bounded in count and time:

- 1,080 idle TCP connections that never start a TLS handshake, from 40 loopback addresses, to the
  mTLS port of a collector whose RLIMIT_NOFILE is 1024 (soft and hard: raising the soft limit to the
  hard one cannot help there). An admin's `ghostgpu ps` and a tracer's Hello must still get in, and
  the collector must stay below its fd limit. Before the TCP gate (collector/tcpgate.py) gRPC accepted
  until EMFILE and both were locked out.
- The same collector's soft fd limit, started at 1024 under a higher hard limit, is raised to the hard
  one (ghostgpu/common/system/fdlimit.py)."""

from __future__ import annotations

import os
import resource
import socket
import sys
import time
from pathlib import Path

import pytest
from ghostgpu.collector.tcpgate import default_max_connections

from tests.helpers.certs import Pki
from tests.helpers.collector_proc import CollectorProcess, ghostgpu_cli, tls_flags
from tests.helpers.polling import wait_until
from tests.helpers.sim_tracer import SimTracer

POLICY = """
rules:
  - role: admin
    subjects: ["user:admin"]
  - role: tracer
    subjects: ["node:*"]
"""
FLOOD = 1080
SOURCES = 40  # 127.0.1.1 .. 127.0.1.40: more addresses than the per-source cap lets one hold
FD_LIMIT = 1024


def _raise_own_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.fail(f"this test holds {need} sockets; the hard fd limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def _collector_under_prlimit(workdir: Path, limit: str, args: list[str],
                             monkeypatch: pytest.MonkeyPatch) -> CollectorProcess:
    """CollectorProcess, its python started through `prlimit --nofile=LIMIT`."""
    wrapper = workdir.parent / f"python-prlimit-{limit.replace(':', '-')}"
    wrapper.write_text(f"#!/bin/sh\nexec prlimit --nofile={limit} -- {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(wrapper))
    try:
        return CollectorProcess(workdir, unix=False, args=args)
    finally:
        monkeypatch.undo()


def _nofile(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError(f"no 'Max open files' in /proc/{pid}/limits")


def _collector_pid(col: CollectorProcess) -> int:
    assert col.proc is not None
    return col.proc.pid  # prlimit execs python: the same pid


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path / "pki")


def _connections(pid: int, port: int) -> int:
    """The process's open descriptors that are connections accepted on `port` (sockets whose
    /proc/net/tcp or tcp6 row has that local port and is not the listener), as the gate counts them."""
    inodes = set()
    for name in ("tcp", "tcp6"):
        with open(f"/proc/net/{name}") as f:
            for row in f.read().splitlines()[1:]:
                fields = row.split()
                if fields[3] != "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}") in inodes
        except FileNotFoundError:  # closed meanwhile
            continue
    return count


def _accept_queue(port: int) -> int:
    """Connections waiting in the accept queue of the listener on `port` (a LISTEN row's rx_queue in
    /proc/net/tcp, or tcp6: gRPC may listen on 127.0.0.1 through an IPv6 socket); -1 while no such
    listener is there."""
    for name in ("tcp", "tcp6"):
        with open(f"/proc/net/{name}") as f:
            for row in f.read().splitlines()[1:]:
                fields = row.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    return int(fields[4].split(":")[1], 16)
    return -1


def test_idle_flood_on_the_mtls_port_locks_out_neither_admins_nor_tracers(
        tmp_path: Path, pki: Pki, monkeypatch: pytest.MonkeyPatch, open_sockets: list[socket.socket]) -> None:
    _raise_own_fd_limit(FLOOD + 512)
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    server = pki.write("collector", pki.collector())
    admin = tls_flags(pki.write("user-admin", pki.user("admin")))
    node = pki.write("node-a", pki.node("node-a"))
    col = _collector_under_prlimit(tmp_path / "collector", f"{FD_LIMIT}:{FD_LIMIT}",
                                   [*tls_flags(server), "--policy", str(policy)], monkeypatch)
    with col:
        pid = _collector_pid(col)
        assert _nofile(pid) == (FD_LIMIT, FD_LIMIT)
        port = col.port
        started = time.monotonic()
        for i in range(FLOOD):  # idle: connected, never a byte of TLS
            s = socket.socket()
            s.bind((f"127.0.1.{i % SOURCES + 1}", 0))
            s.settimeout(5.0)
            try:
                s.connect(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            open_sockets.append(s)
        assert len(open_sockets) >= FLOOD * 0.9, (
            f"only {len(open_sockets)} of {FLOOD} flood connections got through")
        # The collector has taken them all off its accept queue (an attacker would keep them open).
        wait_until(lambda: _accept_queue(port) == 0, "the flood accepted by the collector", 30.0)
        assert col.running, col.stderr()
        # ... and its gate has closed the flood's surplus down to its cap: until then gRPC's connection
        # quota (the cap plus a slack) may be full and refuses every newcomer at accept
        # (collector/tcpgate.py). The gate looks every 0.1 s, slower on a loaded machine; an admin
        # arriving in that moment retries as any client does. (The process's descriptor count is no
        # measure of it: the quota keeps that under any bound the fds would show from the start.)
        cap = default_max_connections(FD_LIMIT)
        wait_until(lambda: _connections(pid, port) <= cap, f"the gate to trim the flood to {cap} connections",
                   30.0)
        # The flood is still open (the last ones are younger than gRPC's handshake deadline), and:
        out = ghostgpu_cli("ps", "--collector", col.address, "-o", "json", *admin, timeout_s=60.0)
        assert out.returncode == 0, f"admin locked out under the flood: {out.stderr.strip()}"
        tracer = SimTracer(col.address, "node-a", tls=node)
        try:
            welcome = tracer.connect(timeout_s=15.0)
            assert welcome is not None
        finally:
            tracer.close()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        assert fds < FD_LIMIT - 64, f"the collector holds {fds} descriptors under the flood"
        assert time.monotonic() - started < 60.0
        assert col.running, col.stderr()


def test_the_collector_raises_its_soft_fd_limit_to_the_hard_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    col = _collector_under_prlimit(tmp_path / "collector", f"{FD_LIMIT}:{FD_LIMIT * 8}", [], monkeypatch)
    with col:
        assert _nofile(_collector_pid(col)) == (FD_LIMIT * 8, FD_LIMIT * 8)
