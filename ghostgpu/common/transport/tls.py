"""TLS for every gRPC link: the files, their checks, credentials and the identity in a certificate.

docs/SECURITY.md is the contract. In short:
- `--tls-cert`, `--tls-key`, `--tls-ca` and `--tls-trust-domain` on every command, each with its
  `GHOSTGPU_TLS_*` variable (`TlsFiles.resolve`);
- the collector requires a client certificate signed by --tls-ca; its certificate files are re-read
  when they change (ghostgpu/common/transport/tls_reload.py), so cert-manager can rotate them;
- a tracer's certificate carries the URI SAN spiffe://TD/node/NAME, a user's spiffe://TD/user/NAME
  (or just a CN), its groups are the subject's O values (`principal_from_auth_context`);
- plaintext only on a unix socket or loopback (`plaintext_allowed`).

Every bad input is a one-line TlsError naming the flag (or variable) and the file, found when the
command starts, never at the first handshake; ghostgpu/common/transport/tls_explain.py turns a client's failed
connection into one line. cryptography is imported inside the functions that parse certificates:
the CLI's start must stay cheap for commands that never touch TLS.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Protocol

from ghostgpu.common.transport.addresses import is_unix
from ghostgpu.common.transport.principal import Principal

if TYPE_CHECKING:
    import grpc
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

log = logging.getLogger(__name__)

DEFAULT_TRUST_DOMAIN = "ghostgpu"
TRUST_DOMAIN_ENV = "GHOSTGPU_TLS_TRUST_DOMAIN"
FLAGS = {"cert": "--tls-cert", "key": "--tls-key", "ca": "--tls-ca", "trust_domain": "--tls-trust-domain"}
ENV = {"cert": "GHOSTGPU_TLS_CERT", "key": "GHOSTGPU_TLS_KEY", "ca": "GHOSTGPU_TLS_CA",
       "trust_domain": TRUST_DOMAIN_ENV}
# SPIFFE's trust domain grammar (lowercase letters, digits, '.', '-', '_').
_TRUST_DOMAIN = re.compile(r"^[a-z0-9._-]{1,255}$")
# Node names are Kubernetes node names (DNS subdomains, any case for hosts outside Kubernetes);
# user names may also hold '@' and '_' (e-mail-like logins); groups also ':' and '/'.
_NAMES = {"node": re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$"),
          "user": re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._@-]{0,251}[A-Za-z0-9])?$"),
          "group": re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._@:/-]{0,251}[A-Za-z0-9])?$")}
# A DNS name as a certificate's SAN carries it: RFC 1123 labels, dot-separated, at most 253 characters;
# a leading '*.' only where a certificate is issued (a wildcard is a certificate's, not a dial's).
_DNS_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DNS_NAME = re.compile(rf"(?=.{{1,253}}$)(\*\.)?{_DNS_LABEL}(?:\.{_DNS_LABEL})*")
_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----\r?\n.+?-----END CERTIFICATE-----", re.S)
_MAKE_ONE = "ghostgpu certs issue makes one (docs/SECURITY.md)"


class TlsError(ValueError):
    """A TLS file or setting that cannot work: one line naming the flag, the file and what to do."""


def check_trust_domain(value: str, what: str = "--tls-trust-domain") -> str:
    if not _TRUST_DOMAIN.match(value):
        raise TlsError(f"{what} {value!r}: a trust domain is lowercase letters, digits, '.', '-' and '_' "
                       f"(e.g. {DEFAULT_TRUST_DOMAIN} or prod.example.com)")
    return value


def is_dns_name(value: str, *, wildcard: bool = False) -> bool:
    """A name a certificate's SAN dNSName can hold; `wildcard`: a leading '*.' too (issuing one)."""
    m = _DNS_NAME.fullmatch(value)
    return m is not None and (wildcard or m.group(1) is None)


def check_server_name(value: str, what: str = "--tls-server-name") -> str:
    """A DNS name a certificate can carry (its SAN dNSName), else one line."""
    if not is_dns_name(value):
        raise TlsError(f"{what} {value!r}: not a DNS name; give the name the collector's certificate "
                       "carries, e.g. ghostgpu-collector.ghostgpu.svc")
    return value


def check_name(kind: str, name: str, what: str) -> str:
    """A node, user or group name that fits in a SPIFFE path and a policy subject, else one line."""
    if not _NAMES[kind].match(name):
        allowed = {"node": "letters, digits, '.' and '-'", "user": "letters, digits, '.', '-', '_' and '@'",
                   "group": "letters, digits, '.', '-', '_', '@', ':' and '/'"}[kind]
        raise ValueError(f"{what} {name!r}: a {kind} name is {allowed}, starting and ending with a letter "
                         "or digit, at most 253 characters")
    return name


def spiffe_id(trust_domain: str, kind: str, name: str = "") -> str:
    """spiffe://TD/node/NAME, spiffe://TD/user/NAME or spiffe://TD/collector."""
    return f"spiffe://{trust_domain}/{kind}" + (f"/{name}" if name else "")


@dataclass(frozen=True)
class TlsFiles:
    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    trust_domain: str = DEFAULT_TRUST_DOMAIN
    # Which GHOSTGPU_TLS_* variable supplied a value (key -> variable), so errors name it rather
    # than a flag that was never given.
    origin: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False, repr=False)
    # A client's --tls-server-name: the name the collector's certificate must carry when it is not
    # the host dialled (a `kubectl port-forward` dials 127.0.0.1). None: the host dialled.
    server_name: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.key or self.ca)

    @classmethod
    def resolve(cls, cert: str | None = None, key: str | None = None, ca: str | None = None,
                trust_domain: str | None = None, env: Mapping[str, str] = os.environ,
                server_name: str | None = None) -> TlsFiles:
        """The flags' (or config keys') values, each missing one filled from its GHOSTGPU_TLS_* variable.
        `server_name` (--tls-server-name, a client's) has no variable: the tracer and the collector
        resolve their files here too, and a name meant for one command must not reach them."""
        given = {"cert": cert, "key": key, "ca": ca, "trust_domain": trust_domain}
        values: dict[str, str | None] = {}
        origin: dict[str, str] = {}
        for name, value in given.items():
            if not value and env.get(ENV[name]):
                value = env[ENV[name]]
                origin[name] = ENV[name]
            values[name] = value or None
        td = values.pop("trust_domain") or DEFAULT_TRUST_DOMAIN
        check_trust_domain(td, origin.get("trust_domain", FLAGS["trust_domain"]))
        if server_name is not None:
            check_server_name(server_name)
        return cls(trust_domain=td, origin=origin, server_name=server_name or None, **values)

    def label(self, name: str) -> str:
        """How the user gave `name` (cert, key, ca): its flag, or the variable it came from."""
        return self.origin.get(name, FLAGS[name])


@dataclass(frozen=True)
class Loaded:
    """The files' bytes as read at one moment, checked: what credentials are built from."""

    cert_pem: bytes | None
    key_pem: bytes | None
    ca_pem: bytes | None
    leaf: x509.Certificate | None = None  # cert_pem's first certificate

    def describe(self) -> str:
        """'serial 0x1f.., CN=collector, notAfter 2026-05-01 12:00:00Z' of the served certificate."""
        return describe_cert(self.leaf) if self.leaf is not None else "no certificate"


def describe_cert(cert: x509.Certificate) -> str:
    cn = _attribute(cert.subject, "COMMON_NAME")
    return (f"serial {cert.serial_number:#x}, CN={cn[0] if cn else ''}, "
            f"notAfter {not_after(cert):%Y-%m-%d %H:%M:%S}Z")


def not_before(cert: x509.Certificate) -> dt.datetime:
    """Aware UTC: cryptography 42+ has not_valid_before_utc; 38 (Debian 12) only the naive one."""
    value: dt.datetime | None = getattr(cert, "not_valid_before_utc", None)
    return value if value is not None else cert.not_valid_before.replace(tzinfo=dt.UTC)


def not_after(cert: x509.Certificate) -> dt.datetime:
    value: dt.datetime | None = getattr(cert, "not_valid_after_utc", None)
    return value if value is not None else cert.not_valid_after.replace(tzinfo=dt.UTC)


def _attribute(name: x509.Name, oid_name: str) -> list[str]:
    from cryptography.x509.oid import NameOID

    return [str(a.value) for a in name.get_attributes_for_oid(getattr(NameOID, oid_name))]


def _read(files: TlsFiles, which: str, path: str) -> bytes:
    label = files.label(which)
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise TlsError(f"{label} {path}: no such file; pass the path of a PEM file ({_MAKE_ONE})") from None
    except IsADirectoryError:
        raise TlsError(f"{label} {path}: is a directory; pass the PEM file inside it") from None
    except OSError as exc:
        raise TlsError(f"{label} {path}: cannot read it ({exc.strerror}); make it readable by this "
                       "user") from None


def parse_certs(data: bytes, label: str, path: str) -> list[x509.Certificate]:
    """Every certificate in a PEM file, in order (a chain, or a CA bundle)."""
    from cryptography import x509

    blocks = _PEM_CERT.findall(data)
    if not blocks:
        raise TlsError(f"{label} {path}: not a PEM certificate (no '-----BEGIN CERTIFICATE-----'); pass the "
                       ".crt file, not the key or a DER file")
    try:
        return [x509.load_pem_x509_certificate(b) for b in blocks]
    except ValueError as exc:
        raise TlsError(f"{label} {path}: a certificate in it does not parse ({_one_line(exc)}); the file "
                       "may be half-written or damaged") from None


class PublicKey(Protocol):
    """What every cryptography public key type has (cryptography 38 and 42+ name their unions apart)."""

    def public_bytes(self, encoding: Encoding, format: PublicFormat, /) -> bytes: ...


class PrivateKey(Protocol):
    """What every cryptography private key type has."""

    def public_key(self) -> PublicKey: ...


def parse_key(data: bytes, label: str, path: str) -> PrivateKey:
    from cryptography.hazmat.primitives import serialization

    if b"-----BEGIN" not in data or b"PRIVATE KEY-----" not in data:
        raise TlsError(f"{label} {path}: not a PEM private key (no '-----BEGIN ... PRIVATE KEY-----'); pass "
                       "the .key file")
    try:
        return serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise TlsError(f"{label} {path}: the key is encrypted; give an unencrypted key (e.g. openssl pkey "
                       f"-in {path} -out plain.key)") from None
    except (ValueError, Exception) as exc:  # cryptography raises several types for a damaged key
        raise TlsError(f"{label} {path}: the private key does not parse ({_one_line(exc)}); the file may "
                       "be half-written or damaged") from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:160] or type(exc).__name__


def _public_der(key: PublicKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    """`ca` signed `cert`: the issuer name and the signature (done by hand: cryptography 38 has no
    verify_directly_issued_by). A signature scheme this does not know is left to the handshake."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, padding, rsa

    if cert.issuer != ca.subject:
        return False
    public = ca.public_key()
    digest = cert.signature_hash_algorithm  # None for an Ed25519/Ed448 signature: not an EC or RSA CA's
    try:
        if isinstance(public, ec.EllipticCurvePublicKey):
            if digest is None:
                return False
            public.verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(digest))
        elif isinstance(public, rsa.RSAPublicKey):
            if cert.signature_algorithm_oid.dotted_string == "1.2.840.113549.1.1.10":  # RSASSA-PSS
                return True
            if digest is None:
                return False
            public.verify(cert.signature, cert.tbs_certificate_bytes, padding.PKCS1v15(), digest)
        elif isinstance(public, ed25519.Ed25519PublicKey | ed448.Ed448PublicKey):
            public.verify(cert.signature, cert.tbs_certificate_bytes)
    except InvalidSignature:
        return False
    return True


def _check_dates(cert: x509.Certificate, label: str, path: str, now: dt.datetime) -> None:
    start, end = not_before(cert), not_after(cert)
    if now > end:
        raise TlsError(f"{label} {path}: certificate expired {end:%Y-%m-%d %H:%M:%S}Z "
                       f"({_ago(now - end)} ago); replace it with a new one ({_MAKE_ONE})")
    if now < start:
        raise TlsError(f"{label} {path}: certificate not valid until {start:%Y-%m-%d %H:%M:%S}Z "
                       f"(in {_ago(start - now)}); check this host's clock")


def _ago(delta: dt.timedelta) -> str:
    seconds = int(delta.total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def load(files: TlsFiles, *, need_pair: bool, need_ca: bool, check_issuer: bool,
         now: dt.datetime | None = None) -> Loaded:
    """Read and check the files as they are now: PEM, key matches certificate, dates, and (when
    `check_issuer`) the certificate signed by one of the CAs."""
    now = now or dt.datetime.now(dt.UTC)
    if bool(files.cert) != bool(files.key):
        have, lack = ("cert", "key") if files.cert else ("key", "cert")
        raise TlsError(f"{files.label(have)} given without {FLAGS[lack]}: pass both the certificate and its "
                       "key")
    if need_pair and not files.cert:
        raise TlsError(f"{FLAGS['cert']} and {FLAGS['key']} missing: this side must show a certificate; "
                       f"pass both ({_MAKE_ONE})")
    if need_ca and not files.ca:
        raise TlsError(f"{FLAGS['ca']} missing: pass the CA certificate that signed the peers' certificates "
                       "(ghostgpu certs init makes one)")
    cert_pem = _read(files, "cert", files.cert) if files.cert else None
    key_pem = _read(files, "key", files.key) if files.key else None
    ca_pem = _read(files, "ca", files.ca) if files.ca else None
    cas = parse_certs(ca_pem, files.label("ca"), files.ca) if ca_pem is not None and files.ca else []
    for ca in cas:
        _check_dates(ca, files.label("ca"), files.ca or "", now)
    leaf = None
    if cert_pem is not None and key_pem is not None and files.cert and files.key:
        chain = parse_certs(cert_pem, files.label("cert"), files.cert)
        leaf = chain[0]
        key = parse_key(key_pem, files.label("key"), files.key)
        if _public_der(key.public_key()) != _public_der(leaf.public_key()):
            raise TlsError(f"{files.label('key')} {files.key}: this key does not match the certificate "
                           f"{files.cert}; pass the key issued with it")
        _check_dates(leaf, files.label("cert"), files.cert, now)
        if check_issuer and cas and not any(issued_by(c, ca) for c in chain for ca in cas):
            raise TlsError(f"{files.label('cert')} {files.cert}: not signed by the CA in {files.ca} (issuer "
                           f"{leaf.issuer.rfc4514_string()}); pass the CA that issued it, or a certificate "
                           "from this CA")
    return Loaded(cert_pem, key_pem, ca_pem, leaf)


def check_server(files: TlsFiles) -> Loaded:
    """The collector's files at start: certificate and key, and the CA its clients' certificates
    must be signed by (client certificates are required). The collector's own certificate must come
    from that CA too (or one in the bundle): one CA per deployment, as `ghostgpu certs` and a
    cert-manager CA Issuer make them, so a certificate from another `certs init` is caught here
    rather than as every client's failed handshake."""
    return load(files, need_pair=True, need_ca=True, check_issuer=True)


def check_client(files: TlsFiles, *, require_cert: bool = False) -> Loaded:
    """A client's files at start: the CA that signed the collector's certificate; a certificate and
    key when `require_cert` (the tracer) or when one of them is given (a user). The client's own
    certificate is not checked against --tls-ca: that CA verifies the collector, and during a CA
    rotation a client may hold a certificate of the old CA while trusting only the new one."""
    return load(files, need_pair=require_cert, need_ca=True, check_issuer=False)


def channel_credentials(files: TlsFiles, *, require_cert: bool = False) -> grpc.ChannelCredentials:
    """Credentials for one new channel, from the files as they are now (rotated files are picked up
    by the next channel; a reconnecting tracer builds one per connection)."""
    import grpc

    loaded = check_client(files, require_cert=require_cert)
    return grpc.ssl_channel_credentials(root_certificates=loaded.ca_pem, private_key=loaded.key_pem,
                                        certificate_chain=loaded.cert_pem)


def plaintext_allowed(listen_addr: str) -> bool:
    """Only where nobody else can connect: a unix socket (file permissions guard it) or loopback."""
    if is_unix(listen_addr):
        return True
    host = listen_addr.rpartition(":")[0].strip("[]") if ":" in listen_addr else listen_addr
    if host.lower() == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False  # a name could resolve anywhere; a wildcard or empty host is every interface
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def trust_domain_of_ca(ca_pem: bytes) -> str | None:
    """The trust domain a ghostgpu CA names in its URI SAN spiffe://TD, else None."""
    certs = parse_certs(ca_pem, "ca.crt", "")
    for uri in _uris(certs[0]):
        if uri.startswith("spiffe://") and "/" not in uri[len("spiffe://"):]:
            return uri[len("spiffe://"):]
    return None


def _uris(cert: x509.Certificate) -> list[str]:
    from cryptography import x509

    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [str(u) for u in san.get_values_for_type(x509.UniformResourceIdentifier)]


def first_auth_value(auth: Mapping[str, Iterable[bytes]], key: str) -> bytes | None:
    """The first value of a gRPC auth context's property (`x509_pem_cert`: the leaf), or None."""
    return next((bytes(v) for v in auth.get(key) or ()), None)


def principal_from_auth_context(auth: Mapping[str, Iterable[bytes]], trust_domain: str,
                                peer: str) -> Principal | None:
    """Who a verified client certificate names, or None: no certificate (plaintext, or TLS without
    one), a foreign trust domain, or a SPIFFE ID that names no node or user (logged, once per cert)."""
    if [bytes(v) for v in auth.get("transport_security_type", ())] != [b"ssl"]:
        return None
    pem = first_auth_value(auth, "x509_pem_cert")
    if pem is None:
        return None
    found = _identity(pem, trust_domain)
    if found is None:
        return None
    kind, name, groups = found
    return Principal(kind, name, groups, via="mtls", peer=peer)


@lru_cache(maxsize=1024)  # one parse per certificate, not per call; a denial is logged once per cert
def _identity(pem: bytes, trust_domain: str) -> tuple[str, str, tuple[str, ...]] | None:
    try:
        cert = parse_certs(pem, "client certificate", "")[0]
    except TlsError as exc:
        log.warning("a verified client certificate does not parse (%s): no identity", exc)
        return None
    groups = tuple(_attribute(cert.subject, "ORGANIZATION_NAME"))
    cn = _attribute(cert.subject, "COMMON_NAME")
    serial = f"serial {cert.serial_number:#x}"
    ids = [u for u in _uris(cert) if u.startswith("spiffe://")]
    if not ids:
        if cn and _NAMES["user"].match(cn[0]):
            return "user", cn[0], groups
        log.warning("client certificate %s (CN %r) has no SPIFFE ID and no usable CN: no identity",
                    serial, cn)
        return None
    if len(ids) > 1:
        log.warning("client certificate %s has %d SPIFFE IDs (%s): a certificate names one identity; "
                    "no identity", serial, len(ids), ", ".join(ids))
        return None
    td, _, path = ids[0][len("spiffe://"):].partition("/")
    if td != trust_domain:
        log.warning("client certificate %s names %s, of trust domain %r, not %r (--tls-trust-domain): "
                    "no identity", serial, ids[0], td, trust_domain)
        return None
    kind, _, name = path.partition("/")
    if kind in ("node", "user") and _NAMES[kind].match(name):
        return kind, name, groups
    log.warning("client certificate %s names %s: neither spiffe://%s/node/NAME nor spiffe://%s/user/NAME; "
                "no identity", serial, ids[0], td, td)
    return None
