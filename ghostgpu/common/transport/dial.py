"""One way to open a gRPC channel to the collector, plaintext or mTLS, for every client: the
tracer's stream (tracer/stream_session.py) and the commands (cli/client.py).

A channel is made per connection attempt by the tracer and per command by the CLI, and the TLS
files are read each time: a certificate rotated on disk (cert-manager rewriting a mounted Secret)
is used from the next connection on, with no restart.

**Who serves a plaintext collector** (docs/SECURITY.md, "Plaintext only where nobody else can
connect"). Over TLS the collector's certificate says who it is. Over a unix socket or loopback
nothing does, and any local user may bind a free port or a socket path first: a fake collector
would then receive a tracer's Hello, snapshot and events and answer its commands, or feed `ps`
what it likes. So before a plaintext channel is opened, the kernel is asked who serves it, as the
collector asks who its clients are:
- a unix socket: SO_PEERCRED of a connection to it (the uid of the process that listens);
- TCP to this host: the uid owning the socket listening on the port, the one a connection there
  reaches (sock_diag, /proc/net/tcp where netlink is refused; ghostgpu/common/transport/sockdiag.py). This
  host is loopback in any spelling (127/8, ::1, a v4-mapped ::ffff:127.0.0.1, and the wildcards
  0.0.0.0 and ::, which a connect() takes to this host) and every address of its own interfaces
  (one it can bind): a local user can squat a port on those as well.
Accepted: root, this process's own uid (a process of one's own uid can do what it likes to one
anyway), and `collector_uid` (`--collector-uid`, for a collector run as another user, e.g. 65532).
Anything else raises CollectorRefused, one line. A collector that does not answer is left to gRPC
to report as unreachable. The check is made per channel, so it sees a port taken over between two
connections; only a swap in the milliseconds between the check and gRPC's own connect would pass,
and that needs the real collector's port or socket path free at that moment (a port another uid
holds cannot be bound; a socket in a root-owned directory cannot be replaced).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import struct
from collections.abc import Sequence
from typing import Any

import grpc

from ghostgpu.common.transport.addresses import dial_address
from ghostgpu.common.transport.sockdiag import DiagUnavailable, listener_uid, proc_net_listener_uid
from ghostgpu.common.transport.tls import TlsFiles, channel_credentials

CHECK_TIMEOUT_S = 2.0
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class CollectorRefused(ConnectionError):
    """The plaintext collector at the address is served by a uid this client does not trust."""


def open_channel(target: str, tls: TlsFiles | None, options: Sequence[tuple[str, Any]] = (),
                 collector_uid: int | None = None) -> grpc.Channel:
    """A channel to `target` (HOST:PORT or unix:///path); mTLS when `tls` names files.
    A unix socket is always plaintext: the collector knows its peer from SO_PEERCRED, and this
    client checks who serves it (CollectorRefused, see the module doc), as it does on loopback."""
    if tls is None or not tls.enabled or target.startswith("unix:"):
        check_plaintext_collector(target, collector_uid)
        return grpc.insecure_channel(target, options=list(options))
    return grpc.secure_channel(target, channel_credentials(tls), options=list(options))


def trusted_uids(collector_uid: int | None) -> set[int]:
    return {0, os.geteuid()} | ({collector_uid} if collector_uid is not None else set())


def check_plaintext_collector(target: str, collector_uid: int | None = None) -> None:
    """Raise CollectorRefused when the collector at `target` (unix:///path, or a loopback HOST:PORT)
    is served by another uid than trusted_uids(); return when it is trusted, when nobody answers
    there (gRPC says it is unreachable) and for other addresses (plaintext to the network is the
    collector's --insecure choice, and nothing local can be asked)."""
    uid = serving_uid(target)
    if uid is None or uid in trusted_uids(collector_uid):
        return
    others = f"root or --collector-uid {collector_uid}" if collector_uid is not None else "root"
    raise CollectorRefused(
        f"collector {target} is served by uid {uid}, not {others}: refusing to send it anything or "
        f"believe its answers (another local user may have taken the address); if uid {uid} does run "
        f"your collector, pass --collector-uid {uid}")


def serving_uid(target: str) -> int | None:
    """The uid serving a unix socket or TCP `target` on this host; None when nobody answers or the
    target is neither."""
    if target.startswith("unix://"):
        return _unix_uid(target[len("unix://"):])
    if target.startswith("unix:"):
        return _unix_uid(target[len("unix:"):])
    host, _, port_text = dial_address(target).rpartition(":")
    host = host.strip("[]")
    try:
        port = int(port_text)
    except ValueError:
        return None
    uids = [uid for uid in _local_uids(host, port) if uid is not None]
    # Every address the name resolves to counts: gRPC may dial any of them.
    untrusted = [uid for uid in uids if uid not in (0, os.geteuid())]
    return untrusted[0] if untrusted else (uids[0] if uids else None)


def _unix_uid(path: str) -> int | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    uid: int
    with contextlib.closing(s):
        s.settimeout(CHECK_TIMEOUT_S)
        try:
            s.connect(path)
            _pid, uid, _gid = _UCRED.unpack(s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        except OSError:
            return None
        return uid


def _local_uids(host: str, port: int) -> list[int | None]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    out: list[int | None] = []
    for ip in dict.fromkeys(str(info[4][0]) for info in infos):
        loopback = loopback_of(ip)
        if loopback is not None:
            out.append(_listener(loopback, port))
        elif _on_this_host(ip):  # one of this host's own addresses: a local socket may listen there
            out.append(_listener(ip, port))
        # another host: nothing local to ask (plaintext to the network is --insecure's business)
    return out


def loopback_of(ip: str) -> str | None:
    """The loopback address a connection to `ip` reaches when `ip` is loopback in any spelling:
    127/8 and ::1 as they are, v4-mapped ones (::ffff:127.0.0.1) as IPv4, the wildcards (0.0.0.0,
    ::, ::ffff:0.0.0.0) as 127.0.0.1 or ::1, where Linux takes a connect() to them; None for any other."""
    try:
        addr: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.ip_address(ip)
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if addr.is_loopback:
        return str(addr)
    if addr.is_unspecified:
        return "127.0.0.1" if addr.version == 4 else "::1"
    return None


def _on_this_host(ip: str) -> bool:
    """Whether `ip` is an address of this host's interfaces: only those can be bound. (A socket
    listening on a wildcard would also answer sock_diag for another host's address and port, so
    this is asked first.)"""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, 0))
        except OSError:
            return False
    return True


def _listener(ip: str, port: int) -> int | None:
    """The uid owning the socket listening on ip:port, the one a connection there reaches."""
    try:
        return listener_uid(ip, port)
    except DiagUnavailable:
        return proc_net_listener_uid(ip, port)
