"""Several collectors behind one --collector, on real loopback sockets with the installed grpcio:
channels spread over the replicas (pick_first with shuffleAddressList, gRFC A62), TLS checks the
name written and not an IP it resolved to, the plaintext uid check covers every address, and a
tracer whose replica dies mid-stream resumes on another and resends what was not acknowledged.

The forms and their one-line errors are tests/unit/test_collector_target.py's (no sockets there).
"""

from __future__ import annotations

import logging
import os
import socket
from collections import Counter
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from ghostgpu.tracer.stream import StreamOptions, StreamSink

from ghostgpu.common.model.records import NoticeRecord
from ghostgpu.common.transport import dial
from ghostgpu.common.transport.dial import CollectorRefused, CollectorUnresolved, open_channel
from ghostgpu.common.transport.tls import TlsFiles
from ghostgpu.common.transport.tls_explain import explain_connect_failure
from ghostgpu.common.transport.tls_reload import CertReloader
from tests.helpers.certs import Pki
from tests.helpers.fake_collector import FakeCollector
from tests.helpers.polling import wait_until

METHOD = "/ghostgpu.test.Which/Name"
CHANNELS = 60  # a replica left out of 60 shuffled channels: 3 * (2/3)**60 ~ 1e-10
NODE = "node-a"
FAST = StreamOptions(backoff_min_s=0.01, backoff_max_s=0.2, info_wait_s=0.0, heartbeat_s=30.0)
TIMEOUT_S = 10.0


class Replica:
    """A gRPC server on loopback answering its own name: which replica a channel reached."""

    def __init__(self, name: str, address: str = "127.0.0.1:0",
                 credentials: grpc.ServerCredentials | None = None) -> None:
        self.name = name
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        handler = grpc.unary_unary_rpc_method_handler(lambda request, context: name.encode())
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "ghostgpu.test.Which", {"Name": handler}),))
        self.port = (self.server.add_secure_port(address, credentials) if credentials is not None
                     else self.server.add_insecure_port(address))
        self.server.start()

    def stop(self) -> None:
        self.server.stop(None).wait(5)


def which(channel: grpc.Channel) -> str:
    answer: bytes = channel.unary_unary(METHOD)(b"", timeout=TIMEOUT_S)
    return answer.decode()


@pytest.fixture
def replicas() -> Iterator[list[Replica]]:
    made = [Replica(f"r{i}") for i in range(3)]
    yield made
    for replica in made:
        replica.stop()


def spread(target: str, tls: TlsFiles | None = None) -> Counter[str]:
    """Which replica each of CHANNELS channels, all open at once (as many tracers), reached."""
    channels = [open_channel(target, tls) for _ in range(CHANNELS)]
    try:
        return Counter(which(channel) for channel in channels)
    finally:
        for channel in channels:
            channel.close()


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


def both_families(make: type[FakeCollector] | None = None) -> tuple[int, list[str]]:
    """A port free on 127.0.0.1 and on ::1 alike (what `localhost:PORT` resolves to in gRPC)."""
    for _ in range(20):
        with socket.socket() as v4:
            v4.bind(("127.0.0.1", 0))
            port = v4.getsockname()[1]
            try:
                with socket.socket(socket.AF_INET6) as v6:
                    v6.bind(("::1", port))
            except OSError:
                continue
        return port, [f"127.0.0.1:{port}", f"[::1]:{port}"]
    raise AssertionError("no port free on both 127.0.0.1 and ::1 in 20 tries")


def needs_dns_of_both_families() -> None:
    if not ipv6_loopback():
        pytest.skip("no IPv6 loopback (::1) here: a name with two records needs localhost's ::1 and "
                    "127.0.0.1")
    if os.environ.get("GRPC_DNS_RESOLVER", "").lower() == "native":
        pytest.skip("GRPC_DNS_RESOLVER=native: getaddrinfo answers localhost with 127.0.0.1 alone here; "
                    "gRPC's own c-ares resolver answers ::1 and 127.0.0.1")


# --- spreading ----------------------------------------------------------------------------------


def test_many_channels_spread_over_a_list_of_addresses(replicas: list[Replica]) -> None:
    count = spread(",".join(f"127.0.0.1:{r.port}" for r in replicas))
    assert set(count) == {"r0", "r1", "r2"} and sum(count.values()) == CHANNELS, count


def test_many_channels_spread_over_a_list_of_names(replicas: list[Replica]) -> None:
    # names are resolved to literals at each connection: gRPC gets ipv4:127.0.0.1:P1,...
    count = spread(",".join(f"localhost:{r.port}" for r in replicas))
    assert set(count) == {"r0", "r1", "r2"}, count


def test_many_channels_spread_over_the_records_of_a_dns_name() -> None:
    needs_dns_of_both_families()
    port, addresses = both_families()
    made = [Replica(f"r{i}", address) for i, address in enumerate(addresses)]
    try:
        count = spread(f"localhost:{port}")  # dns:///localhost:PORT: ::1 and 127.0.0.1
    finally:
        for replica in made:
            replica.stop()
    assert set(count) == {"r0", "r1"}, count


def test_a_dead_address_is_passed_over(replicas: list[Replica]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # bound, never listening: connections are refused
        target = f"127.0.0.1:{dead},127.0.0.1:{replicas[0].port}"
        count = spread(target)
    assert count == Counter({"r0": CHANNELS})


# --- TLS: the name written -------------------------------------------------------------------------


def tls_replicas(pki: Pki, hosts: list[str]) -> list[Replica]:
    files = pki.write("collector", pki.collector(hosts))
    return [Replica(f"r{i}", credentials=CertReloader(files, lambda action, line: None).credentials())
            for i in range(2)]


def test_tls_checks_the_name_written_not_the_ip_it_resolved_to(tmp_path: Path) -> None:
    pki = Pki(tmp_path / "pki")
    made = tls_replicas(pki, ["localhost"])  # no IP SAN: an IP would fail the hostname check
    node = pki.write("node-n1", pki.node(NODE))
    try:
        count = spread(",".join(f"localhost:{r.port}" for r in made), node)
        assert set(count) == {"r0", "r1"}, count
        by_ip = ",".join(f"127.0.0.1:{r.port}" for r in made)  # the IP as written is the name checked
        with pytest.raises(grpc.RpcError) as refused:
            which(open_channel(by_ip, node))
    finally:
        for replica in made:
            replica.stop()
    line = explain_connect_failure(by_ip, node, refused.value.details() or "")
    assert line is not None and "its certificate does not name '127.0.0.1'" in line, line


def test_tls_over_a_list_checks_its_first_host(tmp_path: Path) -> None:
    pki = Pki(tmp_path / "pki")
    made = tls_replicas(pki, ["collector.example"])
    node = pki.write("node-n1", pki.node(NODE))
    target = ",".join(f"localhost:{r.port}" for r in made)
    try:
        with pytest.raises(grpc.RpcError) as refused:
            which(open_channel(target, node))
    finally:
        for replica in made:
            replica.stop()
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    line = explain_connect_failure(target, node, refused.value.details() or "")
    assert line is not None and "its certificate does not name 'localhost'" in line, line


# --- plaintext: who serves each address ---------------------------------------------------------


def test_the_uid_check_covers_every_address_of_a_list(replicas: list[Replica],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    squatted = replicas[2].port
    monkeypatch.setattr(dial, "_listener", lambda ip, port: 65534 if port == squatted else os.geteuid())
    for host in ("127.0.0.1", "localhost"):
        target = ",".join(f"{host}:{r.port}" for r in replicas)
        with pytest.raises(CollectorRefused) as refused:
            open_channel(target, None)
        line = str(refused.value)
        assert line.startswith(f"collector 127.0.0.1:{squatted} is served by uid 65534, not root"), line
        open_channel(target, None, collector_uid=65534).close()  # --collector-uid 65534 trusts it


def test_the_uid_check_of_localhost_asks_about_both_loopbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[str, int]] = []

    def listener(ip: str, port: int) -> int | None:
        asked.append((ip, port))
        return 65534 if ip == "::1" else None

    monkeypatch.setattr(dial, "_listener", listener)
    # gRPC's resolver gives ::1 as well as 127.0.0.1 for localhost, whatever /etc/hosts says
    with pytest.raises(CollectorRefused):
        open_channel("localhost:7450", None)
    assert {("127.0.0.1", 7450), ("::1", 7450)} <= set(asked)


# --- names that do not resolve -------------------------------------------------------------------


def fail_for(names: set[str], monkeypatch: pytest.MonkeyPatch) -> None:
    real = socket.getaddrinfo

    def getaddrinfo(host: str, *args: object, **kwargs: object) -> object:
        if host in names:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(dial.socket, "getaddrinfo", getaddrinfo)


def test_a_list_dials_the_names_that_resolve(replicas: list[Replica],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    fail_for({"gone.example"}, monkeypatch)
    channel = open_channel(f"gone.example:7450,localhost:{replicas[1].port}", None)
    try:
        assert which(channel) == "r1"
    finally:
        channel.close()


def test_a_list_of_names_none_resolves_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    fail_for({"a.example", "b.example"}, monkeypatch)
    with pytest.raises(CollectorUnresolved) as err:
        open_channel("a.example:7450,b.example:7450", None)
    assert str(err.value) == ("collector a.example:7450,b.example:7450: none of its names resolves "
                              "(a.example: Name or service not known; b.example: Name or service not "
                              "known); check the names in --collector, or list IP addresses")
    # the tracer says so once and keeps retrying, spooling meanwhile
    caplog.set_level(logging.WARNING, logger="ghostgpu.stream")
    sink = StreamSink("a.example:7450,b.example:7450", NODE, options=FAST)
    try:
        sink.emit(notice(1))
        wait_until(lambda: sink.stats()["connect_failures"] >= 3, "three failed connections")
        assert sink.stats()["spooled"] == 1
    finally:
        sink.close()
    lines = [r.getMessage() for r in caplog.records if "none of its names resolves" in r.getMessage()]
    assert len(lines) == 1, lines


# --- a replica dies mid-stream -------------------------------------------------------------------


def notice(i: int) -> NoticeRecord:
    return NoticeRecord(1_767_000_000.0 + i, NODE, "test", f"event {i}")


def collectors(form: str) -> tuple[list[FakeCollector], str]:
    """Two fake collectors and the --collector that names them both, in `form`."""
    if form == "dns":
        needs_dns_of_both_families()
        port, addresses = both_families()
        return [FakeCollector(address).start() for address in addresses], f"localhost:{port}"
    made = [FakeCollector().start() for _ in range(2)]
    host = "127.0.0.1" if form == "ip list" else "localhost"
    return made, ",".join(f"{host}:{c.address.rpartition(':')[2]}" for c in made)


@pytest.mark.parametrize("form", ["ip list", "name list", "dns"])
def test_a_replica_dying_mid_stream_moves_the_stream_and_loses_nothing(form: str) -> None:
    made, target = collectors(form)
    sink: StreamSink | None = None
    try:
        for c in made:
            c.ack_limit = 10  # the first replica acknowledges 1..10 of 1..20, then dies
        sink = StreamSink(target, NODE, options=FAST)
        for i in range(1, 21):
            sink.emit(notice(i))
        wait_until(lambda: any(20 in c.seqs() for c in made), "events 1..20 on one replica", TIMEOUT_S)
        first = next(c for c in made if c.connections)
        second = next(c for c in made if c is not first)
        assert not second.connections, "one stream, to one replica"
        wait_until(lambda: sink is not None and sink.stats()["acked_seq"] == 10, "1..10 acknowledged")
        second.welcome_acked_seq = 10  # the replicas share one store: it has 1..10
        second.ack_limit = None
        first.stop()
        for i in range(21, 41):
            sink.emit(notice(i))
        wait_until(lambda: set(range(11, 41)) <= set(second.seqs()), "11..40 on the other replica", TIMEOUT_S)
        wait_until(lambda: sink is not None and sink.stats()["acked_seq"] == 40, "40 acknowledged")
        assert set(first.seqs()) | set(second.seqs()) == set(range(1, 41))
        assert min(second.seqs()) == 11, "resent from the first unacknowledged seq"
        assert len(first.connections) == 1 and len(second.connections) == 1
        assert sink.stats()["reconnects"] == 1
    finally:
        if sink is not None:
            sink.close()
        for c in made:
            c.stop()
