"""One way to open a gRPC channel to the collector, plaintext or mTLS, for every client: the
tracer's stream (tracer/stream_session.py) and the commands (cli/client.py).

**Replicas.** The address may name several collectors (ghostgpu/common/transport/collector_target.py:
a DNS name whose records are the replicas, or a list). gRPC picks among them with its own
`pick_first` policy and `shuffleAddressList` (gRFC A62, honoured by grpcio 1.85.3: many channels
spread over the replicas, measured in tests/unit/test_collector_replicas.py), so each tracer keeps
one stream to one replica and the tracers of a cluster spread over them; a dead address is passed
over at once (refused) or after 250 ms (no answer: gRPC's Happy Eyeballs delay, gRFC A61). Names
in a list are resolved here at each connection (grpcio has no static resolver for several names).
Over TLS the name checked is the host as written (the first of a list), never an IP it resolved to.

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
import json
import os
import socket
import struct
from collections.abc import Sequence
from typing import Any

import grpc

from ghostgpu.common.transport.addresses import dial_address, host_port
from ghostgpu.common.transport.collector_target import CollectorTarget, parse_collector
from ghostgpu.common.transport.sockdiag import DiagUnavailable, listener_uid, proc_net_listener_uid
from ghostgpu.common.transport.tls import TlsFiles, channel_credentials

CHECK_TIMEOUT_S = 2.0
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


# gRFC A62: pick_first over the addresses in a random order, so the tracers of a cluster spread over
# the replicas, one stream each (a hand-written picker would redo what gRPC does).
PICK_FIRST_SHUFFLED = json.dumps({"loadBalancingConfig": [{"pick_first": {"shuffleAddressList": True}}]})


class CollectorRefused(ConnectionError):
    """The plaintext collector at the address is served by a uid this client does not trust."""


class CollectorUnresolved(ConnectionError):
    """None of the names of a --collector list resolves now (retried like an unreachable collector)."""


def open_channel(target: str | CollectorTarget, tls: TlsFiles | None,
                 options: Sequence[tuple[str, Any]] = (), collector_uid: int | None = None) -> grpc.Channel:
    """A channel to `target` (any form collector_target.py parses); mTLS when `tls` names files.
    A unix socket is always plaintext: the collector knows its peer from SO_PEERCRED, and this
    client checks who serves it (CollectorRefused, see the module doc), as it does on loopback, for
    each address of the target. ValueError for an address that does not parse; CollectorUnresolved
    when a list's names all fail to resolve."""
    spec = target if isinstance(target, CollectorTarget) else parse_collector(target)
    literals = resolve_list(spec) if spec.needs_resolving else []
    grpc_target = spec.grpc_target(literals)
    secure = tls is not None and tls.enabled and spec.kind != "unix"
    server_name = tls.server_name if secure and tls is not None else None
    channel_options = [*options, *collector_channel_options(spec, secure=secure, server_name=server_name)]
    if not secure:
        for address in plaintext_checked(spec, literals):
            check_plaintext_collector(address, collector_uid)
        return grpc.insecure_channel(grpc_target, options=channel_options)
    assert tls is not None
    return grpc.secure_channel(grpc_target, channel_credentials(tls), options=channel_options)


def collector_channel_options(spec: CollectorTarget, *, secure: bool,
                              server_name: str | None = None) -> list[tuple[str, Any]]:
    """The replicas' policy, and for a list the name gRPC would otherwise take from the IPs.
    `server_name` (--tls-server-name): over TLS, the name checked instead of the host written."""
    if spec.kind == "unix":
        return []
    options: list[tuple[str, Any]] = [
        ("grpc.service_config", PICK_FIRST_SHUFFLED),
        # Our policy, not one a DNS TXT record might carry.
        ("grpc.service_config_disable_resolution", 1),
        # Each channel its own connections. With the process-wide subchannel pool a new channel's
        # pick_first takes a connection another channel of the process already has READY, so every
        # channel of a process lands on one replica whatever the shuffle (grpcio 1.85.3, measured).
        ("grpc.use_local_subchannel_pool", 1),
    ]
    if spec.kind == "list":
        # gRPC's authority for ipv4:/ipv6: targets is made of the literals; the :authority and the
        # TLS check (grpcio 1.85.3 checks the default authority's host) are the name written.
        options.append(("grpc.default_authority", spec.authority))
    if secure and (server_name or spec.kind == "list"):
        # The name the certificate is checked against (and the TLS SNI), grpcio 1.85.3.
        options.append(("grpc.ssl_target_name_override", server_name or spec.server_name))
    return options


def resolve_list(spec: CollectorTarget) -> list[tuple[str, int]]:
    """(ip, port) of every item of a list, its names resolved now (getaddrinfo), in the order
    written, each once. CollectorUnresolved when nothing resolves; a name that fails while others
    resolve is left out until the next connection."""
    out: dict[tuple[str, int], None] = {}
    failed: list[str] = []
    for endpoint in spec.endpoints:
        if endpoint.ip is not None:
            out[(endpoint.host, endpoint.port)] = None
            continue
        try:
            infos = socket.getaddrinfo(endpoint.host, endpoint.port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            failed.append(f"{endpoint.host}: {getattr(exc, 'strerror', None) or exc}")
            continue
        for info in infos:
            if info[0] in (socket.AF_INET, socket.AF_INET6):
                out[(str(info[4][0]), endpoint.port)] = None
    if not out:
        raise CollectorUnresolved(f"collector {spec.text}: none of its names resolves ({'; '.join(failed)}); "
                                  "check the names in --collector, or list IP addresses")
    return list(out)


def plaintext_checked(spec: CollectorTarget, literals: Sequence[tuple[str, int]]) -> list[str]:
    """The addresses whose serving uid is asked before a plaintext channel opens: the socket, the
    address (a name: every address it resolves to, serving_uid), or each address of a list as dialled."""
    if spec.kind == "unix":
        return [spec.unix]
    if spec.kind == "list":
        return [host_port(ip, port) for ip, port in literals] or [str(e) for e in spec.endpoints]
    return [str(spec.endpoints[0])]


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
    ips = [str(info[4][0]) for info in infos]
    if host.lower().rstrip(".") == "localhost" or host.lower().rstrip(".").endswith(".localhost"):
        # gRPC's own resolver (c-ares, grpcio 1.85.3) answers localhost with both ::1 and 127.0.0.1
        # even where getaddrinfo gives 127.0.0.1 alone (an /etc/hosts without ::1): ask about both.
        ips += ["127.0.0.1", "::1"]
    out: list[int | None] = []
    for ip in dict.fromkeys(ips):
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
