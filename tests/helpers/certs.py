"""A tiny PKI for tests: a CA in a temporary directory and the certificates ghostgpu's mTLS uses,
made by the same builders as `ghostgpu certs` (cli/certs.py), plus the bad ones the tests
need: expired, not yet valid, from another CA, for another trust domain.

    pki = Pki(tmp_path)
    server = pki.write("collector", pki.collector())          # TlsFiles with cert, key and ca
    tracer = pki.write("node-n1", pki.node("n1"))
    old = pki.write("node-old", pki.node("n1", **EXPIRED))
    stranger = Pki(tmp_path / "other").write("node-n1", ...)  # another CA
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ghostgpu.cli.certs import Pair, collector_cert, make_ca, make_leaf, node_cert, user_cert, write_atomic

from ghostgpu.common.transport.tls import DEFAULT_TRUST_DOMAIN, TlsFiles

_NOW = dt.datetime.now(dt.UTC)
EXPIRED: dict[str, Any] = {"not_before": _NOW - dt.timedelta(days=2),
                           "not_after": _NOW - dt.timedelta(days=1)}
NOT_YET_VALID: dict[str, Any] = {"not_before": _NOW + dt.timedelta(days=1),
                                 "not_after": _NOW + dt.timedelta(days=2)}
LOOPBACK = ("127.0.0.1", "localhost", "::1")


class Pki:
    """A CA (DIR/ca.crt, DIR/ca.key) and helpers to issue and write certificates under DIR."""

    def __init__(self, directory: Path, trust_domain: str = DEFAULT_TRUST_DOMAIN, **ca_validity: Any) -> None:
        self.dir = directory
        self.trust_domain = trust_domain
        self.ca = make_ca(trust_domain, **ca_validity)
        directory.mkdir(parents=True, exist_ok=True)
        self.ca_path = write_file(directory / "ca.crt", self.ca.cert_pem)
        write_file(directory / "ca.key", self.ca.key_pem, 0o600)

    def node(self, name: str, **validity: Any) -> Pair:
        return node_cert(self.ca, name, self.trust_domain, **validity)

    def user(self, name: str, groups: Sequence[str] = (), **validity: Any) -> Pair:
        return user_cert(self.ca, name, groups, self.trust_domain, **validity)

    def collector(self, hosts: Sequence[str] = LOOPBACK, **validity: Any) -> Pair:
        return collector_cert(self.ca, hosts, self.trust_domain, **validity)

    def leaf(self, **kwargs: Any) -> Pair:
        """Anything make_leaf makes (a CN-only user, a foreign SPIFFE ID, several URIs)."""
        return make_leaf(self.ca, **kwargs)

    def write(self, stem: str, pair: Pair, ca_path: Path | None = None) -> TlsFiles:
        """DIR/STEM.crt and DIR/STEM.key, as TlsFiles with this CA (or `ca_path`)."""
        cert = write_file(self.dir / f"{stem}.crt", pair.cert_pem)
        key = write_file(self.dir / f"{stem}.key", pair.key_pem, 0o600)
        return TlsFiles(str(cert), str(key), str(ca_path or self.ca_path), self.trust_domain)

    def client(self) -> TlsFiles:
        """A client with only the CA: TLS, no certificate of its own."""
        return TlsFiles(None, None, str(self.ca_path), self.trust_domain)


# Written beside and renamed, as `ghostgpu certs` writes: the collector's reload check never sees half.
write_file = write_atomic


def serial_of(cert_pem: bytes) -> int:
    from cryptography import x509

    return x509.load_pem_x509_certificate(cert_pem).serial_number
