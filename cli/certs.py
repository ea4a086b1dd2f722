"""`ghostgpu certs`: a small certificate authority for clusters without cert-manager.

    ghostgpu certs init  --dir D [--days N] [--trust-domain TD] [--force]
    ghostgpu certs issue --dir D (--collector HOST[,HOST...] | --node NAME | --user NAME [--group G]...)
                         [--days N] [--trust-domain TD] [--force]

`init` writes D/ca.crt and D/ca.key; `issue` writes D/collector.crt/.key, D/node-NAME.crt/.key or
D/user-NAME.crt/.key, signed by D/ca.key. The identities inside follow docs/SECURITY.md (the URI
SAN spiffe://TD/node/NAME, spiffe://TD/user/NAME, spiffe://TD/collector). EC P-256 keys and
SHA-256, as cert-manager's ECDSA default, because they are small and fast to handshake; random
serials (RFC 5280 asks for unpredictable ones); not_before 5 minutes back so that a node whose
clock is a little behind accepts a certificate issued a moment ago.

The builders (make_ca, make_leaf and the three identities) take explicit validity so that the
tests can make expired and not-yet-valid certificates with the same code (tests/helpers/certs.py).
cryptography is imported only when a certificate is made: building the parser must stay cheap.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypedDict, Unpack

from ghostgpu.common.transport.tls import (
    DEFAULT_TRUST_DOMAIN,
    TRUST_DOMAIN_ENV,
    check_name,
    check_trust_domain,
    is_dns_name,
    spiffe_id,
    trust_domain_of_ca,
)

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric import ec

CA_DAYS = 3650
LEAF_DAYS = 365
BACKDATE = dt.timedelta(minutes=5)


class Pair(NamedTuple):
    """A certificate and its private key, both PEM."""

    cert_pem: bytes
    key_pem: bytes


class Validity(TypedDict, total=False):
    """make_leaf's validity arguments, as node_cert, user_cert and collector_cert pass them on."""

    days: float
    not_before: dt.datetime | None
    not_after: dt.datetime | None


def _validity(days: float, not_before: dt.datetime | None,
              not_after: dt.datetime | None) -> tuple[dt.datetime, dt.datetime]:
    # cryptography 38 takes naive datetimes as UTC; aware ones are converted. Naive UTC throughout.
    now = dt.datetime.now(dt.UTC).replace(tzinfo=None)
    start = _naive_utc(not_before) if not_before else now - BACKDATE
    end = _naive_utc(not_after) if not_after else now + dt.timedelta(days=days)
    if end <= start:
        raise ValueError(f"certificate validity {start:%Y-%m-%d %H:%M}Z .. {end:%Y-%m-%d %H:%M}Z is empty; "
                         "pass a positive --days")
    return start, end


def _naive_utc(when: dt.datetime) -> dt.datetime:
    return when.astimezone(dt.UTC).replace(tzinfo=None) if when.tzinfo else when


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _new_key() -> ec.EllipticCurvePrivateKey:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def make_ca(trust_domain: str = DEFAULT_TRUST_DOMAIN, *, days: float = CA_DAYS,
            not_before: dt.datetime | None = None, not_after: dt.datetime | None = None,
            common_name: str = "ghostgpu CA") -> Pair:
    """A self-signed CA. Its URI SAN spiffe://TD names the trust domain (as a SPIFFE signing
    certificate may), so that `certs issue` finds the trust domain `init` was given."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    check_trust_domain(trust_domain, "--trust-domain")
    start, end = _validity(days, not_before, not_after)
    key = _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, f"ghostgpu {trust_domain}")])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                                         key_cert_sign=True, crl_sign=True, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(ski, critical=False)
            .add_extension(x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier(f"spiffe://{trust_domain}")]), critical=False)
            .sign(key, hashes.SHA256()))
    return Pair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def make_leaf(ca: Pair, *, common_name: str, uris: Sequence[str] = (), dns_names: Sequence[str] = (),
              ips: Sequence[str] = (), orgs: Sequence[str] = (), server: bool = False,
              days: float = LEAF_DAYS, not_before: dt.datetime | None = None,
              not_after: dt.datetime | None = None) -> Pair:
    """A certificate signed by `ca`: client auth always, server auth too when `server`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed448, ed25519, rsa, x448, x25519
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    ca_public = ca_cert.public_key()
    signing = (ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey, dsa.DSAPrivateKey, ed25519.Ed25519PrivateKey,
               ed448.Ed448PrivateKey)
    if not isinstance(ca_key, signing) or isinstance(ca_public, x25519.X25519PublicKey | x448.X448PublicKey):
        # what CertificateBuilder.sign says of a key-agreement key
        raise TypeError("Key must be an rsa, dsa, ec, ed25519, or ed448 private key.")
    start, end = _validity(days, not_before, not_after)
    key = _new_key()
    subject = x509.Name([*(x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs),
                         x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(u) for u in uris]
    sans += [x509.DNSName(d) for d in dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH, *([ExtendedKeyUsageOID.SERVER_AUTH] if server else [])]
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                            key_encipherment=False, data_encipherment=False,
                                            key_agreement=False, key_cert_sign=False, crl_sign=False,
                                            encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_public),
                              critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return Pair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def node_cert(ca: Pair, name: str, trust_domain: str = DEFAULT_TRUST_DOMAIN,
              **validity: Unpack[Validity]) -> Pair:
    """A tracer's certificate: URI SAN spiffe://TD/node/NAME, CN=NAME."""
    check_name("node", name, "--node")
    return make_leaf(ca, common_name=name, uris=[spiffe_id(trust_domain, "node", name)], **validity)


def user_cert(ca: Pair, name: str, groups: Sequence[str] = (), trust_domain: str = DEFAULT_TRUST_DOMAIN,
              **validity: Unpack[Validity]) -> Pair:
    """A user's certificate: URI SAN spiffe://TD/user/NAME, CN=NAME, one O per group."""
    check_name("user", name, "--user")
    for group in groups:
        check_name("group", group, "--group")
    return make_leaf(ca, common_name=name, uris=[spiffe_id(trust_domain, "user", name)], orgs=groups,
                     **validity)


def collector_cert(ca: Pair, hosts: Sequence[str], trust_domain: str = DEFAULT_TRUST_DOMAIN,
                   **validity: Unpack[Validity]) -> Pair:
    """The collector's certificate: a DNS or IP SAN per host, CN=the first, URI SAN spiffe://TD/collector."""
    if not hosts:
        raise ValueError("--collector: give at least one host name or IP address clients dial")
    dns_names, ips = [], []
    for host in hosts:
        try:
            ips.append(str(ipaddress.ip_address(host.strip("[]"))))
        except ValueError:
            if not is_dns_name(host, wildcard=True):
                raise ValueError(f"--collector {host!r}: not a DNS name or IP address; give the names "
                                 "clients dial, e.g. --collector collector.ghostgpu.svc,10.0.0.5") from None
            dns_names.append(host)
    return make_leaf(ca, common_name=hosts[0].strip("[]"), uris=[spiffe_id(trust_domain, "collector")],
                     dns_names=dns_names, ips=ips, server=True, **validity)


def write_pair(directory: Path, stem: str, pair: Pair, force: bool) -> list[Path]:
    """Write DIR/STEM.crt (0644) and DIR/STEM.key (0600); refuse to overwrite either unless `force`.
    Each file is written beside itself and renamed, so a reader never sees half of one."""
    paths = [directory / f"{stem}.crt", directory / f"{stem}.key"]
    if not force:
        for path in paths:
            if path.exists():
                raise ValueError(f"{path}: exists; pass --force to replace it (clients holding the old "
                                 "one keep working until it expires)")
    directory.mkdir(parents=True, exist_ok=True)
    for path, data, mode in zip(paths, pair, (0o644, 0o600), strict=True):
        write_atomic(path, data, mode)
    return paths


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> Path:
    """Write beside `path` and rename over it, so that a reader (a collector checking its files for
    a rotation) never sees half of it; `mode` exactly, whatever the umask."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)  # the umask must not widen or narrow it
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def _read_ca(directory: Path) -> Pair:
    files = []
    for name in ("ca.crt", "ca.key"):
        try:
            files.append((directory / name).read_bytes())
        except FileNotFoundError:
            raise ValueError(f"--dir {directory}: no {name}; run `ghostgpu certs init --dir {directory}` "
                             "first") from None
        except OSError as exc:
            raise ValueError(f"--dir {directory}: cannot read {name} ({exc.strerror}); run as its "
                             "owner") from None
    return Pair(*files)


def _days(text: str) -> float:
    try:
        days = float(text)
    except ValueError:
        days = -1.0
    if days <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of days above 0")
    return days


def add_parser(sub: Any) -> None:
    """`ghostgpu certs init|issue` on the top-level subparsers."""
    certs = sub.add_parser("certs", help="a small CA: certificates for the collector, tracers and users "
                           "(docs/SECURITY.md)", description="Make a CA and the certificates ghostgpu's mTLS "
                           "needs, for clusters without cert-manager.")
    verbs = certs.add_subparsers(dest="certs_command", required=True, metavar="{init,issue}")
    init = verbs.add_parser("init", help="write DIR/ca.crt and DIR/ca.key")
    issue = verbs.add_parser("issue", help="write a certificate signed by DIR/ca.key")
    for p, days in ((init, CA_DAYS), (issue, LEAF_DAYS)):
        p.add_argument("--dir", required=True, type=Path, help="where the CA and certificates live")
        p.add_argument("--days", type=_days, default=float(days),
                       help=f"valid this many days (default {days})")
        p.add_argument("--trust-domain", dest="trust_domain", metavar="TD",
                       help="SPIFFE trust domain (default: the CA's, else $GHOSTGPU_TLS_TRUST_DOMAIN, "
                       f"else {DEFAULT_TRUST_DOMAIN})")
        p.add_argument("--force", action="store_true", help="replace files that exist")
    who = issue.add_mutually_exclusive_group(required=True)
    who.add_argument("--collector", action="append", metavar="HOST[,HOST...]",
                     help="the collector's certificate, for these DNS names and IP addresses")
    who.add_argument("--node", metavar="NAME", help="a tracer's certificate for this node")
    who.add_argument("--user", metavar="NAME", help="a user's certificate")
    issue.add_argument("--group", dest="groups", action="append", default=[], metavar="G",
                       help="with --user: a group (the certificate's O; repeatable)")


def run(args: argparse.Namespace) -> int:
    directory: Path = args.dir
    env_td = os.environ.get(TRUST_DOMAIN_ENV)
    if args.certs_command == "init":
        td = check_trust_domain(args.trust_domain or env_td or DEFAULT_TRUST_DOMAIN, "--trust-domain")
        ca = make_ca(td, days=args.days)
        written = write_pair(directory, "ca", ca, args.force)
        print(f"wrote {written[0]} and {written[1]} (trust domain {td}); keep ca.key private")
        return 0
    ca = _read_ca(directory)
    td = check_trust_domain(args.trust_domain or trust_domain_of_ca(ca.cert_pem) or env_td
                            or DEFAULT_TRUST_DOMAIN, "--trust-domain")
    if args.groups and not args.user:
        raise ValueError("--group: only a --user certificate carries groups")
    if args.collector:
        hosts = [h.strip() for value in args.collector for h in value.split(",") if h.strip()]
        stem, pair = "collector", collector_cert(ca, hosts, td, days=args.days)
        use = "ghostgpu collector"
    elif args.node:
        stem, pair = f"node-{args.node}", node_cert(ca, args.node, td, days=args.days)
        use = f"ghostgpu tracer --node-name {args.node}"
    else:
        stem, pair = f"user-{args.user}", user_cert(ca, args.user, args.groups, td, days=args.days)
        use = "ghostgpu ps|findings|trace|audit"
    cert, key = write_pair(directory, stem, pair, args.force)
    print(f"wrote {cert} and {key}; use: {use} --tls-cert {cert} --tls-key {key} "
          f"--tls-ca {directory / 'ca.crt'}")
    return 0
