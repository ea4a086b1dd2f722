"""One line for a client whose connection to the collector failed over TLS (or for want of it).

gRPC reports every failed handshake as UNAVAILABLE, and the server's refusals all look the same on
the client side: "Socket closed" (grpcio 1.85, measured in tests/unit/test_tls_grpc.py). What the
client does know, its own files and a second look at the port, is enough to say which case it is:

| the client | gRPC's details say | the line says |
|---|---|---|
| plaintext | Socket closed, and a TLS probe of the port completes | the port speaks TLS: pass --tls-ca ... |
| TLS | WRONG_VERSION_NUMBER (a plaintext server answered) | the port is plaintext: drop --tls-* ... |
| TLS | CERTIFICATE_VERIFY_FAILED | the collector's certificate is not from --tls-ca |
| TLS | Hostname Verification Check failed | the certificate does not name the host dialled |
| TLS, no certificate | Socket closed | the collector requires a client certificate |
| TLS, a certificate | Socket closed | the collector refused this client's certificate |
"""

from __future__ import annotations

import re
import socket
import ssl

from ghostgpu.common.transport.addresses import is_unix
from ghostgpu.common.transport.collector_target import parse_collector
from ghostgpu.common.transport.tls import FLAGS, TlsFiles

_CLOSED = ("Socket closed", "Connection reset", "Broken pipe", "End of TCP stream", "EOF")
_VERIFY = re.compile(r"CERTIFICATE_VERIFY_FAILED:?\s*([^:]*)")
PROBE_TIMEOUT_S = 1.0


def probe_tls(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True when HOST:PORT answers a TLS ClientHello as a TLS server (verification off: this only
    asks what the port speaks). A server that wants a client certificate still counts: TLS 1.3
    finishes the client's side first, and an alert from the peer is TLS too."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError:
        return False
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])  # gRPC servers insist on ALPN h2
    with sock:
        try:
            with context.wrap_socket(sock, server_hostname=host if not _is_ip(host) else None):
                return True
        except ssl.SSLError as exc:
            return "ALERT" in (exc.reason or "").upper()
        except OSError:
            return False


def _is_ip(host: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
    except OSError:
        return False
    return True


def _split(address: str) -> tuple[str, int] | None:
    """(host, port) to probe and name: the address's, or a list's first (the name TLS checks)."""
    try:
        spec = parse_collector(address)
    except ValueError:
        spec = None
    if spec is not None and spec.endpoints:
        return spec.endpoints[0].host, spec.endpoints[0].port
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def explain_connect_failure(address: str, files: TlsFiles, details: str,
                            probe_timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """The one line for a gRPC UNAVAILABLE from `address`, or None when TLS is not the cause
    (the caller keeps its own message, e.g. connection refused)."""
    details = details or ""
    closed = any(marker in details for marker in _CLOSED)
    target = _split(address)
    if not files.enabled:
        if closed and target is not None and not is_unix(address) and probe_tls(*target, probe_timeout_s):
            return (f"collector {address} speaks TLS and this client is plaintext: pass {FLAGS['ca']} "
                    f"(the CA that signed the collector's certificate) and {FLAGS['cert']}/{FLAGS['key']} "
                    "(yours), or set GHOSTGPU_TLS_CA, GHOSTGPU_TLS_CERT and GHOSTGPU_TLS_KEY")
        return None
    if "WRONG_VERSION_NUMBER" in details or "packet length too long" in details.lower():
        return (f"collector {address} speaks plaintext and this client TLS: drop {FLAGS['ca']}, "
                f"{FLAGS['cert']} and {FLAGS['key']} (and GHOSTGPU_TLS_*) for it, or start the collector "
                "with its TLS files")
    verify = _VERIFY.search(details)
    if verify:
        why = verify.group(1).strip() or "verification failed"
        return (f"collector {address}: its certificate is not trusted ({why}); pass as "
                f"{files.label('ca')} the CA that signed the collector's certificate (now {files.ca})")
    if "Hostname Verification" in details or "Peer name" in details:
        if files.server_name:
            return (f"collector {address}: its certificate does not name {files.server_name!r} "
                    "(--tls-server-name); pass a name the certificate lists")
        host = target[0] if target else address
        return (f"collector {address}: its certificate does not name {host!r}; dial a name or address it "
                "lists, or issue it for this one (ghostgpu certs issue --collector HOST[,HOST...])")
    if closed and not files.cert:
        return (f"collector {address} closed the TLS handshake: it requires a client certificate; pass "
                f"{FLAGS['cert']} and {FLAGS['key']} (ghostgpu certs issue --user NAME makes them)")
    if closed:
        return (f"collector {address} closed the TLS handshake: it refused the client certificate "
                f"{files.cert} (signed by a CA it does not trust, expired, or revoked); use one signed by "
                "the collector's --tls-ca")
    return None

