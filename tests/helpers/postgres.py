"""A throwaway PostgreSQL cluster for tests and benchmarks: Debian's `postgresql` (15), in a temp dir.

    with PostgresServer() as pg:                 # initdb + start: about a second here
        dsn = pg.create_database("t1")           # postgresql://postgres@127.0.0.1:PORT/t1
        pg.restart(); pg.kill(); pg.start()      # the port, and so every DSN, stays the same
        pg.psql("SELECT 1")                      # '1'

initdb and postgres refuse to run as root, and CI runs as root: then the cluster belongs to an
unprivileged user (`nobody` unless told) and every server process is started through util-linux
`setpriv`, which also sets PR_SET_PDEATHSIG so a killed test runner takes the postmaster with it.
The checkout may sit under a 0700 directory (/root), so the cluster lives in a fresh
`tempfile.mkdtemp()` opened for traversal: DATA (0700, the user's), the unix socket directory, and
the server's log (stderr), whose tail a failed start quotes. The server listens on 127.0.0.1 at a
free port chosen at the first start and kept across restarts. fsync and every other setting are
PostgreSQL's defaults: the tests and benchmarks measure real commits. Local and 127.0.0.1
connections are trusted (superuser `postgres`); `add_password_role` adds a role that must give its
password (scram-sha-256 or md5), for the tests of --store-password-file.

Readiness is polled, never slept for: the postmaster writes its state ("ready", PG 10+) as the last
line of DATA/postmaster.pid, which is also what pg_ctl waits on. `kill()` SIGKILLs the postmaster
alone, as a crash would; its backends exit on their own when they notice it gone, and `start()`
waits for them first (a new postmaster refuses to start while the old shared memory is attached).

Fixtures (registered in tests/conftest.py): `postgres_server` (one cluster for the session, started
again if a test stopped it), `postgres` (the same server: the name the store's contract tests use),
`postgres_dsn` (a fresh database per test, dropped after it) and `own_postgres` (a cluster of the
test's own, for tests that stop, kill or reconfigure it). Without the binaries, or as root without
setpriv or the `nobody` user, they skip with one line naming what to install (a failure under
GHOSTGPU_REQUIRE_INTEGRATION=1: tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.polling import poll

SUPERUSER = "postgres"
DEFAULT_OS_USER = "nobody"  # CI runs as root; initdb and postgres refuse root
# A start after kill() replays the WAL since the last checkpoint first (on a loaded 2-core VM).
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
# Backends notice a dead postmaster at their next wait (PG 15: WL_POSTMASTER_DEATH in every wait set).
CHILDREN_EXIT_TIMEOUT_S = 10.0
PSQL_TIMEOUT_S = 60.0
LOG_TAIL_LINES = 20
_BIND_ATTEMPTS = 3  # a free port can be taken between our probe and the postmaster's bind
_IDENT = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_STOP_SIGNALS = {"smart": signal.SIGTERM, "fast": signal.SIGINT, "immediate": signal.SIGQUIT}
INSTALL_HINT = "apt-get install postgresql (scripts/bootstrap.sh install)"
PG_LIB_DIR = Path("/usr/lib/postgresql")  # Debian: one bin/ per installed major version


class PostgresUnavailable(RuntimeError):
    """This host cannot run a throwaway cluster (binaries, user or setpriv missing): the fixtures skip."""


class PostgresError(RuntimeError):
    """The cluster did not do what was asked (initdb, start, stop, a psql command): a test failure."""


def find_bindir() -> Path:
    """The server's bin directory: `pg_config --bindir` when it holds initdb and postgres (Debian's
    libpq-dev pg_config names the server's directory even when only the client is installed), else
    the highest /usr/lib/postgresql/N/bin; $GHOSTGPU_PG_BINDIR overrides both."""
    candidates: list[Path] = []
    if override := os.environ.get("GHOSTGPU_PG_BINDIR"):
        candidates.append(Path(override))
    if pg_config := shutil.which("pg_config"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, timeout=10,
                                 check=False).stdout.strip()
            if out:
                candidates.append(Path(out))

    def version(p: Path) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", p.parent.name)) or (0,)

    candidates += sorted(PG_LIB_DIR.glob("*/bin"), key=version, reverse=True)
    for bindir in candidates:
        if all(os.access(bindir / b, os.X_OK) for b in ("initdb", "postgres", "psql")):
            return bindir
    raise PostgresUnavailable("PostgreSQL server binaries (initdb, postgres, psql) not found under "
                              f"pg_config --bindir or /usr/lib/postgresql/*/bin: {INSTALL_HINT}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _traversable_by_others(path: Path) -> bool:
    """Every directory from / down to `path` lets others through (o+x): the cluster's user gets in."""
    return all(os.stat(p).st_mode & 0o001 for p in [path, *path.parents])


def child_pids(pid: int) -> list[int]:
    """PIDs whose parent is `pid` (the postmaster's backends and auxiliary processes)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                text = f.read()
        except OSError:
            continue
        # comm (field 2) may hold spaces and parentheses: count fields after its last ')'
        if int(text[text.rfind(")") + 2:].split()[1]) == pid:
            out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    """Running (a zombie, exited but not reaped by its new parent, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return False
    return text[text.rfind(")") + 2:].split()[0] != "Z"


class PostgresServer:
    """One throwaway cluster: initdb'd on the first start(), removed by close() (or `with`)."""

    def __init__(self, *, os_user: str = DEFAULT_OS_USER, fsync: bool = True, base_dir: str | None = None,
                 settings: dict[str, str] | None = None) -> None:
        self.bindir = find_bindir()
        self._as_root = os.geteuid() == 0
        self._setpriv = shutil.which("setpriv")
        if self._as_root:
            try:
                pw = pwd.getpwnam(os_user)
            except KeyError:
                raise PostgresUnavailable(f"user {os_user!r} does not exist: PostgreSQL refuses root, so it "
                                          "runs as that user (create it, or pass os_user=)") from None
            if not self._setpriv:
                raise PostgresUnavailable("setpriv (util-linux) is missing: as root it runs PostgreSQL as "
                                          f"{os_user}; apt-get install util-linux")
            self.uid, self.gid = pw.pw_uid, pw.pw_gid
        else:
            self.uid, self.gid = os.geteuid(), os.getegid()
        self.fsync = fsync
        self.settings = dict(settings or {})
        self.dir = Path(tempfile.mkdtemp(prefix="ghostgpu-pg-", dir=base_dir))
        os.chmod(self.dir, 0o755)
        if self._as_root and not _traversable_by_others(self.dir):
            shutil.rmtree(self.dir, ignore_errors=True)
            raise PostgresError(f"{self.dir} is under a directory {os_user} cannot enter: set TMPDIR "
                                "(or base_dir=) to a world-traversable directory such as /tmp")
        self.data_dir = self.dir / "data"
        self.socket_dir = self.dir / "sock"
        self.log_path = self.dir / "postgres.log"
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._orphans: list[int] = []  # backends of a killed postmaster, still exiting
        self.start_s: float | None = None  # the last start's wall time (initdb included the first time)

    # ---- addresses ---------------------------------------------------------------------------------

    def dsn_for(self, dbname: str = "postgres", user: str = SUPERUSER) -> str:
        return f"postgresql://{user}@127.0.0.1:{self.port}/{dbname}"

    @property
    def dsn(self) -> str:
        """The superuser's DSN of the `postgres` database."""
        return self.dsn_for()

    @property
    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.is_running and self.proc is not None else None

    # ---- processes ---------------------------------------------------------------------------------

    def _argv(self, binary: str, *args: str) -> list[str]:
        argv = [str(self.bindir / binary), *args]
        if not self._setpriv:
            return argv
        # setpriv applies --pdeathsig after the uid change (util-linux 2.38), which would clear it otherwise
        who = (["--reuid", str(self.uid), "--regid", str(self.gid), "--clear-groups"]
               if self._as_root else [])
        return [self._setpriv, *who, "--pdeathsig", "KILL", "--", *argv]

    def _env(self) -> dict[str, str]:
        # No PG* from the caller's environment (PGHOST, PGPASSWORD... would redirect psql); LC_ALL=C
        # because the cluster is initdb'd --locale=C and a missing locale would only add warnings.
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        return env | {"LC_ALL": "C", "LANG": "C", "PGPASSFILE": os.devnull}

    def _initdb(self) -> None:
        self.data_dir.mkdir(mode=0o700)
        self.socket_dir.mkdir(mode=0o700)
        for d in (self.data_dir, self.socket_dir):
            os.chown(d, self.uid, self.gid)
        # --no-sync: initdb's own fsync of the fresh cluster (~0.5 s here) protects only against a
        # machine crash, which a throwaway cluster never lives through; the server keeps fsync on.
        proc = subprocess.run(
            self._argv("initdb", "-D", str(self.data_dir), "-U", SUPERUSER, "--auth=trust", "--encoding=UTF8",
                       "--locale=C", "--no-sync", "--no-instructions"),
            capture_output=True, text=True, cwd=self.dir, env=self._env(), timeout=120, check=False)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-LOG_TAIL_LINES:])
            raise PostgresError(f"initdb {self.data_dir} exited with {proc.returncode}:\n{tail}")
        # Only loopback; `local` for psql over the socket directory. Password roles prepend their own lines.
        (self.data_dir / "pg_hba.conf").write_text(
            "local all all trust\nhost all all 127.0.0.1/32 trust\nhost all all ::1/128 trust\n")

    def _write_conf(self) -> None:
        settings = {
            "port": str(self.port),
            "listen_addresses": "'127.0.0.1'",
            "unix_socket_directories": f"'{self.socket_dir}'",
            "fsync": "on" if self.fsync else "off",
            "logging_collector": "off",  # the log is the postmaster's stderr: self.log_path
            "log_line_prefix": "'%m [%p] '",
        } | self.settings
        # postgresql.conf includes postgresql.auto.conf last; ALTER SYSTEM would write there too
        (self.data_dir / "postgresql.auto.conf").write_text(
            "".join(f"{k} = {v}\n" for k, v in settings.items()))

    def _ready_or_exited(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            return True
        try:
            lines = (self.data_dir / "postmaster.pid").read_text().splitlines()
        except OSError:
            return False
        # Line 1 the pid, line 8 the state (src/include/utils/pidfile.h, PG 10+): "starting", "ready"...
        return len(lines) >= 8 and lines[0].strip() == str(self.proc.pid) and lines[7].strip() == "ready"

    def log_tail(self, lines: int = LOG_TAIL_LINES, since: int = 0) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(since)
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def _wait_orphans(self) -> None:
        """Backends of a killed postmaster: wait for them to exit, SIGKILL those left past the deadline."""
        if not poll(lambda: not any(_alive(p) for p in self._orphans), CHILDREN_EXIT_TIMEOUT_S):
            for p in self._orphans:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            poll(lambda: not any(_alive(p) for p in self._orphans), CHILDREN_EXIT_TIMEOUT_S)
        self._orphans = []

    def start(self, timeout_s: float = START_TIMEOUT_S) -> PostgresServer:
        """initdb (first time), then the postmaster, returning once it accepts connections. Idempotent."""
        if self.is_running:
            return self
        started = time.monotonic()
        if not self.data_dir.exists():
            self._initdb()
        self._wait_orphans()
        first = self.port == 0
        for attempt in range(_BIND_ATTEMPTS if first else 1):
            if first:
                self.port = free_port()
            self._write_conf()
            offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(self._argv("postgres", "-D", str(self.data_dir)),
                                             stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                             cwd=self.dir, env=self._env())
            if poll(self._ready_or_exited, timeout_s) and self.proc.poll() is None:
                self.start_s = time.monotonic() - started
                return self
            code = self.proc.poll()
            self.kill()
            tail = self.log_tail(since=offset)
            if "could not bind" in tail and first and attempt + 1 < _BIND_ATTEMPTS:
                continue
            how = f"exited with {code}" if code is not None else f"was not ready within {timeout_s} s"
            raise PostgresError(f"postgres on 127.0.0.1:{self.port} {how} (log {self.log_path}); "
                                f"its last lines:\n{tail}")
        raise AssertionError("unreachable")

    def stop(self, mode: str = "fast", timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Shut down: "smart" waits for clients, "fast" disconnects them and checkpoints, "immediate"
        exits without a checkpoint (the next start recovers from WAL). SIGKILL past the deadline."""
        if mode not in _STOP_SIGNALS:
            raise ValueError(f"stop mode {mode!r}: one of {', '.join(_STOP_SIGNALS)}")
        if not self.is_running:
            return
        assert self.proc is not None
        self.proc.send_signal(_STOP_SIGNALS[mode])
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def restart(self, mode: str = "fast") -> PostgresServer:
        self.stop(mode)
        return self.start()

    def kill(self) -> None:
        """SIGKILL the postmaster, as a crash would; its backends exit by themselves (start() waits)."""
        if not self.is_running:
            return
        assert self.proc is not None
        self._orphans = child_pids(self.proc.pid)
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        """Stop the server (immediate: nothing here needs a checkpoint) and remove the whole temp dir."""
        try:
            self.stop("immediate")
            if self.proc is not None and self.proc.poll() is None:
                self.kill()
            self._wait_orphans()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        try:
            return self.start()
        except BaseException:
            self.close()  # __exit__ does not run when __enter__ raises
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- SQL ---------------------------------------------------------------------------------------

    def psql(self, sql: str, dbname: str = "postgres", user: str = SUPERUSER) -> str:
        """Run `sql` through psql over the unix socket; its unaligned, tuples-only output, stripped.
        Fails naming the command and psql's error."""
        argv = [str(self.bindir / "psql"), "-X", "-q", "-A", "-t", "-w", "-v", "ON_ERROR_STOP=1",
                "-h", str(self.socket_dir), "-p", str(self.port), "-U", user, "-d", dbname, "-c", sql]
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=self.dir, env=self._env(),
                              timeout=PSQL_TIMEOUT_S, check=False)
        if proc.returncode != 0:
            raise PostgresError(f"psql -c {sql[:200]!r} on {dbname} exited with {proc.returncode}: "
                                f"{proc.stderr.strip()}")
        return proc.stdout.strip()

    def create_database(self, name: str, owner: str = SUPERUSER) -> str:
        """A new empty database (owned by `owner`); its DSN for `owner`."""
        for what, ident in (("database", name), ("owner", owner)):
            if not _IDENT.fullmatch(ident):
                raise ValueError(f"{what} name {ident!r}: lower-case letters, digits and _ only, 63 at most")
        self.psql(f'CREATE DATABASE "{name}" OWNER "{owner}"')
        return self.dsn_for(name, owner)

    def drop_database(self, name: str) -> None:
        """Drop it, disconnecting whoever is still connected (PG 13+: WITH (FORCE))."""
        if not _IDENT.fullmatch(name):
            raise ValueError(f"database name {name!r}: lower-case letters, digits and _ only, 63 at most")
        self.psql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def add_password_role(self, name: str, password: str, method: str = "scram-sha-256") -> str:
        """A login role that must send `password` over TCP (`method`: "scram-sha-256" or "md5", the
        hash stored and the pg_hba rule). Returns its DSN of database `postgres`, without the password.
        Returns once the server enforces the rule: a reload is asynchronous, so it polls until a
        connection without the password is refused."""
        if method not in ("scram-sha-256", "md5"):
            raise ValueError(f"password method {method!r}: scram-sha-256 or md5")
        if not _IDENT.fullmatch(name):
            raise ValueError(f"role name {name!r}: lower-case letters, digits and _ only, 63 at most")
        quoted = password.replace("'", "''")
        self.psql(f"SET password_encryption = '{method}'; CREATE ROLE \"{name}\" LOGIN PASSWORD '{quoted}'")
        hba = self.data_dir / "pg_hba.conf"
        rule = f"host all {name} 127.0.0.1/32 {method}\nhost all {name} ::1/128 {method}\n"
        hba.write_text(rule + hba.read_text())  # first match wins: ahead of the trust lines
        self.psql("SELECT pg_reload_conf()")

        def refused_without_password() -> bool:
            proc = subprocess.run([str(self.bindir / "psql"), "-X", "-w", "-h", "127.0.0.1", "-p",
                                   str(self.port), "-U", name, "-d", "postgres", "-c", "SELECT 1"],
                                  capture_output=True, text=True, cwd=self.dir, env=self._env(),
                                  timeout=PSQL_TIMEOUT_S, check=False)
            return proc.returncode != 0 and "password" in proc.stderr

        if not poll(refused_without_password, 10.0):
            raise PostgresError(f"the server did not apply the {method} rule for role {name} within 10 s "
                                f"(log {self.log_path}):\n{self.log_tail()}")
        return self.dsn_for("postgres", name)


# ---- fixtures ----------------------------------------------------------------------------------------


def server_or_skip(**kwargs: Any) -> PostgresServer:
    """A PostgresServer (not started), or a skip naming what this host lacks."""
    try:
        return PostgresServer(**kwargs)
    except PostgresUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One cluster for the whole session (removed at its end), running."""
    with server_or_skip() as pg:
        yield pg


@pytest.fixture(scope="session")
def postgres(postgres_server: PostgresServer) -> PostgresServer:
    """The session's cluster under the name the store's contract tests use."""
    return postgres_server


_db_counter = 0


@pytest.fixture
def postgres_dsn(postgres_server: PostgresServer, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh database on the session's cluster (running again if an earlier test stopped it), so
    tests never see each other's rows; dropped after the test. The DSN is the superuser's."""
    global _db_counter
    _db_counter += 1
    name = f"t{_db_counter}_{re.sub(r'[^a-z0-9_]', '_', request.node.name.lower())}"[:63]
    postgres_server.start()
    dsn = postgres_server.create_database(name)
    try:
        yield dsn
    finally:
        if postgres_server.is_running:
            postgres_server.drop_database(name)


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    """A cluster of this test's own (initdb'd and started, about a second), for tests that stop, kill
    or reconfigure it; removed after the test."""
    with server_or_skip() as pg:
        yield pg
