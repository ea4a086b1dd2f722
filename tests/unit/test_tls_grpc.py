"""Real TLS over loopback: a bare grpc.aio server with the collector's credentials
(ghostgpu/common/transport/tls_reload.py), real clients, real certificates from tests/helpers/certs.py.

mTLS works and names the peer; a client certificate from another CA, an expired one, none at all
and a plaintext client are refused by the handshake, and each client gets its one line
(ghostgpu/common/transport/tls_explain.py) from gRPC's real error details. Rotation: a stream opened before
the files are replaced keeps flowing, a connection made after sees the new certificate, and a
half-written file keeps the old one and is reported once.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from ghostgpu.cli.certs import Pair

from ghostgpu.common.transport.tls import TlsFiles, channel_credentials, principal_from_auth_context
from ghostgpu.common.transport.tls_explain import explain_connect_failure
from ghostgpu.common.transport.tls_reload import RELOAD, RELOAD_ERROR, CertReloader
from tests.helpers.certs import EXPIRED, Pki, serial_of, write_file

SERVICE = "ghostgpu.test.Echo"
TIMEOUT_S = 5.0
# Each channel its own connection: gRPC's global subchannel pool could hand a new channel the
# connection an older one made, and the rotation tests need a fresh handshake.
OPTIONS = [("grpc.use_local_subchannel_pool", 1)]


class Echo:
    """Who: the caller's identity as the collector would see it. Chat: echo a stream."""

    def __init__(self, trust_domain: str = "ghostgpu") -> None:
        self.trust_domain = trust_domain
        self.calls = 0

    async def who(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self.calls += 1
        principal = principal_from_auth_context(context.auth_context(), self.trust_domain, context.peer())
        if principal is None:
            return b"{}"
        return json.dumps({"subject": principal.subject, "groups": list(principal.groups),
                           "via": principal.via}).encode()

    async def chat(self, requests: AsyncIterator[bytes],
                   context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for message in requests:
            yield message

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Who": grpc.unary_unary_rpc_method_handler(self.who),
            "Chat": grpc.stream_stream_rpc_method_handler(self.chat),
        })


async def _serve(echo: Echo, credentials: grpc.ServerCredentials | None) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((echo.handler(),))
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    return server, port


def _channel(port: int, credentials: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
    target = f"127.0.0.1:{port}"
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=OPTIONS)
    return grpc.aio.secure_channel(target, credentials, options=OPTIONS)


async def _who(port: int, credentials: grpc.ChannelCredentials | None) -> dict[str, Any]:
    """The server's view of this client; AioRpcError when the connection is refused."""
    async with _channel(port, credentials) as channel:
        answer = await channel.unary_unary(f"/{SERVICE}/Who")(b"", timeout=TIMEOUT_S)
    return json.loads(answer)


def _raw(pair: Pair | None, ca_pem: bytes) -> grpc.ChannelCredentials:
    """Credentials straight from PEM, past check_client's refusal of an expired certificate: what a
    client that does not check (or a hostile one) shows the server."""
    if pair is None:
        return grpc.ssl_channel_credentials(ca_pem)
    return grpc.ssl_channel_credentials(ca_pem, pair.key_pem, pair.cert_pem)


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path / "pki")


class Reports(list[tuple[str, str]]):
    def __call__(self, action: str, line: str) -> None:
        self.append((action, line))


def test_mtls_names_the_node_and_the_user(pki: Pki) -> None:
    async def scenario() -> None:
        echo, reports = Echo(), Reports()
        server, port = await _serve(echo, CertReloader(pki.write("collector", pki.collector()), reports)
                                    .credentials())
        try:
            node = channel_credentials(pki.write("node-n1", pki.node("n1")), require_cert=True)
            assert await _who(port, node) == {"subject": "node:n1", "groups": [], "via": "mtls"}
            user = channel_credentials(pki.write("user-alice", pki.user("alice", ["ops", "ml"])))
            assert await _who(port, user) == {"subject": "user:alice", "groups": ["ops", "ml"], "via": "mtls"}
        finally:
            await server.stop(None)
        assert reports == []  # nothing changed: nothing reloaded

    run(scenario)


@pytest.mark.parametrize("client", ["other CA", "expired", "no certificate", "plaintext"])
def test_refused_clients_get_one_line(pki: Pki, client: str) -> None:
    other = Pki(pki.dir / "other")

    async def scenario() -> None:
        echo = Echo()
        server, port = await _serve(echo, CertReloader(pki.write("collector", pki.collector()), Reports())
                                    .credentials())
        files = {"other CA": other.write("node-n1", other.node("n1"), ca_path=pki.ca_path),
                 "expired": pki.write("node-old", pki.node("n1", **EXPIRED)),
                 "no certificate": pki.client(), "plaintext": TlsFiles()}[client]
        credentials = None
        if files.enabled:
            pair = Pair(Path(files.cert).read_bytes(), Path(files.key).read_bytes()) if files.cert else None
            credentials = _raw(pair, pki.ca.cert_pem)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _who(port, credentials)
            # The plaintext case probes the port: the server must still be up.
            line = await asyncio.to_thread(explain_connect_failure, f"127.0.0.1:{port}", files,
                                           refused.value.details() or "")
        finally:
            await server.stop(None)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert echo.calls == 0  # refused in the handshake, before any handler ran
        refused_cert = f"closed the TLS handshake: it refused the client certificate {files.cert}"
        want = {"plaintext": "speaks TLS and this client is plaintext: pass --tls-ca",
                "no certificate": "closed the TLS handshake: it requires a client certificate",
                "other CA": refused_cert, "expired": refused_cert}[client]
        assert line is not None and want in line and line.startswith(f"collector 127.0.0.1:{port} "), line

    run(scenario)


@pytest.mark.parametrize("server_side", ["plaintext", "other CA", "other host"])
def test_tls_client_against_the_wrong_server(pki: Pki, server_side: str) -> None:
    other = Pki(pki.dir / "other")

    async def scenario() -> None:
        credentials = None
        if server_side == "other CA":
            credentials = CertReloader(other.write("collector", other.collector()), Reports()).credentials()
        elif server_side == "other host":
            credentials = CertReloader(pki.write("collector", pki.collector(["collector.example"])),
                                       Reports()).credentials()
        server, port = await _serve(Echo(), credentials)
        files = pki.write("node-n1", pki.node("n1"))
        try:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _who(port, channel_credentials(files))
        finally:
            await server.stop(None)
        line = explain_connect_failure(f"127.0.0.1:{port}", files, refused.value.details() or "")
        want = {"plaintext": "speaks plaintext and this client TLS",
                "other CA": "its certificate is not trusted (unable to get local issuer certificate)",
                "other host": "its certificate does not name '127.0.0.1'"}[server_side]
        assert line is not None and want in line, line

    run(scenario)


def served_serial(port: int, client: TlsFiles) -> int:
    """The serial of the certificate the server shows a brand-new connection (Python's ssl, a
    handshake of its own; verification off: this only reads what is served)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    context.load_cert_chain(client.cert or "", client.key)
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock, \
            context.wrap_socket(sock) as tls:
        der = tls.getpeercert(binary_form=True)
    from cryptography import x509

    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


async def _say(stream: Any, text: bytes) -> None:
    await stream.write(text)
    assert await asyncio.wait_for(stream.read(), TIMEOUT_S) == text


def test_rotation_mid_stream(pki: Pki) -> None:
    """The collector's certificate moves to a new CA (the CA file becomes the bundle of both, as
    during a CA rotation): a stream opened before keeps flowing; a client trusting only the new CA
    is refused before and accepted after; a new connection is served the new certificate."""
    new_ca = Pki(pki.dir / "new")

    async def scenario() -> None:
        reports = Reports()
        files = pki.write("collector", pki.collector())
        old_serial = serial_of(Path(files.cert or "").read_bytes())
        server, port = await _serve(Echo(), CertReloader(files, reports).credentials())
        node = pki.write("node-n1", pki.node("n1"))
        only_new = pki.write("node-n2", pki.node("n2"), ca_path=new_ca.ca_path)
        try:
            async with _channel(port, channel_credentials(node, require_cert=True)) as channel:
                stream = channel.stream_stream(f"/{SERVICE}/Chat")()
                await _say(stream, b"before")
                with pytest.raises(grpc.aio.AioRpcError, match="CERTIFICATE_VERIFY_FAILED"):
                    await _who(port, channel_credentials(only_new))

                rotated = new_ca.collector()
                write_file(Path(files.key or ""), rotated.key_pem, 0o600)  # key first: a moment of mismatch
                write_file(Path(files.cert or ""), rotated.cert_pem)
                write_file(Path(files.ca or ""), pki.ca.cert_pem + new_ca.ca.cert_pem)

                await _say(stream, b"during")
                assert await asyncio.to_thread(served_serial, port, node) == serial_of(rotated.cert_pem)
                assert await _who(port, channel_credentials(only_new)) == {
                    "subject": "node:n2", "groups": [], "via": "mtls"}
                assert await _who(port, channel_credentials(node)) == {
                    "subject": "node:n1", "groups": [], "via": "mtls"}
                await _say(stream, b"after")
                await stream.done_writing()
        finally:
            await server.stop(None)
        assert old_serial != serial_of(rotated.cert_pem)
        assert [a for a, _ in reports] == [RELOAD], reports
        assert f"now serving serial {serial_of(rotated.cert_pem):#x}" in reports[0][1]

    run(scenario)


def test_half_written_certificate_keeps_the_old_one_and_reports_once(pki: Pki) -> None:
    async def scenario() -> None:
        reports = Reports()
        files = pki.write("collector", pki.collector())
        cert_path = Path(files.cert or "")
        old = cert_path.read_bytes()
        server, port = await _serve(Echo(), CertReloader(files, reports).credentials())
        node = pki.write("node-n1", pki.node("n1"))
        try:
            rotated = pki.collector()
            cert_path.write_bytes(rotated.cert_pem[: len(rotated.cert_pem) // 2])  # cert-manager mid-write
            for _ in range(3):  # three handshakes: one report
                assert await asyncio.to_thread(served_serial, port, node) == serial_of(old)
            assert await _who(port, channel_credentials(node)) == {"subject": "node:n1", "groups": [],
                                                                    "via": "mtls"}
            assert [a for a, _ in reports] == [RELOAD_ERROR]
            assert "not a PEM certificate" in reports[0][1] and f"still serving serial {serial_of(old):#x}" \
                in reports[0][1]

            cert_path.write_bytes(rotated.cert_pem)  # the cert is whole, its key not there yet
            assert await asyncio.to_thread(served_serial, port, node) == serial_of(old)
            assert [a for a, _ in reports] == [RELOAD_ERROR, RELOAD_ERROR]
            assert "this key does not match the certificate" in reports[1][1]

            write_file(Path(files.key or ""), rotated.key_pem, 0o600)
            for _ in range(2):
                assert await asyncio.to_thread(served_serial, port, node) == serial_of(rotated.cert_pem)
            assert [a for a, _ in reports] == [RELOAD_ERROR, RELOAD_ERROR, RELOAD]
        finally:
            await server.stop(None)

    run(scenario)


def test_reloader_reads_only_on_change(pki: Pki) -> None:
    """The per-handshake check without a handshake: unchanged files cost a stat and answer None;
    the same bytes rewritten announce nothing."""
    reports = Reports()
    files = pki.write("collector", pki.collector())
    reloader = CertReloader(files, reports)
    assert reloader.fetch() is None and reloader.fetch() is None
    write_file(Path(files.cert or ""), Path(files.cert or "").read_bytes())  # same bytes, new inode
    assert reloader.fetch() is None and reports == [] and reloader.reloads == 0
    rotated = pki.collector()
    write_file(Path(files.cert or ""), rotated.cert_pem)
    write_file(Path(files.key or ""), rotated.key_pem, 0o600)
    assert isinstance(reloader.fetch(), grpc.ServerCertificateConfiguration)
    assert reloader.fetch() is None and reloader.reloads == 1 and [a for a, _ in reports] == [RELOAD]
    Path(files.ca or "").unlink()
    assert reloader.fetch() is None and reloader.fetch() is None
    assert [a for a, _ in reports] == [RELOAD, RELOAD_ERROR] and "--tls-ca" in reports[1][1]
