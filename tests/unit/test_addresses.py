"""ghostgpu.common.transport.addresses: every flag's address is checked in one place, each with the
one line it has always printed, and every server's bound address is dialled the same way."""

from __future__ import annotations

import socket

import pytest
from ghostgpu.collector.server import ListenError, check_listen

from ghostgpu.common.transport import addresses
from ghostgpu.common.transport.collector_target import collector_address
from ghostgpu.common.web.httpserve import HttpListenError, HttpServer

GRPC_OK = ["127.0.0.1:7450", "[::1]:7450", "node-1.example:1", "unix:///run/ghostgpu.sock", "h:65535"]


@pytest.mark.parametrize("addr", GRPC_OK)
def test_grpc_addresses(addr: str) -> None:
    # What --listen takes a client dials as it is (the client's forms: tests/unit/test_collector_target.py).
    assert collector_address(addr) == addr
    assert check_listen(addr) == addr


@pytest.mark.parametrize(("addr", "listen"), [
    ("localhost", "use HOST:PORT (e.g. 0.0.0.0:7450; port 0 picks a free one) or unix:///path"),
    (":7450", "use HOST:PORT (e.g. 0.0.0.0:7450; port 0 picks a free one) or unix:///path"),
    ("h:65536", "use HOST:PORT (e.g. 0.0.0.0:7450; port 0 picks a free one) or unix:///path"),
    ("h:-1", "use HOST:PORT (e.g. 0.0.0.0:7450; port 0 picks a free one) or unix:///path"),
    ("h:0", None),  # a listener may ask for any port
    ("unix:relative.sock", "a unix socket is written unix:///absolute/path"),
    ("unix://host/x.sock", "a unix socket is written unix:///absolute/path"),
])
def test_bad_listen_addresses_are_one_line_naming_the_flag(addr: str, listen: str | None) -> None:
    with pytest.raises(ValueError) as err:
        collector_address(addr)  # no client dials these either
    assert str(err.value).startswith(f"--collector {addr!r}: ")
    if listen is None:
        assert check_listen(addr) == addr
        return
    with pytest.raises(ListenError) as listen_err:
        check_listen(addr)
    assert str(listen_err.value) == f"--listen {addr!r}: {listen}"


@pytest.mark.parametrize(("addr", "want"), [
    ("0.0.0.0:9400", ("0.0.0.0", 9400)), (":9400", ("0.0.0.0", 9400)), ("[::]:0", ("::", 0)),
    ("[::1]:9401", ("::1", 9401)), ("localhost:1", ("localhost", 1)),
])
def test_http_listen(addr: str, want: tuple[str, int]) -> None:
    assert addresses.parse_listen(addr, "--metrics-listen") == want


@pytest.mark.parametrize("addr", ["localhost", "9400", "h:99999", "h:", "h:+1", "unix:///run/m.sock"])
def test_bad_http_listen_names_the_flag_with_the_callers_error(addr: str) -> None:
    with pytest.raises(HttpListenError) as err:
        addresses.parse_listen(addr, "--health-listen", HttpListenError)
    assert str(err.value) == (f"--health-listen {addr!r}: use HOST:PORT "
                              "(e.g. 0.0.0.0:9400; port 0 picks a free one)")


def test_socket_paths() -> None:
    assert addresses.socket_path("unix:///run/containerd/c.sock") == "/run/containerd/c.sock"
    assert addresses.socket_path("/var/run/crio/crio.sock") == "/var/run/crio/crio.sock"
    with pytest.raises(ValueError) as err:
        addresses.socket_path("unix://run/k.sock", "--podresources-endpoint", "kubelet.sock")
    assert str(err.value) == "--podresources-endpoint 'unix://run/k.sock': use unix:///absolute/path/to/kubelet.sock"
    assert addresses.socket_target("/run/c.sock") == addresses.socket_target("unix:///run/c.sock") \
        == "unix:///run/c.sock"
    with pytest.raises(ValueError) as err:
        addresses.socket_target("c.sock")
    assert str(err.value) == "CRI endpoint 'c.sock': write it unix:///absolute/path/to/runtime.sock"


@pytest.mark.parametrize(("bound", "dialled"), [
    ("0.0.0.0:7450", "127.0.0.1:7450"), ("[::]:7450", "[::1]:7450"), (":::7450", "[::1]:7450"),
    ("127.0.0.1:1", "127.0.0.1:1"), ("[::1]:2", "[::1]:2"), ("node-1:3", "node-1:3"),
    ("unix:///run/g.sock", "unix:///run/g.sock"),
])
def test_dial_address(bound: str, dialled: str) -> None:
    assert addresses.dial_address(bound) == dialled


def test_bound_forms() -> None:
    assert addresses.with_port("0.0.0.0:0", 41234) == "0.0.0.0:41234"
    assert addresses.with_port("[::]:0", 5) == "[::]:5"
    assert addresses.port_of("[::1]:7450") == 7450 and addresses.port_of("unix:///x") is None
    assert addresses.unix_path(addresses.unix_address("/run/x.sock")) == "/run/x.sock"
    assert addresses.host_port("::", 1) == "[::]:1" and addresses.host_port("10.0.0.1", 2) == "10.0.0.1:2"


def test_http_server_is_dialled_on_loopback() -> None:
    server = HttpServer("0.0.0.0:0", {}, insecure=True).start()  # plaintext off loopback: --insecure
    try:
        assert server.address == f"127.0.0.1:{server.port}"
    finally:
        server.stop()


def test_port_free() -> None:
    assert addresses.port_free("unix:///run/anything.sock") is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert addresses.port_free(f"127.0.0.1:{port}") is not None  # "Address already in use"
    assert addresses.port_free(f"127.0.0.1:{port}") is None
