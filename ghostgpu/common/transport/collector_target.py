"""The collector address a client dials (`--collector`, `$GHOSTGPU_COLLECTOR`), parsed: pure, no I/O.

The collector may run as several replicas behind one Service. A client names them in one of four
forms, and gRPC's own resolvers and its `pick_first` policy do the rest (ghostgpu/common/transport/dial.py):

| written | gRPC target | what gRPC dials |
|---|---|---|
| `unix:///absolute/path` | as written | a local collector's socket |
| `IP:PORT`, `[IPv6]:PORT` | as written | one collector |
| `NAME:PORT`, `dns:///NAME:PORT` | `dns:///NAME:PORT` | every A/AAAA record (headless Service) |
| `HOST:PORT,HOST:PORT,...` | `ipv4:A:P,B:P`, `ipv6:[A]:P,...` | every item, names resolved each time |

A list of IP literals is gRPC's static `ipv4:`/`ipv6:` target as it is. A name inside a list has
to be turned into literals by the client at each (re)connection: grpcio (1.85.3 here) has no
static resolver for several names, and a channel has one target. One target holds one address
family; a list with both is written `ipv6:` with each IPv4 address in its v4-mapped form
(`[::ffff:10.0.0.1]`), which gRPC connects as plain IPv4 (measured with grpcio 1.85.3).

Over TLS one name is checked for every address of a channel: the host of the address as written,
never an IP a name resolved to. For a list that is the first item's host, so every replica's
certificate must name it (`ghostgpu certs issue --collector NAME[,NAME...]`).

A wrong address fails as the command starts, in one line naming where it came from (`--collector`
or `GHOSTGPU_COLLECTOR`) and what to write.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from ghostgpu.common.transport.addresses import DEFAULT_COLLECTOR, host_port, is_unix

FORMS = ("HOST:PORT, NAME:PORT (every address the name resolves to is a replica), "
         "HOST:PORT,HOST:PORT,... or unix:///path")
ENV = "GHOSTGPU_COLLECTOR"
_DNS_PREFIX = "dns:///"
# RFC 1123 host names, with the underscore some internal zones use; a trailing dot is a rooted name.
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_NAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*\.?")
_DOTTED_DIGITS = re.compile(r"[0-9.]+")
# Schemes gRPC knows and a user may paste: ghostgpu writes them itself, from the forms above.
_OTHER_SCHEMES = ("ipv4:", "ipv6:", "unix-abstract:", "vsock:", "xds:", "dns:")

Kind = Literal["unix", "address", "dns", "list"]
IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class Endpoint:
    """One HOST:PORT: a name, or an IP literal (without brackets)."""

    host: str
    port: int

    @property
    def ip(self) -> IpAddress | None:
        try:
            return ipaddress.ip_address(self.host)
        except ValueError:
            return None

    def __str__(self) -> str:
        return host_port(self.host, self.port)


@dataclass(frozen=True)
class CollectorTarget:
    """A parsed collector address. `text` is how it was written, for messages."""

    text: str
    kind: Kind
    endpoints: tuple[Endpoint, ...] = ()  # none for a unix socket
    unix: str = ""  # unix:///path

    @property
    def server_name(self) -> str:
        """The name TLS checks: the first host as written ("" for a unix socket)."""
        return self.endpoints[0].host if self.endpoints else ""

    @property
    def authority(self) -> str:
        """HOST:PORT of the first item: the channel's authority (gRPC would otherwise derive it from
        the whole ipv4:/ipv6: target it is given for a list)."""
        return str(self.endpoints[0]) if self.endpoints else ""

    @property
    def needs_resolving(self) -> bool:
        """A list with a name in it: the client resolves it at each connection (dial.py)."""
        return self.kind == "list" and any(e.ip is None for e in self.endpoints)

    def grpc_target(self, literals: Sequence[tuple[str, int]] = ()) -> str:
        """gRPC's target. `literals`: (ip, port) of a list whose names were resolved (needed when
        needs_resolving)."""
        if self.kind == "unix":
            return self.unix
        if self.kind == "dns":
            return _DNS_PREFIX + str(self.endpoints[0])
        if self.kind == "address":
            return str(self.endpoints[0])
        if not literals:
            if self.needs_resolving:
                raise ValueError(f"collector {self.text}: its names must be resolved before dialling")
            literals = [(e.host, e.port) for e in self.endpoints]
        return static_target(literals)


def static_target(literals: Sequence[tuple[str, int]]) -> str:
    """gRPC's static target for IP literals: ipv4:A:P,B:P when all are IPv4, else ipv6:[A]:P,...
    with each IPv4 address v4-mapped (one target holds one family)."""
    if not literals:
        raise ValueError("a static target needs at least one address")
    ips = [(ipaddress.ip_address(ip), ip, port) for ip, port in literals]
    if all(isinstance(ip, ipaddress.IPv4Address) for ip, _, _ in ips):
        return "ipv4:" + ",".join(f"{ip}:{port}" for ip, _, port in ips)
    # A zone (fe80::1%eth0) stays as written: gRPC's ipv6: parser takes it.
    return "ipv6:" + ",".join(f"[{'::ffff:' + str(ip) if ip.version == 4 else text}]:{port}"
                              for ip, text, port in ips)


class _Bad(ValueError):
    """What is wrong with an item, before the caller adds where it came from."""


def parse_collector(text: str, label: str = "--collector") -> CollectorTarget:
    """`text` parsed, else ValueError: one line, `label 'text': what is wrong; what to write`."""
    written = text.strip()
    try:
        if not written:
            raise _Bad(f"empty; write {FORMS}")
        if "," in written:
            return _parse_list(written)
        if is_unix(written):
            if not written.startswith("unix:///"):
                raise _Bad("a unix socket is written unix:///absolute/path")
            return CollectorTarget(written, "unix", unix=written)
        if written.startswith("dns:"):
            if not written.startswith(_DNS_PREFIX):
                raise _Bad("a DNS server in the target (dns://SERVER/) is not supported; write "
                           "dns:///NAME:PORT or NAME:PORT")
            endpoint = _endpoint(written[len(_DNS_PREFIX):])
            return CollectorTarget(written, "dns", (endpoint,))
        _no_scheme(written)
        endpoint = _endpoint(written)
        return CollectorTarget(written, "address" if endpoint.ip is not None else "dns", (endpoint,))
    except _Bad as bad:
        raise ValueError(f"{label} {text!r}: {bad}") from None


def _parse_list(written: str) -> CollectorTarget:
    endpoints: list[Endpoint] = []
    for number, raw in enumerate(written.split(","), 1):
        item = raw.strip()
        if not item:
            raise _Bad(f"item {number} is empty; write HOST:PORT,HOST:PORT with no empty item")
        if is_unix(item):
            raise _Bad(f"a unix socket ({item}) cannot be one of a list (gRPC dials one socket path); "
                       "give unix:///path alone, or list HOST:PORT items")
        _no_scheme(item, listed=True)
        endpoint = _endpoint(item)
        if endpoint in endpoints:
            raise _Bad(f"{endpoint} is listed twice; list each collector once")
        endpoints.append(endpoint)
    return CollectorTarget(written, "list", tuple(endpoints))


def _no_scheme(item: str, listed: bool = False) -> None:
    # A host that happens to be called like a scheme ("vsock:7450") is HOST:PORT.
    scheme = next((s for s in _OTHER_SCHEMES if item.startswith(s) and not item[len(s):].isdigit()), None)
    if scheme is None and "://" in item:
        scheme = item.partition("://")[0] + "://"
    if scheme is None:
        return
    if listed:
        raise _Bad(f"{item!r} has a scheme ({scheme}); a list takes HOST:PORT items (IP literals or names), "
                   "and ghostgpu writes gRPC's ipv4:/ipv6: target itself")
    raise _Bad(f"the scheme {scheme} is not taken; write {FORMS}")


def _endpoint(item: str) -> Endpoint:
    """HOST:PORT, [IPv6]:PORT."""
    host, sep, port = item.rpartition(":")
    if not sep:
        raise _Bad(f"{item!r} has no port; write HOST:PORT (e.g. 127.0.0.1:7450), or {FORMS}")
    if not host:
        raise _Bad(f"{item!r} has no host; write HOST:PORT (e.g. 127.0.0.1:7450), or {FORMS}")
    if not (port.isdigit() and 1 <= int(port) < 65536):  # digits only: "-1", "+80", " 80" refused
        raise _Bad(f"{item!r}: the port must be a number from 1 to 65535; write HOST:PORT, e.g. "
                   "collector.ghostgpu.svc:7450")
    if host.startswith("["):
        inner = host[1:-1] if host.endswith("]") else ""
        try:
            ip = ipaddress.ip_address(inner)
            if not isinstance(ip, ipaddress.IPv6Address):
                raise ValueError
        except ValueError:
            raise _Bad(f"{item!r}: brackets hold an IPv6 address, e.g. [::1]:7450") from None
        return Endpoint(str(ip), int(port))  # one spelling, so a list names each address once
    if ":" in host:
        raise _Bad(f"{item!r}: an IPv6 address is written in brackets with its port, e.g. [::1]:7450")
    if _DOTTED_DIGITS.fullmatch(host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise _Bad(f"{item!r}: {host} is not an IPv4 address") from None
    elif not _NAME.fullmatch(host):
        raise _Bad(f"{item!r}: {host!r} is not a host name or IP address; write HOST:PORT, e.g. "
                   "collector.ghostgpu.svc:7450")
    return Endpoint(host, int(port))


def collector_address(value: str | None, env: Mapping[str, str] | None = None) -> str:
    """The collector address to dial, checked: the flag, else $GHOSTGPU_COLLECTOR, else the default
    (`ghostgpu up`'s). ValueError naming the one it came from."""
    env = os.environ if env is None else env
    if value:
        text, label = value, "--collector"
    elif env.get(ENV):
        text, label = env[ENV], ENV
    else:
        text, label = DEFAULT_COLLECTOR, "--collector"
    parse_collector(text, label)
    return text.strip()
