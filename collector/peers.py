"""Who is at the other end of a plaintext connection: the kernel's word, never the client's.

gRPC (grpcio 1.85) gives a servicer only `context.peer()` and the TLS auth context: on a unix
socket the peer is "unix:" and SO_PEERCRED is out of reach, and a loopback TCP peer is just an
address. So:

- **Unix sockets** are served through `UnixGate`: the collector accepts on the public path itself,
  reads SO_PEERCRED (pid, uid, gid) of each connection, and relays it to the gRPC server's private
  socket (a 0700 directory only the collector can enter) from a socket bound to an abstract name
  it made up, `ghostgpu-peer-TOKEN-N`. gRPC then reports `unix-abstract:ghostgpu-peer-TOKEN-N` as the
  peer, which maps back to the uid. Nobody else can reach the private socket, and an abstract name
  is held by one socket at a time, so the mapping cannot be forged.
- **Loopback TCP**: the peer's socket is on this host, in this network namespace, so the kernel
  names the uid that owns it (sock_diag by the exact socket, collector/sockdiag.py; /proc/net/tcp
  where netlink is refused), as identd did. Looked up per call, not cached: a port freed and reused
  by another user must not inherit the first one's identity.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import socket
import struct
import tempfile
import threading

from ghostgpu.collector.sockdiag import DiagUnavailable, socket_uid

from ghostgpu.common.principal import Principal

log = logging.getLogger(__name__)

PEER_PREFIX = "ghostgpu-peer-"
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid (include/linux/socket.h)
_ESTABLISHED = 1  # TCP_ESTABLISHED in /proc/net/tcp's st column (include/net/tcp_states.h)
RELAY_CHUNK_BYTES = 256 * 1024


def _hex_ip(text: str) -> str:
    """/proc/net/tcp's address: IPv4 as one little-endian 32-bit word, IPv6 as four of them."""
    raw = bytes.fromhex(text)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    if len(words) == 4:
        return socket.inet_ntop(socket.AF_INET, words)
    ip6 = socket.inet_ntop(socket.AF_INET6, words)
    return ip6[7:] if ip6.startswith("::ffff:") and "." in ip6 else ip6  # a v4-mapped peer


TcpRow = tuple[str, int, str, int, int, int]  # local ip, local port, remote ip, remote port, state, uid


def parse_tcp_row(line: str) -> TcpRow | None:
    """One row of /proc/net/tcp or tcp6; None for the header or a line cut by a concurrent change
    (the next lookup reads it whole)."""
    fields = line.split()
    if len(fields) < 8:
        return None
    try:
        (lip, lport), (rip, rport) = (f.split(":") for f in fields[1:3])
        return _hex_ip(lip), int(lport, 16), _hex_ip(rip), int(rport, 16), int(fields[3], 16), int(fields[7])
    except ValueError:
        return None


def parse_proc_net_tcp(text: str) -> list[TcpRow]:
    """The rows of /proc/net/tcp or tcp6, past its header line."""
    return [row for line in text.splitlines()[1:] if (row := parse_tcp_row(line)) is not None]


def parse_peer(peer: str) -> tuple[str, int] | None:
    """gRPC's "ipv4:127.0.0.1:5432" / "ipv6:[::1]:5432" -> (host, port); None for anything else."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = rest.rpartition(":")
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        return None


def is_loopback(host: str) -> bool:
    return host == "::1" or host.startswith("127.")


def loopback_uid(peer: str, server_ports: set[int], proc_net: str | None = None) -> int | None:
    """The uid owning a loopback TCP peer's socket, None when it is not a loopback peer or not found
    (it closed meanwhile). Only an established socket whose far end is one of our ports counts.
    Asked of the kernel by the exact socket (collector/sockdiag.py); /proc/net/tcp (or `proc_net`,
    for tests) only where netlink cannot be asked."""
    where = parse_peer(peer)
    if where is None or not is_loopback(where[0]):
        return None
    host, port = where
    if proc_net is None:
        # A loopback client dialed one of our ports, most often on its own address (127.0.0.1 ->
        # 127.0.0.1); a listener on 0.0.0.0 (--insecure) may also be reached at another 127/8 one.
        targets = dict.fromkeys([host, "::1" if ":" in host else "127.0.0.1"])
        try:
            for dst in targets:
                for dport in sorted(server_ports):
                    uid = socket_uid(host, port, dst, dport)
                    if uid is not None:
                        return uid
            return None
        except DiagUnavailable as e:
            log.debug("loopback peer %s: %s; reading /proc/net/tcp", peer, e)
    return _proc_net_uid(host, port, server_ports, proc_net or "/proc/self/net")


def _proc_net_uid(host: str, port: int, server_ports: set[int], proc_net: str) -> int | None:
    needle = f":{port:04X} "  # the local port as the table writes it: skip the other lines unparsed
    for name in ("tcp", "tcp6"):
        try:
            with open(f"{proc_net}/{name}") as f:
                rows = [row for line in f if needle in line and (row := parse_tcp_row(line)) is not None]
        except OSError:
            continue  # no IPv6 on this kernel
        for lip, lport, _rip, rport, state, uid in rows:
            if lport == port and lip == host and rport in server_ports and state == _ESTABLISHED:
                return uid
    return None


class UnixGate:
    """The public unix socket in front of the gRPC server's private one (see the module doc).

    Runs its own thread and event loop: relaying bytes must not wait behind the collector's loop,
    which may be busy ingesting."""

    def __init__(self, public_path: str) -> None:
        self.public_path = public_path
        self._dir = tempfile.mkdtemp(prefix="ghostgpu-grpc-")  # 0700: only this user enters
        self.internal_address = f"unix://{self._dir}/grpc.sock"
        self._token = secrets.token_hex(6)
        self._next = 0
        self._peers: dict[str, Principal] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None

    def principal(self, peer: str) -> Principal | None:
        """The uid principal of a connection relayed here, from gRPC's `unix-abstract:...` peer."""
        _, _, name = peer.partition(":")
        with self._lock:
            return self._peers.get(name)

    def start(self) -> None:
        """Listen on the public path; raises OSError (the caller names the flag) when it cannot."""
        started = threading.Event()
        errors: list[BaseException] = []

        async def serve() -> None:
            try:
                self._server = await asyncio.start_unix_server(self._accept, self.public_path)
                os.chmod(self.public_path, 0o666)  # anyone may connect; the policy decides what they get
            except OSError as e:
                errors.append(e)
                return
            finally:
                started.set()
            await self._server.serve_forever()

        def run() -> None:
            loop = self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            with contextlib.suppress(asyncio.CancelledError):
                loop.run_until_complete(serve())
            pending = asyncio.all_tasks(loop)  # relays still open: end them with the gate
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.wait(pending))
            loop.close()

        self._thread = threading.Thread(target=run, name="ghostgpu-unix-gate", daemon=True)
        self._thread.start()
        started.wait()
        if errors:
            self._thread.join()
            raise errors[0]

    def stop(self) -> None:
        loop, server = self._loop, self._server
        if loop is not None and server is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop ended meanwhile
                loop.call_soon_threadsafe(server.close)  # cancels serve_forever
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        with contextlib.suppress(OSError):
            os.unlink(self.public_path)
        shutil.rmtree(self._dir, ignore_errors=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        try:
            cred = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            pid, uid, _gid = _UCRED.unpack(cred)
        except OSError:
            writer.close()
            return
        with self._lock:
            self._next += 1
            name = f"{PEER_PREFIX}{self._token}-{self._next}"
            self._peers[name] = Principal("uid", str(uid), via="unix", peer=f"unix pid {pid}")
        inner = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            inner.bind("\0" + name)
            inner.setblocking(False)
            await asyncio.get_running_loop().sock_connect(inner, self.internal_address[len("unix://"):])
            r2, w2 = await asyncio.open_unix_connection(sock=inner, limit=RELAY_CHUNK_BYTES)
        except OSError as e:
            log.warning("unix socket %s: cannot reach the gRPC server (%s); dropped a connection",
                        self.public_path, e)
            inner.close()
            writer.close()
            with self._lock:
                self._peers.pop(name, None)
            return
        try:
            await asyncio.gather(_pipe(reader, w2), _pipe(r2, writer))
        finally:
            with self._lock:
                self._peers.pop(name, None)


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(RELAY_CHUNK_BYTES):
            dst.write(data)
            await dst.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            dst.close()
