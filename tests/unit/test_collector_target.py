"""ghostgpu/common/transport/collector_target.py: every form --collector takes, the gRPC target and the
names each becomes, and one line for every address that cannot work. Pure: nothing is dialled."""

from __future__ import annotations

import pytest

from ghostgpu.common.transport.collector_target import (
    FORMS,
    Endpoint,
    collector_address,
    parse_collector,
    static_target,
)

# written -> (kind, gRPC target or None when names are resolved at connect, TLS server name, authority)
GOOD: list[tuple[str, str, str | None, str, str]] = [
    ("127.0.0.1:7450", "address", "127.0.0.1:7450", "127.0.0.1", "127.0.0.1:7450"),
    ("[::1]:7450", "address", "[::1]:7450", "::1", "[::1]:7450"),
    ("unix:///run/ghostgpu/collector.sock", "unix", "unix:///run/ghostgpu/collector.sock", "", ""),
    # a name: gRPC's dns resolver, every A/AAAA record a replica
    ("ghostgpu-collector.ghostgpu.svc:7450", "dns", "dns:///ghostgpu-collector.ghostgpu.svc:7450",
     "ghostgpu-collector.ghostgpu.svc", "ghostgpu-collector.ghostgpu.svc:7450"),
    ("dns:///collector.example:7450", "dns", "dns:///collector.example:7450", "collector.example",
     "collector.example:7450"),
    ("localhost:1", "dns", "dns:///localhost:1", "localhost", "localhost:1"),
    ("collector.example.:65535", "dns", "dns:///collector.example.:65535", "collector.example.",
     "collector.example.:65535"),
    ("vsock:7450", "dns", "dns:///vsock:7450", "vsock", "vsock:7450"),  # a host called like a scheme
    # lists: IP literals are gRPC's static targets; names are resolved at each connection
    ("10.0.0.1:7450,10.0.0.2:7450", "list", "ipv4:10.0.0.1:7450,10.0.0.2:7450", "10.0.0.1", "10.0.0.1:7450"),
    (" 10.0.0.1:7450 , 10.0.0.2:7451 ", "list", "ipv4:10.0.0.1:7450,10.0.0.2:7451", "10.0.0.1",
     "10.0.0.1:7450"),
    ("[2001:db8::1]:7450,[2001:db8::2]:7450", "list", "ipv6:[2001:db8::1]:7450,[2001:db8::2]:7450",
     "2001:db8::1", "[2001:db8::1]:7450"),
    ("10.0.0.1:7450,[2001:db8::2]:7450", "list", "ipv6:[::ffff:10.0.0.1]:7450,[2001:db8::2]:7450",
     "10.0.0.1", "10.0.0.1:7450"),
    ("c-0.c.ghostgpu.svc:7450,c-1.c.ghostgpu.svc:7450", "list", None, "c-0.c.ghostgpu.svc",
     "c-0.c.ghostgpu.svc:7450"),
    ("collector.example:7450,10.0.0.5:7450", "list", None, "collector.example", "collector.example:7450"),
]


@pytest.mark.parametrize(("written", "kind", "target", "server_name", "authority"), GOOD)
def test_forms(written: str, kind: str, target: str | None, server_name: str, authority: str) -> None:
    spec = parse_collector(written)
    assert (spec.kind, spec.server_name, spec.authority) == (kind, server_name, authority)
    assert spec.needs_resolving == (target is None)
    if target is not None:
        assert spec.grpc_target() == target
    else:
        with pytest.raises(ValueError):
            spec.grpc_target()  # a list's names are never handed to gRPC as they are
    assert collector_address(written) == written.strip()


def test_a_list_with_names_dials_what_they_resolved_to() -> None:
    spec = parse_collector("a.example:7450,b.example:7451")
    assert spec.endpoints == (Endpoint("a.example", 7450), Endpoint("b.example", 7451))
    assert spec.grpc_target([("10.0.0.1", 7450), ("10.0.0.2", 7451)]) == "ipv4:10.0.0.1:7450,10.0.0.2:7451"


@pytest.mark.parametrize(("literals", "target"), [
    ([("127.0.0.1", 1)], "ipv4:127.0.0.1:1"),
    ([("::1", 1), ("::1", 2)], "ipv6:[::1]:1,[::1]:2"),
    ([("::1", 1), ("127.0.0.1", 2)], "ipv6:[::1]:1,[::ffff:127.0.0.1]:2"),  # one target, one family
    ([("fe80::1%eth0", 7450)], "ipv6:[fe80::1%eth0]:7450"),
])
def test_static_targets(literals: list[tuple[str, int]], target: str) -> None:
    assert static_target(literals) == target


# written -> the line after "--collector 'written': "
BAD: list[tuple[str, str]] = [
    ("no-port-here", f"'no-port-here' has no port; write HOST:PORT (e.g. 127.0.0.1:7450), or {FORMS}"),
    (":7450", f"':7450' has no host; write HOST:PORT (e.g. 127.0.0.1:7450), or {FORMS}"),
    ("h:65536", "'h:65536': the port must be a number from 1 to 65535; write HOST:PORT, e.g. "
     "collector.ghostgpu.svc:7450"),
    ("h:0", "'h:0': the port must be a number from 1 to 65535; write HOST:PORT, e.g. "
     "collector.ghostgpu.svc:7450"),
    ("h:+80", "'h:+80': the port must be a number from 1 to 65535; write HOST:PORT, e.g. "
     "collector.ghostgpu.svc:7450"),
    ("unix:relative.sock", "a unix socket is written unix:///absolute/path"),
    ("unix://host/x.sock", "a unix socket is written unix:///absolute/path"),
    ("::1:7450", "'::1:7450': an IPv6 address is written in brackets with its port, e.g. [::1]:7450"),
    ("[10.0.0.1]:7450", "'[10.0.0.1]:7450': brackets hold an IPv6 address, e.g. [::1]:7450"),
    ("10.0.0.300:7450", "'10.0.0.300:7450': 10.0.0.300 is not an IPv4 address"),
    ("bad_host!:7450", "'bad_host!:7450': 'bad_host!' is not a host name or IP address; write HOST:PORT, "
     "e.g. collector.ghostgpu.svc:7450"),
    ("http://collector:7450", f"the scheme http:// is not taken; write {FORMS}"),
    ("ipv4:10.0.0.1:7450", f"the scheme ipv4: is not taken; write {FORMS}"),
    ("dns://8.8.8.8/collector:7450", "a DNS server in the target (dns://SERVER/) is not supported; write "
     "dns:///NAME:PORT or NAME:PORT"),
    ("a:1,,b:2", "item 2 is empty; write HOST:PORT,HOST:PORT with no empty item"),
    ("a:1,", "item 2 is empty; write HOST:PORT,HOST:PORT with no empty item"),
    (",a:1", "item 1 is empty; write HOST:PORT,HOST:PORT with no empty item"),
    ("a:1,b:x", "'b:x': the port must be a number from 1 to 65535; write HOST:PORT, e.g. "
     "collector.ghostgpu.svc:7450"),
    ("a:1,b", f"'b' has no port; write HOST:PORT (e.g. 127.0.0.1:7450), or {FORMS}"),
    ("unix:///run/c.sock,a:1", "a unix socket (unix:///run/c.sock) cannot be one of a list (gRPC dials one "
     "socket path); give unix:///path alone, or list HOST:PORT items"),
    ("a:1,dns:///b:2", "'dns:///b:2' has a scheme (dns:); a list takes HOST:PORT items (IP literals or "
     "names), and ghostgpu writes gRPC's ipv4:/ipv6: target itself"),
    ("a:1,a:1", "a:1 is listed twice; list each collector once"),
    ("[::1]:1,[0:0::1]:1", "[::1]:1 is listed twice; list each collector once"),
    ("", f"empty; write {FORMS}"),
]


@pytest.mark.parametrize(("written", "line"), BAD)
def test_bad_addresses_are_one_line_naming_the_flag(written: str, line: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_collector(written)
    assert str(err.value) == f"--collector {written!r}: {line}"
    assert "\n" not in str(err.value)


def test_where_the_address_came_from() -> None:
    assert collector_address(None, env={}) == "127.0.0.1:7450"  # `ghostgpu up`'s default
    env = {"GHOSTGPU_COLLECTOR": "c-0.c:7450,c-1.c:7450"}
    assert collector_address("", env=env) == "c-0.c:7450,c-1.c:7450"
    assert collector_address("other:1", env=env) == "other:1"  # the flag wins
    with pytest.raises(ValueError) as err:
        collector_address(None, env={"GHOSTGPU_COLLECTOR": "c-0:7450,,c-1:7450"})
    assert str(err.value).startswith("GHOSTGPU_COLLECTOR 'c-0:7450,,c-1:7450': item 2 is empty")
    with pytest.raises(ValueError) as err:
        collector_address("c-0", env=env)
    assert str(err.value).startswith("--collector 'c-0': 'c-0' has no port")
