"""Who is at the other end of a plaintext connection: the kernel's word, never the client's.

gRPC (grpcio 1.85) gives a servicer only `context.peer()` and the TLS auth context: on a unix
socket the peer is "unix:" and SO_PEERCRED is out of reach, and a loopback TCP peer is just an
address. So:

- **Unix sockets** are served through `UnixGate`: the collector accepts on the public path itself,
  reads SO_PEERCRED (pid, uid, gid) of each connection, and relays it to the gRPC server's private
  socket from a socket bound to a path of its own in the same private directory (0700, the
  collector's: nobody else can enter it, so nobody else can bind a name there or reach the server),
  `DIR/peer-N`. gRPC then reports `unix:DIR/peer-N` as the peer, which maps back to the uid. The path
  is unlinked as soon as the relay is connected (the socket keeps its name) and N never repeats.
  Abstract names (`\0...`) are not used: anyone sees them in /proc/net/unix and may bind one first,
  which refused every relayed connection.
- **Loopback TCP**: the peer's socket is on this host, in this network namespace, so the kernel
  names the uid that owns it (sock_diag by the exact socket, ghostgpu/common/transport/sockdiag.py;
  /proc/net/tcp where netlink is refused), as identd did. Looked up per call, not cached: a port
  freed and reused by another user must not inherit the first one's identity.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import struct
import tempfile
import threading

from ghostgpu.common.transport.principal import Principal
from ghostgpu.common.transport.sockdiag import TCP_ESTABLISHED_ST, DiagUnavailable, parse_tcp_row, socket_uid

log = logging.getLogger(__name__)

PEER_NAME = "peer-"  # DIR/peer-N: a relayed connection's own socket in the private directory
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid (include/linux/socket.h)
RELAY_CHUNK_BYTES = 256 * 1024


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
    Asked of the kernel by the exact socket (ghostgpu/common/transport/sockdiag.py); /proc/net/tcp (or
    `proc_net`, for tests) only where netlink cannot be asked."""
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
            if lport == port and lip == host and rport in server_ports and state == TCP_ESTABLISHED_ST:
                return uid
    return None


class UnixGate:
    """The public unix socket in front of the gRPC server's private one (see the module doc).

    Runs its own thread and event loop: relaying bytes must not wait behind the collector's loop,
    which may be busy ingesting."""

    def __init__(self, public_path: str) -> None:
        self.public_path = public_path
        self._dir = tempfile.mkdtemp(prefix="ghostgpu-grpc-")  # 0700: only this user enters
        os.chmod(self._dir, 0o700)  # whatever the umask (mkdtemp asks for 0700 already)
        self.internal_address = f"unix://{self._dir}/grpc.sock"
        self._next = 0
        self._peers: dict[str, Principal] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None

    def principal(self, peer: str) -> Principal | None:
        """The uid principal of a connection relayed here, from gRPC's `unix:DIR/peer-N` peer."""
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
            name = os.path.join(self._dir, f"{PEER_NAME}{self._next}")
            self._peers[name] = Principal("uid", str(uid), via="unix", peer=f"unix pid {pid}")
        inner = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            inner.bind(name)  # in the 0700 directory: no other user can have taken it
            try:
                inner.setblocking(False)
                await asyncio.get_running_loop().sock_connect(inner, self.internal_address[len("unix://"):])
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(name)  # the connected socket keeps its name; the directory stays clean
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
