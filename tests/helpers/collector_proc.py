"""Run the real `ghostgpu collector` as a subprocess, as a user would, and the real `ghostgpu ps`.

`CollectorProcess` starts `python -m ghostgpu.cli collector --listen ADDR[,ADDR] --db DB`, reads the
addresses it bound from its "listening on ..." line on stderr (port 0 picks a free port), and can
be stopped with SIGTERM (`stop`) or SIGKILL (`kill`, a crash) and started again on the same
database, the same TCP port and the same unix socket (`restart`), which is how a collector restart
looks to tracers and clients. `tls_flags(files)` makes the --tls-* flags of a certificate from
tests/helpers/certs.py, for the collector, the tracer and the CLI alike.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.helpers.polling import poll

if TYPE_CHECKING:
    from ghostgpu.common.transport.tls import TlsFiles

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 30.0  # Python start-up and grpc import on a loaded 2-core VM
_LISTENING = re.compile(r"listening on (.+?); database ")


class CollectorProcess:
    """`ghostgpu collector` on 127.0.0.1:0 (and a unix socket in `workdir` when unix=True)."""

    def __init__(self, workdir: Path, unix: bool = True, args: list[str] | None = None,
                 tcp: list[str] | None = None) -> None:
        """tcp: the TCP listen addresses (default 127.0.0.1:0), e.g. 0.0.0.0:0 with --insecure."""
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.db_path = workdir / "collector.db"
        self.socket_path = workdir / "collector.sock"
        self.args = list(args or [])
        self.listen = list(tcp or ["127.0.0.1:0"]) + ([f"unix://{self.socket_path}"] if unix else [])
        self.addresses: list[str] = []
        self.starts = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._stderr_path = workdir / "collector.stderr"
        self.start()

    # ---- addresses --------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """HOST:PORT of the TCP listener, as tracers and `ghostgpu ps --collector` take it."""
        return next(a for a in self.addresses if not a.startswith("unix:"))

    @property
    def unix_address(self) -> str:
        return next(a for a in self.addresses if a.startswith("unix:"))

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])

    # ---- life cycle -------------------------------------------------------------------------

    def start(self, timeout_s: float = START_TIMEOUT_S) -> CollectorProcess:
        """Start it on self.listen and wait for its "listening on" line; fails with its stderr."""
        assert self.proc is None or self.proc.poll() is not None, "collector already running"
        self.starts += 1
        cmd = [sys.executable, "-m", "ghostgpu.cli", "collector", "--listen", ",".join(self.listen),
               "--db", str(self.db_path), *self.args]
        offset = self._stderr_path.stat().st_size if self._stderr_path.exists() else 0
        with open(self._stderr_path, "ab") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                         cwd=REPO, env=_clean_env())
        deadline = time.monotonic() + timeout_s
        while True:
            text = self._stderr_path.read_bytes()[offset:].decode(errors="replace")
            m = _LISTENING.search(text)
            if m:
                self.addresses = [a.strip() for a in m.group(1).split(",")]
                break
            if self.proc.poll() is not None:
                raise AssertionError(f"ghostgpu collector exited with {self.proc.returncode}: {text[-2000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"ghostgpu collector did not say 'listening on' in {timeout_s} s: "
                                     f"{text[-2000:]}")
            time.sleep(0.02)  # polling interval of a deadline loop while Python starts
        # A restart binds exactly what the first start chose: same port, same socket path.
        self.listen = list(self.addresses)
        return self

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM and wait (SIGKILL past the deadline); the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL: a crash, nothing flushed, nothing said to the tracers."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self, timeout_s: float = START_TIMEOUT_S) -> CollectorProcess:
        """Start again on the same database, TCP port and unix socket (after stop() or kill())."""
        self.stop()
        return self.start(timeout_s)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stderr(self) -> str:
        try:
            return self._stderr_path.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def __enter__(self) -> CollectorProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _clean_env() -> dict[str, str]:
    # The collector needs no fake NVML; keep a test's LD_LIBRARY_PATH from leaking into it.
    return {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "FAKE_NVML_CONFIG")}


def tls_flags(files: TlsFiles) -> list[str]:
    """--tls-cert/--tls-key/--tls-ca (and --tls-trust-domain) of `files`; the ones it has."""
    flags = {"--tls-cert": files.cert, "--tls-key": files.key, "--tls-ca": files.ca,
             "--tls-trust-domain": files.trust_domain}
    return [part for flag, value in flags.items() if value for part in (flag, str(value))]


def ghostgpu_cli(*args: str, timeout_s: float = 60.0,
                 wrapper: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `python -m ghostgpu.cli ARGS...` to completion (as a user runs `ghostgpu ps`).

    wrapper: argv run in front, e.g. setpriv to run it as another user (who cannot write
    __pycache__ in the checkout: Python is told not to try)."""
    env = {**_clean_env(), "PYTHONDONTWRITEBYTECODE": "1"} if wrapper else _clean_env()
    cmd = [*(wrapper or []), sys.executable, "-m", "ghostgpu.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=REPO, env=env,
                          check=False)


def ps_json(collector: str, *args: str) -> list[dict[str, Any]]:
    """`ghostgpu ps --collector ADDR -o json ARGS...`: the rows it prints; fails on a non-zero exit."""
    out = ghostgpu_cli("ps", "--collector", collector, "-o", "json", *args)
    if out.returncode != 0:
        raise AssertionError(f"ghostgpu ps {' '.join(args)} exited {out.returncode}: {out.stderr.strip()}")
    rows = json.loads(out.stdout)
    assert isinstance(rows, list), f"ghostgpu ps -o json printed {type(rows).__name__}, not a list"
    return rows


def findings_json(collector: str, *args: str) -> list[dict[str, Any]]:
    """`ghostgpu findings --collector ADDR -o json ARGS...`: the findings it prints; fails on a non-zero
    exit."""
    out = ghostgpu_cli("findings", "--collector", collector, "-o", "json", *args)
    if out.returncode != 0:
        raise AssertionError(f"ghostgpu findings {' '.join(args)} exited {out.returncode}: "
                             f"{out.stderr.strip()}")
    rows = json.loads(out.stdout)
    assert isinstance(rows, list), f"ghostgpu findings -o json printed {type(rows).__name__}, not a list"
    return rows


def remediation_of(collector: str, node: str, pid: int) -> dict[str, Any] | None:
    """The `remediation` of the newest finding of `pid` on `node` (`findings -o json`), None when it
    has none (or no finding)."""
    rows = [r for r in findings_json(collector, "--node", node) if r["pid"] == pid]
    remediation: dict[str, Any] | None = rows[-1]["remediation"] if rows else None
    return remediation


def remediation_state(collector: str, node: str, pid: int) -> str:
    """remediation_of's state ("" with none): what a test polls for."""
    return str((remediation_of(collector, node, pid) or {}).get("state", ""))


def cluster_rows(q: Any, **filters: Any) -> list[dict[str, Any]]:
    """ListConsumers over a QueryClient (tests/helpers/collector_env.py), as `ps -o json` rows."""
    from ghostgpu.common.wire.convert import cluster_consumer_from_proto

    return [cluster_consumer_from_proto(m).to_json() for m in q.consumers(**filters)]


def wait_rows(q: Any, pred: Callable[[dict[str, Any]], bool], what: str, timeout_s: float = 30.0,
              **filters: Any) -> list[dict[str, Any]]:
    """Poll ListConsumers until some rows match `pred`; those rows (fails naming `what` past the deadline)."""
    found: list[dict[str, Any]] = []
    seen: list[dict[str, Any]] = []

    def ready() -> bool:
        nonlocal found, seen
        seen = cluster_rows(q, **filters)
        found = [r for r in seen if pred(r)]
        return bool(found)

    if not poll(ready, timeout_s):
        keys = ("node", "pid", "container_id", "class", "node_class", "resolution", "cri_error")
        brief = [{k: r.get(k) for k in keys} for r in seen]
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; rows: {brief}")
    return found
