"""The collector's security: how each listener is served (mTLS, plaintext, a unix socket behind
SO_PEERCRED), who may call what (the policy), and the audit log of what they did.

Plaintext is served only where nobody else can connect (docs/SECURITY.md): a unix socket (the
peer's uid comes from the kernel) or a loopback address (the peer's uid from /proc/net/tcp). A
plaintext TCP listener on any other address refuses to start unless --insecure is given, and then
every start says so loudly. With --tls-cert/--tls-key/--tls-ca every TCP listener is mTLS: a client
certificate signed by the CA is required, and new handshakes pick up rotated files.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from ghostgpu.collector.audit import AuditLog
from ghostgpu.collector.authz import Authorizer, Identify
from ghostgpu.collector.peers import UnixGate
from ghostgpu.collector.policy import PolicyWatcher
from ghostgpu.collector.store import Store
from ghostgpu.collector.tcpgate import (
    TcpGate,
    connection_quota,
    default_max_connections,
)

from ghostgpu import __version__
from ghostgpu.common.audit.chain import AuditRecord
from ghostgpu.common.system.filemodes import private_file
from ghostgpu.common.transport.addresses import is_unix, port_of, unix_path, with_port
from ghostgpu.common.transport.principal import Principal
from ghostgpu.common.transport.tls import TlsFiles, check_server, plaintext_allowed
from ghostgpu.common.transport.tls_reload import server_credentials

log = logging.getLogger(__name__)


class SecurityError(ValueError):
    """A listener that would be open to the network in plaintext, or bad TLS files: one line."""


@dataclass(frozen=True)
class SecurityOptions:
    """The security slice of CollectorConfig (collector/config.py, where each default lives)."""

    tls: TlsFiles
    insecure: bool  # --insecure: plaintext TCP on a non-loopback address
    policy_path: str | None  # --policy FILE; None: Policy.default (local root is admin)
    audit_log: str | None  # --audit-log FILE; None: beside the database
    # The mTLS TCP listeners' caps (collector/tcpgate.py): --max-connections (None: what the fd limit
    # holds, at most 10000) and --max-connections-per-source (unauthenticated ones per address).
    max_connections: int | None
    max_connections_per_source: int


def default_audit_path(db_path: str) -> str | None:
    """The audit log beside the database: collector.db -> collector.audit.jsonl."""
    if db_path in ("", ":memory:"):
        return None
    root, _ = os.path.splitext(db_path)
    return f"{root}.audit.jsonl"


class Security:
    """Built before the server binds; `tick()` runs on the collector's loop every second."""

    def __init__(self, opts: SecurityOptions, store: Store, db_path: str,
                 say: Callable[[str], None] | None = None) -> None:
        self.opts = opts
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        if opts.tls.enabled:
            check_server(opts.tls)  # TlsError (a ValueError) naming the file
        # With a shared (PostgreSQL) store the chain is the database's and no file is written unless
        # --audit-log names one: a replica's file then holds only its own records (collector/audit.py).
        shared = store.engine == "postgresql"
        audit_path = opts.audit_log or (None if shared else default_audit_path(db_path))
        if audit_path:
            with contextlib.suppress(OSError):  # AuditLog says what is wrong with it, naming the file
                private_file(audit_path)  # 0600, whatever the umask; tightened (one line) if looser
        self.audit_log = AuditLog(audit_path, store)
        self.audit = self.audit_log.append
        # Each run of the collector is in the chain: where it took the chain up and where it left it,
        # so a tail cut while it was stopped shows as a start after no stop (`ghostgpu audit --verify`),
        # and the head it exports (ghostgpu_audit_head_seq) lets Prometheus see a rewind. Replicas
        # sharing the chain name themselves, so each one's stops are checked apart.
        self._replica = {"replica": store.replica_id} if shared else {}
        self.started: AuditRecord = self.audit_log.start(pid=os.getpid(), version=__version__,
                                                         **self._replica)
        self._stop_written = False
        # A bad policy at start is fatal (PolicyError, a ValueError naming the key): better no
        # collector than one that serves a wrong policy.
        self.policy = PolicyWatcher(opts.policy_path, on_event=self._policy_event, own_uid=os.getuid())
        self.gates: list[UnixGate] = []
        self.server_ports: set[int] = set()
        self.identify = Identify(opts.tls.trust_domain, self.gates, self.server_ports)
        self.tcp_gates: list[TcpGate] = []  # the mTLS TCP ports' caps, beside gRPC (collector/tcpgate.py)
        self.authorizer = Authorizer(self._identify, lambda: self.policy.policy, self.audit)
        self._checked_policy = self.policy.policy  # the one the open streams were checked against

    def check_listen(self, listen: list[str]) -> None:
        """SecurityError for a plaintext TCP listener off loopback without --insecure."""
        if self.opts.tls.enabled:
            return
        open_to_all = [a for a in listen if not is_unix(a) and not plaintext_allowed(a)]
        if open_to_all and not self.opts.insecure:
            raise SecurityError(
                f"--listen {open_to_all[0]}: plaintext on an address others can reach; pass --tls-cert, "
                "--tls-key and --tls-ca (ghostgpu certs init/issue), listen on 127.0.0.1 or unix:///path, "
                "or pass --insecure to serve it unauthenticated anyway")
        for addr in open_to_all:
            self.say(f"ghostgpu: collector: INSECURE: {addr} serves plaintext gRPC to the network: anyone "
                     "who can reach it can stream fake events and read every pod's GPU use (--insecure)")

    def bind(self, server: grpc.aio.Server, addr: str) -> str:
        """Add one listener to the server; the address as bound (the port chosen for :0)."""
        if is_unix(addr):
            gate = UnixGate(unix_path(addr))
            if not server.add_insecure_port(gate.internal_address):
                raise SecurityError(f"--listen {addr}: cannot open the private gRPC socket beside it")
            gate.start()  # OSError naming nothing: the caller adds the flag
            self.gates.append(gate)
            return addr
        if self.opts.tls.enabled:  # gRPC, with a gate beside it that caps connections (collector/tcpgate.py)
            return self._bind_gated(server, addr)
        else:
            port = server.add_insecure_port(addr)
        if not port:
            raise SecurityError(f"--listen {addr}: cannot listen there; pick a free port")
        self.server_ports.add(port)
        return with_port(addr, port) if port_of(addr) == 0 else addr

    def max_connections(self) -> int:
        """Each mTLS TCP listener's cap: --max-connections, or what the fd limit holds."""
        opts = self.opts
        cap = opts.max_connections if opts.max_connections is not None else default_max_connections()
        for value, flag in ((cap, "--max-connections"), (opts.max_connections_per_source,
                                                         "--max-connections-per-source")):
            if value < 1:
                raise SecurityError(f"{flag} {value}: must be 1 or more")
        return cap

    def server_options(self, listen: list[str]) -> list[tuple[str, int]]:
        """gRPC server options for these listeners: with TLS, the connection quota that backs the
        TCP gates' caps (collector/tcpgate.py)."""
        tcp = {port_of(a) or a for a in listen if not is_unix(a)}
        if not self.opts.tls.enabled or not tcp:
            return []
        quota = connection_quota(self.max_connections() * len(tcp))
        return [("grpc.max_allowed_incoming_connections", quota)]

    def _bind_gated(self, server: grpc.aio.Server, addr: str) -> str:
        cap = self.max_connections()
        credentials = server_credentials(self.opts.tls, self._tls_event)
        port = server.add_secure_port(addr, credentials)
        if not port:
            raise SecurityError(f"--listen {addr}: cannot listen there; pick a free port")
        if not any(g.port == port for g in self.tcp_gates):  # [::1]:P and 127.0.0.1:P: one port, one gate
            gate = TcpGate(port, cap, self.opts.max_connections_per_source,
                           holds_stream=self.authorizer.streams.holds)
            gate.start()
            self.tcp_gates.append(gate)
        self.server_ports.add(port)
        return with_port(addr, port) if port_of(addr) == 0 else addr

    def _identify(self, context: grpc.aio.ServicerContext) -> Principal:
        """Identify, and tell the TCP gates the connection it came over is proven."""
        principal = self.identify(context)
        for gate in self.tcp_gates:
            gate.prove(principal.peer)
        return principal

    def tick(self) -> None:
        self.policy.maybe_reload()
        self._recheck_streams()

    def reload(self) -> None:
        """SIGHUP: re-read the policy now."""
        self.policy.reload()
        self._recheck_streams()

    def _recheck_streams(self) -> None:
        """A new policy in force: the open streams it now denies end at once (collector/revoke.py)."""
        policy = self.policy.policy
        if policy is not self._checked_policy:
            self._checked_policy = policy
            self.authorizer.streams.recheck(policy)

    def audit_head(self) -> tuple[int, int]:
        """(the chain's newest seq, records this run appended, its start record included): the
        metrics ghostgpu_audit_head_seq and ghostgpu_audit_records_total."""
        return self.audit_log.seq, self.audit_log.appended_total

    def stopping(self) -> None:
        """The run's last record, collector.stop, once: call it while the store still takes writes."""
        if self._stop_written:
            return
        self._stop_written = True
        self.audit("collector.stop", "collector", "ok", started_seq=self.started.seq,
                   resumed_seq=self.started.detail["resumed_seq"], records=self.audit_head()[1] + 1,
                   **self._replica)

    def close(self) -> None:
        self.stopping()  # already written unless the collector never served
        for gate in self.gates:
            gate.stop()
        for tcp in self.tcp_gates:
            tcp.stop()
        self.audit_log.close()

    def _policy_event(self, action: str, detail: str) -> None:
        # The watcher has logged the line (one line per reload, bounded: collector/policy.py).
        self.audit(action, "collector", "ok" if action == "policy.reload" else "error", detail=detail,
                   path=self.opts.policy_path or "")

    def _tls_event(self, action: str, detail: str) -> None:
        (log.info if action == "tls.reload" else log.error)("%s: %s", action, detail)
        self.audit(action, "collector", "ok" if action == "tls.reload" else "error", detail=detail)
