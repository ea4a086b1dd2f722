"""Attacks by another local user, run with the real programs: the real
`ghostgpu collector`, `ghostgpu ps`, `ghostgpu audit` and `ghostgpu tracer`, the attacker a process of
uid 65534 (docs/SECURITY.md, "Threats and what stops them").

- the unix gate: uid 65534 binds the names the unix gate relays through before the gate does;
- data at rest: uid 65534 reads the collector's store and audit file;
- a fake collector: uid 65534 runs a collector of its own on the address root's clients dial.

Nothing sleeps to wait for a result: every wait polls with a deadline.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import require_root
from tests.helpers.collector_proc import REPO, CollectorProcess, _clean_env, ghostgpu_cli
from tests.helpers.polling import poll, wait_until
from tests.helpers.tracer_proc import TracerProcess

NOBODY = 65534
DEADLINE_S = 30.0
# Reads the checkout with CAP_DAC_READ_SEARCH, as tests/integration/test_security_tracer.py explains.
AS_NOBODY = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups",
             "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
# No capability at all: what any local user can read (the system Python, which has sqlite3).
PLAIN_NOBODY = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups",
                "--inh-caps=-all", "/usr/bin/python3", "-c"]

pytestmark = pytest.mark.root


@pytest.fixture(autouse=True)
def _root() -> None:
    require_root()


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and err.endswith("\n"), f"expected one line on stderr, got: {err!r}"
    return err.strip()


# ---- the unix gate's relay names --------------------------------------------------------------

SQUATTER = r"""
import os, re, socket, sys, time
held, tried_dirs = [], []
deadline = time.monotonic() + 20
while time.monotonic() < deadline:  # until a relayed connection of the gate's shows
    rows = [line.split() for line in open("/proc/net/unix").read().splitlines()[1:]]
    names = [row[-1] for row in rows if len(row) > 7]
    if [n for n in names if re.search(r"ghostgpu-peer-|ghostgpu-grpc-\w+/peer-", n)]:
        break
    time.sleep(0.05)
for name in names:
    m = re.match(r"@(ghostgpu-peer-[0-9a-f]+-)(\d+)$", name)
    if m:  # the gate's abstract names: take the next 300 before it does
        for n in range(int(m.group(2)) + 1, int(m.group(2)) + 301):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.bind("\0" + m.group(1) + str(n)); s.listen(); held.append(s)
            except OSError:
                s.close()
    d = os.path.dirname(name)
    if "ghostgpu-grpc-" in d and d not in tried_dirs:  # the gate's private directory: try to bind there
        tried_dirs.append(d)
        for n in range(1, 301):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.bind(f"{d}/peer-{n}"); held.append(s)
            except OSError:
                s.close()
seen = sum(1 for n in names if re.search(r"ghostgpu-peer-|ghostgpu-grpc-\w+/peer-", n))
print(f"squatting {len(held)} names; gate sockets seen: {seen}; private dirs tried: {len(tried_dirs)}",
      flush=True)
time.sleep(120)
"""


def test_a_local_user_cannot_squat_the_unix_gate(shared_dir: Path) -> None:
    with CollectorProcess(shared_dir / "collector") as col:
        first = ghostgpu_cli("ps", "--collector", col.unix_address, "-o", "json")
        assert first.returncode == 0, first.stderr  # one relayed connection: its name was on show
        # Held open: the relay's socket is in /proc/net/unix while the squatter looks.
        watch = subprocess.Popen([sys.executable, "-m", "ghostgpu.cli", "ps", "--collector", col.unix_address,
                                  "--watch"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
                                 env=_clean_env())
        squat = None
        try:
            wait_until(lambda: _relay_sockets() > 0, "the watch's relayed connection", DEADLINE_S)
            squat = subprocess.Popen([*PLAIN_NOBODY, SQUATTER], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
            assert squat.stdout is not None
            said = squat.stdout.readline()
            assert said.startswith("squatting"), said
            held = int(re.search(r"squatting (\d+)", said).group(1))  # type: ignore[union-attr]
            assert "gate sockets seen: 0;" not in said, said  # it did see the relay it would squat
            tries = [ghostgpu_cli("ps", "--collector", col.unix_address, "-o", "json") for _ in range(3)]
            assert [t.returncode for t in tries] == [0, 0, 0], (said, [t.stderr.strip() for t in tries])
            assert all(isinstance(json.loads(t.stdout), list) for t in tries)
            assert held == 0, f"uid {NOBODY} took {held} of the gate's names: {said}"
        finally:
            for proc in (watch, squat):
                if proc is not None:
                    proc.kill()
                    proc.wait()
        # No abstract name of the collector's is left for anyone to see or take.
        assert "@ghostgpu" not in Path("/proc/net/unix").read_text()


def _relay_sockets() -> int:
    return sum(1 for line in Path("/proc/net/unix").read_text().splitlines()
               if "ghostgpu-peer-" in line or re.search(r"ghostgpu-grpc-\w+/peer-\d+", line))


# ---- the store and the audit file at rest ----------------------------------------------------

READ_AUDIT = """
import sqlite3, sys
try:
    conn = sqlite3.connect(f"file:{sys.argv[1]}?mode=ro", uri=True)
    rows = conn.execute("SELECT action FROM audit").fetchall()
    print("read", len(rows))
except Exception as e:
    print("refused", type(e).__name__)
try:
    print("file", len(open(sys.argv[2]).read()))
except OSError as e:
    print("refused", type(e).__name__)
"""


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_store_and_the_audit_file_are_no_other_users_to_read(shared_dir: Path) -> None:
    state = shared_dir / "state" / "ghostgpu"  # made by the collector
    db, audit = state / "collector.db", state / "collector.audit.jsonl"
    old_umask = os.umask(0o022)  # the usual umask: files would be 0644, directories 0755
    try:
        with CollectorProcess(shared_dir / "c1", unix=False, args=["--db", str(db)]):
            wait_until(lambda: Path(f"{db}-wal").exists() and Path(f"{db}-shm").exists(), "the WAL",
                       DEADLINE_S)
            assert (_mode(state), _mode(state.parent)) == (0o700, 0o700), oct(_mode(state))
            for path in (db, Path(f"{db}-wal"), Path(f"{db}-shm"), audit):
                assert _mode(path) == 0o600, f"{path}: {oct(_mode(path))}"
    finally:
        os.umask(old_umask)
    # The attack: any local user reads the admin-only trail and the findings. The directories opened
    # up (as another tool might leave them): the files' own modes must still say no.
    os.chmod(state.parent, 0o755)
    os.chmod(state, 0o755)
    out = subprocess.run([*PLAIN_NOBODY, READ_AUDIT, str(db), str(audit)], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.stdout.split("\n")[:2] == ["refused OperationalError", "refused PermissionError"], out.stdout
    # Files an older ghostgpu left 0644 are tightened at start, one line each.
    for path in (db, audit):
        os.chmod(path, 0o644)
    with CollectorProcess(shared_dir / "c2", unix=False, args=["--db", str(db)]) as col:
        for path in (db, audit):
            assert _mode(path) == 0o600, f"{path}: {oct(_mode(path))}"
        lines = [line for line in col.stderr().splitlines() if "was mode 0644" in line]
        assert sorted(line.split(" was mode")[0].rsplit(" ", 1)[-1] for line in lines) == sorted(
            [str(audit), str(db)]), col.stderr()
    out = subprocess.run([*PLAIN_NOBODY, READ_AUDIT, str(db), str(audit)], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.stdout.split("\n")[:2] == ["refused OperationalError", "refused PermissionError"], out.stdout


# ---- a collector another local user runs -----------------------------------------------------

LISTENING = re.compile(r"listening on (.+?); database ")


@pytest.fixture
def fake_collector(shared_dir: Path) -> Iterator[tuple[str, str, Path]]:
    """The real `ghostgpu collector` run by uid 65534 on a loopback port and a unix socket in a
    directory root's clients may be pointed at: (TCP address, unix address, its audit file)."""
    home = shared_dir / "nobody"
    home.mkdir()
    os.chown(home, NOBODY, NOBODY)
    err = home / "stderr"
    with open(err, "wb") as f:
        proc = subprocess.Popen([*AS_NOBODY, sys.executable, "-m", "ghostgpu.cli", "collector", "--listen",
                                 f"127.0.0.1:0,unix://{home}/collector.sock", "--db", str(home / "c.db")],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=f, cwd=REPO,
                                env={**_clean_env(), "PYTHONDONTWRITEBYTECODE": "1"})
    try:
        found: list[str] = []

        def listening() -> bool:
            m = LISTENING.search(err.read_text(errors="replace"))
            if m:
                found[:] = [a.strip() for a in m.group(1).split(",")]
            assert proc.poll() is None, err.read_text()
            return bool(m)

        if not poll(listening, DEADLINE_S):
            raise AssertionError(f"the fake collector did not start: {err.read_text()}")
        tcp = next(a for a in found if not a.startswith("unix:"))
        unix = next(a for a in found if a.startswith("unix:"))
        yield tcp, unix, home / "c.audit.jsonl"
    finally:
        proc.kill()
        proc.wait()


def _actions(audit: Path) -> list[str]:
    return [json.loads(line)["action"] for line in audit.read_text().splitlines() if line.strip()]


def test_root_s_ps_refuses_a_collector_another_user_runs(fake_collector: tuple[str, str, Path]) -> None:
    tcp, unix, audit = fake_collector
    for address in (tcp, unix):
        out = ghostgpu_cli("ps", "--collector", address)
        assert out.returncode == 1, f"root's ps talked to uid {NOBODY}'s collector at {address}: {out.stdout}"
        line = one_line(out.stderr)
        assert f"served by uid {NOBODY}" in line and address in line and "--collector-uid" in line, line
        accepted = ghostgpu_cli("ps", "--collector", address, "--collector-uid", str(NOBODY), "-o", "json")
        assert accepted.returncode == 0, accepted.stderr  # named by root: trusted
    assert "denied" not in _actions(audit)  # the refused ones never reached it


def test_a_root_tracer_sends_nothing_to_a_collector_another_user_runs(
        tmp_path: Path, fake_collector: tuple[str, str, Path]) -> None:
    tcp, unix, audit = fake_collector
    for address in (tcp, unix):
        workdir = tmp_path / f"tracer-{len(address)}"
        workdir.mkdir()
        with TracerProcess(workdir, ["--bpf", "off"], {}, "node-root", address) as tracer:
            wait_until(lambda: f"served by uid {NOBODY}" in tracer.stderr(), "the tracer's refusal",
                       DEADLINE_S)
            assert tracer.proc.poll() is None, tracer.stderr()  # it waits for the real one
        refusals = [line for line in tracer.stderr().splitlines() if f"served by uid {NOBODY}" in line]
        assert len(refusals) == 1 and address in refusals[0], tracer.stderr()
        assert "tracer.connect" not in _actions(audit), "the tracer's Hello reached the fake collector"
    # Told to trust it, the same tracer connects.
    workdir = tmp_path / "tracer-trusting"
    workdir.mkdir()
    with TracerProcess(workdir, ["--bpf", "off", "--collector-uid", str(NOBODY)], {}, "node-root", tcp):
        wait_until(lambda: "tracer.connect" in _actions(audit), "the trusted connection", DEADLINE_S)
