"""Every address ghostgpu reads or prints: parsing, validation and the forms clients dial.

Three shapes, each with the one-line error its flag has always given (tests match them):

- a gRPC address, HOST:PORT or unix:///absolute/path: the collector's --listen (what clients dial,
  --collector, which also takes a DNS name of replicas and a list, is
  ghostgpu/common/transport/collector_target.py);
- an HTTP listen address, HOST:PORT, [IPv6]:PORT or :PORT (all interfaces): --metrics-listen and
  --health-listen;
- a local unix socket, unix:///path or /path: the node's CRI runtime and kubelet PodResources.

A wrong address fails as the command starts, naming the flag, never at the first connection. The
checks raise ValueError, or the `error` class a caller passes (a server's own ListenError), so
callers keep the exception type they have always raised.
"""

from __future__ import annotations

import socket

DEFAULT_COLLECTOR = "127.0.0.1:7450"  # without --collector and $GHOSTGPU_COLLECTOR: `ghostgpu up`'s default
UNIX_SCHEME = "unix:"
_UNIX_PREFIX = "unix://"  # unix:// + /absolute/path: gRPC's spelling of a socket path
# A wildcard listen host and the loopback a client on the same host dials instead.
_LOOPBACK = {"0.0.0.0": "127.0.0.1", "::": "::1"}


def is_unix(address: str) -> bool:
    return address.startswith(UNIX_SCHEME)


def unix_address(path: str) -> str:
    """gRPC's address of the unix socket at `path` (absolute): unix:///path."""
    return _UNIX_PREFIX + path


def unix_path(address: str) -> str:
    """The socket path of unix:///path (what the collector unlinks when stale)."""
    return address.removeprefix(_UNIX_PREFIX)


def _port_ok(text: str, zero_ok: bool) -> bool:
    # Digits only: "-1", "+80" and " 80" are refused here, not by a bind that names no flag.
    return text.isdigit() and (0 if zero_ok else 1) <= int(text) < 65536


def grpc_address(addr: str, what: str, example: str, *, zero_ok: bool,
                 error: type[ValueError] = ValueError) -> str:
    """`addr` when it is HOST:PORT or unix:///absolute/path, else `error` naming `what`.

    zero_ok: a listener's port 0 picks a free one; a client cannot dial port 0."""
    if is_unix(addr):
        if not addr.startswith(_UNIX_PREFIX + "/"):
            raise error(f"{what} {addr!r}: a unix socket is written unix:///absolute/path")
        return addr
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not _port_ok(port, zero_ok):
        raise error(f"{what} {addr!r}: use HOST:PORT (e.g. {example}) or unix:///path")
    return addr


def grpc_listen(addr: str, error: type[ValueError] = ValueError) -> str:
    """The collector's --listen: HOST:PORT (port 0 picks a free one), [IPv6]:PORT, or unix:///absolute/path."""
    return grpc_address(addr, "--listen", "0.0.0.0:7450; port 0 picks a free one", zero_ok=True, error=error)


def parse_listen(addr: str, flag: str, error: type[ValueError] = ValueError) -> tuple[str, int]:
    """(host, port) of an HTTP listen address HOST:PORT, [IPv6]:PORT or :PORT (all interfaces); port 0
    picks a free one."""
    host, sep, port = addr.rpartition(":")
    if not sep or not _port_ok(port, zero_ok=True):
        raise error(f"{flag} {addr!r}: use HOST:PORT (e.g. 0.0.0.0:9400; port 0 picks a free one)")
    return host.strip("[]") or "0.0.0.0", int(port)


def socket_path(endpoint: str, flag: str = "--cri-endpoint", example: str = "runtime.sock", *,
                verb: str = "use") -> str:
    """unix:///path or /path -> /path; anything else is a one-line ValueError naming the flag.

    verb: the collector's --collector-cri-endpoint has always said "write it" where the tracer's
    flags say "use"."""
    path = endpoint.removeprefix(_UNIX_PREFIX)
    if not path.startswith("/"):
        raise ValueError(f"{flag} {endpoint!r}: {verb} unix:///absolute/path/to/{example}")
    return path


def socket_target(endpoint: str) -> str:
    """gRPC target for a local CRI endpoint, unix:///path or an absolute socket path."""
    return unix_address(socket_path(endpoint, "CRI endpoint", verb="write it"))


def host_port(host: str, port: int | str) -> str:
    """HOST:PORT, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def with_port(address: str, port: int) -> str:
    """HOST:0 as bound: the same host with the port the kernel chose."""
    return f"{address.rpartition(':')[0]}:{port}"


def port_of(address: str) -> int | None:
    """The port of HOST:PORT; None for a unix socket."""
    return None if is_unix(address) else int(address.rpartition(":")[2])


def dial_address(address: str) -> str:
    """Where a client on this host reaches a server listening on `address`: a wildcard host
    (0.0.0.0, [::] or ::) becomes loopback; anything else, unix sockets included, is as it is."""
    if is_unix(address):
        return address
    host, sep, port = address.rpartition(":")
    loopback = _LOOPBACK.get(host.strip("[]")) if sep else None
    return address if loopback is None else host_port(loopback, port)


def port_free(address: str) -> str | None:
    """None when HOST:PORT can be bound (or it is a unix socket), else why not. gRPC binds with
    SO_REUSEPORT, so a second collector would silently share the port with the first: a plain bind
    finds the listener."""
    if is_unix(address):
        return None
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, int(port)))
        except OSError as e:
            return e.strerror or str(e)
    return None
