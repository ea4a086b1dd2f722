"""The collector's mTLS TCP port: connection caps kept beside gRPC, never in its data path.

grpcio's server has `maximum_concurrent_rpcs` but no cap on connections of its own choosing, and it
accepts until the process runs out of file descriptors: with RLIMIT_NOFILE 1024, about 1,050 idle
connections that never finished a TLS handshake locked admins and tracers out. gRPC serves the
public port itself (every byte stays in its C core), and two things keep the caps:

- **gRPC's connection quota** (`grpc.max_allowed_incoming_connections`, gRPC core 1.55 and later):
  past it gRPC closes a new connection as soon as it accepts it, so a flood never takes the
  descriptors the store, the audit log and the CRI sockets need. The quota is the caps plus a slack
  (`connection_quota`), so that there is room for a newcomer while the gate makes more.
- **The gate** (`TcpGate`), a thread that looks at this process's own descriptors
  (`/proc/self/fd`) every POLL_S: a socket whose local port is the listener's and that has a peer
  is one of its connections. Past a cap it shuts the chosen connection down: shutdown(2) on a
  duplicate of gRPC's own descriptor, which gRPC reads as the client's close and answers by closing
  its descriptor (the duplicate is checked to be the same socket first, so a descriptor number
  reused meanwhile is never touched).

The rules:
- **Before authentication**, a connection is *unproven*: it is younger than the gRPC handshake
  deadline (HANDSHAKE_TIMEOUT_S; gRPC closes a connection whose TLS handshake and HTTP/2 settings do
  not complete by then, `grpc.server_handshake_timeout_ms` in collector/server.py) and no RPC has
  come over it yet (`prove()`, which the authorizer calls with gRPC's peer, marks it). At most
  `max_connections_per_source` unproven connections per source address: past it the oldest unproven
  ones of that address are closed.
- **Per port** (one gate for `[::1]:P` and `127.0.0.1:P`): at most `max_connections` connections.
  Past it, the oldest unproven connections (of any address) are closed; when every connection is
  proven, the oldest ones that hold no open response stream (`holds_stream`, asked of
  collector/revoke.py `OpenStreams`) are: any certificate of the CA proves a connection, even one the
  policy then denies every call, so proven alone must not keep a slot for good. Only when every
  connection holds a stream are the newest ones closed.

So idle unauthenticated connections push out each other, never a tracer's or an admin's: a client
that connects and completes its handshake (milliseconds) is proven before a flood can close it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0  # gRPC's deadline for TLS and HTTP/2 settings (grpc.server_handshake_timeout_ms)
UNPROVEN_S = HANDSHAKE_TIMEOUT_S + 1.0  # past this a live connection has been through the handshake
DEFAULT_MAX_CONNECTIONS = 10_000
FDS_RESERVED = 256  # the store, the audit log, the CRI sockets, the metrics port, gRPC's own
POLL_S = 0.1  # how often the gate looks while nothing changes
FAST_POLL_S = 0.02  # the next look after one that found new connections: a flood is cut short
FULL_SCAN_S = 1.0  # the longest a descriptor number reused for another socket goes unnoticed
CAP_LOG_INTERVAL_S = 60.0
FD_DIR = "/proc/self/fd"

Address = tuple[str, int]  # a client's (ip, port), IPv4-mapped IPv6 written as IPv4


def _fd_budget(fd_limit: int | None) -> int:
    if fd_limit is None:
        import resource

        fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(32, fd_limit - FDS_RESERVED)


def _slack(fits: int) -> int:
    return max(16, fits // 16)


def default_max_connections(fd_limit: int | None = None) -> int:
    """DEFAULT_MAX_CONNECTIONS, or fewer where the fd limit would not hold that many connections
    and the quota's slack above them (one descriptor each: gRPC's)."""
    fits = _fd_budget(fd_limit)
    return max(16, min(DEFAULT_MAX_CONNECTIONS, fits - _slack(fits)))


def connection_quota(max_connections_total: int, fd_limit: int | None = None) -> int:
    """gRPC's `grpc.max_allowed_incoming_connections` for listeners capped at `max_connections_total`
    together: the caps plus a slack, never more than the fd limit holds."""
    fits = _fd_budget(fd_limit)
    return min(fits, max_connections_total + _slack(fits))


def peer_address(grpc_peer: str) -> Address | None:
    """The client's address in gRPC's peer name (`ipv4:10.0.0.5:41234`, `ipv6:%5B::1%5D:41234`,
    `ipv6:[::1]:41234`); None for a unix socket or anything else."""
    kind, _, rest = grpc_peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = rest.replace("%5B", "[").replace("%5D", "]").rpartition(":")
    host = host.strip("[]")
    try:
        return _plain(host), int(port)
    except ValueError:
        return None


def _plain(ip: str) -> str:
    return ip[7:] if ip.startswith("::ffff:") and "." in ip else ip


@dataclass(slots=True, eq=False)
class _Conn:
    """One connection gRPC holds on the gate's port (the gate's thread only)."""

    inode: int
    fd: int
    address: Address
    seen_s: float
    proven: bool = False
    peer: str = ""  # gRPC's name for it, once an RPC came over it


class TcpGate:
    """The caps of one mTLS TCP port that gRPC serves (see the module's docstring)."""

    def __init__(self, port: int, max_connections: int, max_connections_per_source: int,
                 unproven_s: float = UNPROVEN_S, holds_stream: Callable[[str], bool] | None = None,
                 poll_s: float = POLL_S, fd_dir: str = FD_DIR) -> None:
        self.port = port
        self.max_connections = max_connections
        self.max_per_source = min(max_connections_per_source, max_connections)
        self.unproven_s, self.poll_s, self.fd_dir = unproven_s, poll_s, fd_dir
        # Whether a client (gRPC's peer name) has a response stream open; asked from the gate's
        # thread, so it must be a lock-free read (OpenStreams.holds). None: none ever does.
        self.holds_stream = holds_stream or (lambda _peer: False)
        # peer name -> when an RPC first came over it; written by gRPC's threads (one dict store
        # per new peer), read and pruned by the gate's.
        self._proven: dict[str, float] = {}
        self._conns: dict[int, _Conn] = {}  # inode -> every connection found, shut down ones too
        self._by_address: dict[Address, _Conn] = {}
        self._live: dict[_Conn, None] = {}  # admitted and not shut down, oldest first
        self._unproven: dict[_Conn, None] = {}  # oldest first; pruned as they age or are proven
        self._unproven_by_source: dict[str, dict[_Conn, None]] = {}
        self._others: set[int] = set()  # socket inodes that are not connections of this port
        self._names: list[str] = []
        self._full_scan_s = -FULL_SCAN_S
        # Two descriptors held for the gate's life: `_spare` takes a duplicate of gRPC's socket
        # with dup2 (atomic, and it needs no free slot in a process at its fd limit), `_null` puts
        # /dev/null back in its place.
        self._null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self._spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self.closed_for_room = 0
        self.refused = 0
        self._cap_logged_s = -CAP_LOG_INTERVAL_S
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- what the authorizer tells ---------------------------------------------------------------

    def prove(self, grpc_peer: str) -> None:
        """An RPC came over the connection gRPC names `grpc_peer`: its TLS handshake with a
        certificate of the CA is done. Any thread; a dict lookup and at most one store on the RPC
        path. A unix socket's peer is no connection of a TCP port: it is left out."""
        if grpc_peer.startswith("ip") and grpc_peer not in self._proven:
            self._proven[grpc_peer] = time.monotonic()

    @property
    def connections(self) -> int:
        return len(self._live)

    # ---- life cycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ghostgpu-tcp-gate", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        for fd in (self._spare, self._null):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._spare = self._null = -1

    def _run(self) -> None:
        wait_s = self.poll_s
        while not self._stop.wait(wait_s):
            try:
                found_new = self.check()
            except Exception as e:  # a look that failed must not end the caps: the next one retries
                log.warning("tcp gate :%d: %s", self.port, e)
                found_new = False
            wait_s = FAST_POLL_S if found_new else self.poll_s

    # ---- one look -------------------------------------------------------------------------------

    def check(self, now_s: float | None = None) -> bool:
        """Look at the process's descriptors once, and close what is past the caps; True when it
        found new connections."""
        now_s = time.monotonic() if now_s is None else now_s
        names = os.listdir(self.fd_dir)
        arrived: list[_Conn] = []
        if names != self._names or now_s - self._full_scan_s >= FULL_SCAN_S:
            self._names = names
            self._full_scan_s = now_s
            arrived = self._scan(names, now_s)
        self._join_proofs(now_s)
        self._age(now_s)
        for conn in arrived:  # in the order they came: each is admitted as if alone
            self._admit(conn)
        return bool(arrived)

    def _scan(self, names: list[str], now_s: float) -> list[_Conn]:
        """Bring the connection table up to the descriptors open now; the new connections, oldest
        first (socket inodes are handed out in increasing order)."""
        sockets: dict[int, int] = {}  # inode -> fd
        for name in names:
            try:
                target = os.readlink(f"{self.fd_dir}/{name}")
            except OSError:
                continue  # closed since the listing
            if target.startswith("socket:["):
                sockets[int(target[8:-1])] = int(name)
        for inode in [i for i in self._conns if i not in sockets]:
            self._forget(self._conns.pop(inode))
        self._others &= sockets.keys()
        arrived: list[_Conn] = []
        for inode in sorted(sockets.keys() - self._conns.keys() - self._others):
            address = self._connection_of(sockets[inode], inode)
            if address is None:
                self._others.add(inode)
            elif address != ("", 0):  # ("", 0): the descriptor changed under the look; next time
                conn = self._conns[inode] = _Conn(inode, sockets[inode], address, now_s)
                self._by_address[address] = conn
                arrived.append(conn)
        for inode, conn in self._conns.items():
            conn.fd = sockets[inode]
        return arrived

    def _connection_of(self, fd: int, inode: int) -> Address | None:
        """The client's address when descriptor `fd` (socket `inode`) is a connection of this port,
        None when it is another socket, ("", 0) when the descriptor no longer holds that socket."""
        def ask(sock: socket.socket) -> Address | None:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                return None
            if sock.getsockname()[1] != self.port:
                return None
            remote = sock.getpeername()  # OSError (ENOTCONN) for the listener itself
            return _plain(str(remote[0])), int(remote[1])

        try:
            return self._on_duplicate(fd, inode, ask)
        except OSError:
            return None

    def _on_duplicate(self, fd: int, inode: int, fn: Callable[[socket.socket], Address | None]
                      ) -> Address | None:
        """fn() on a socket object over a duplicate of `fd`, when it still holds socket `inode`;
        ("", 0) when it does not. The duplicate lives in `_spare`; /dev/null goes back after."""
        os.dup2(fd, self._spare)
        try:
            if os.fstat(self._spare).st_ino != inode:
                return "", 0
            sock = socket.socket(fileno=self._spare)
            try:
                return fn(sock)
            finally:
                sock.detach()  # the socket object must not close the spare descriptor
        finally:
            os.dup2(self._null, self._spare)

    def _join_proofs(self, now_s: float) -> None:
        """Mark the connections an RPC came over, each proof once (a later RPC over a proven one
        files it again, and it is dropped again); drop proofs whose connection is gone."""
        for peer, at_s in list(self._proven.items()):
            address = peer_address(peer)
            conn = self._by_address.get(address) if address is not None else None
            if conn is not None and conn.seen_s <= at_s + FULL_SCAN_S:
                if not conn.proven:
                    conn.proven, conn.peer = True, peer
                    self._unprove(conn)
                self._proven.pop(peer, None)
            elif now_s - at_s > self.unproven_s:
                # Its connection closed: a later connection from the same address and port must
                # earn its own proof.
                self._proven.pop(peer, None)

    def _age(self, now_s: float) -> None:
        """Unproven connections past the handshake deadline have been through it: no longer unproven."""
        while self._unproven:
            oldest = next(iter(self._unproven))
            if now_s - oldest.seen_s < self.unproven_s:
                return  # oldest first: the rest are younger
            self._unprove(oldest)

    def _admit(self, conn: _Conn) -> None:
        same = self._unproven_by_source.get(conn.address[0], {})
        if len(same) >= self.max_per_source:
            self._close(next(iter(same)), "room")
        if len(self._live) >= self.max_connections:
            victim = next(iter(self._unproven), None)
            if victim is None:
                victim = next((c for c in self._live if not self.holds_stream(c.peer)), None)
            if victim is None:
                self._close(conn, "refused")
                return
            self._close(victim, "room")
        self._live[conn] = None
        if not conn.proven:
            self._unproven[conn] = None
            self._unproven_by_source.setdefault(conn.address[0], {})[conn] = None

    def _close(self, conn: _Conn, reason: str) -> None:
        def shut(sock: socket.socket) -> Address | None:
            sock.shutdown(socket.SHUT_RDWR)
            return conn.address

        try:
            done = self._on_duplicate(conn.fd, conn.inode, shut)
        except OSError:  # closed by gRPC meanwhile (ENOTCONN, EBADF): nothing left to close
            done = conn.address
        if done != conn.address:
            self._full_scan_s = -FULL_SCAN_S  # its descriptor number moved on: look again next time
        self._live.pop(conn, None)
        self._unprove(conn)
        if reason == "refused":
            self.refused += 1
            self._cap_line(conn.address[0], "closed a new connection: every one holds an open stream")
        else:
            self.closed_for_room += 1
            self._cap_line(conn.address[0], "closed an idle connection for a new one")

    def _unprove(self, conn: _Conn) -> None:
        self._unproven.pop(conn, None)
        same = self._unproven_by_source.get(conn.address[0])
        if same is not None:
            same.pop(conn, None)
            if not same:
                del self._unproven_by_source[conn.address[0]]

    def _forget(self, conn: _Conn) -> None:
        self._live.pop(conn, None)
        self._unprove(conn)
        if self._by_address.get(conn.address) is conn:
            del self._by_address[conn.address]
        if conn.peer:
            self._proven.pop(conn.peer, None)

    def _cap_line(self, source: str, what: str) -> None:
        now_s = time.monotonic()
        if now_s - self._cap_logged_s >= CAP_LOG_INTERVAL_S:
            self._cap_logged_s = now_s
            unproven = len(self._unproven_by_source.get(source, ()))
            log.warning("collector :%d: %s: %d connections open (--max-connections %d), %d "
                        "unauthenticated from %s (--max-connections-per-source %d); %d closed for room and "
                        "%d refused so far", self.port, what, self.connections, self.max_connections,
                        unproven, source or "?", self.max_per_source, self.closed_for_room, self.refused)
