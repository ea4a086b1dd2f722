"""The TLS flags every command shares (docs/SECURITY.md), and the collector's security flags.

--tls-cert, --tls-key, --tls-ca and --tls-trust-domain mean the same on `tracer`, `collector`,
`up`, `ps`, `findings`, `trace` and `audit`; each falls back to GHOSTGPU_TLS_CERT, _KEY, _CA and
_TRUST_DOMAIN (the tracer also reads them as config keys tls_cert, tls_key, tls_ca, tls_trust_domain).
The client commands also take --tls-server-name (no variable).
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

from ghostgpu.common.transport.tls import TlsFiles

INSECURE_HELP = ("serve plaintext on a non-loopback address: gRPC without --tls-*, /metrics or the health "
                 "port without a web config's tls_server_config (anyone who reaches it can read everything, "
                 "and stream events over gRPC); without it such a listener refuses to start")


def add_tls_flags(p: argparse.ArgumentParser, *, verb: bool = False) -> None:
    """verb: on a sub-verb (`trace list`) the defaults are SUPPRESSed, so that a flag given before
    the verb is not overwritten by the verb's default."""
    default = argparse.SUPPRESS if verb else None
    p.add_argument("--tls-cert", dest="tls_cert", metavar="FILE", default=default,
                   help="this client's (or server's) certificate, PEM (env GHOSTGPU_TLS_CERT)")
    p.add_argument("--tls-key", dest="tls_key", metavar="FILE", default=default,
                   help="its private key, PEM (env GHOSTGPU_TLS_KEY)")
    p.add_argument("--tls-ca", dest="tls_ca", metavar="FILE", default=default,
                   help="the CA that signs the peers' certificates, PEM (env GHOSTGPU_TLS_CA)")
    p.add_argument("--tls-trust-domain", dest="tls_trust_domain", metavar="NAME", default=default,
                   help="SPIFFE trust domain of node and user identities (default ghostgpu; "
                   "env GHOSTGPU_TLS_TRUST_DOMAIN)")


def add_collector_uid_flag(p: argparse.ArgumentParser, *, verb: bool = False) -> None:
    """--collector-uid: a client's (ps, findings, trace, audit, the tracer) word on who may serve a
    plaintext collector (unix socket, loopback) besides root (ghostgpu/common/transport/dial.py)."""
    p.add_argument("--collector-uid", dest="collector_uid", type=int, metavar="UID",
                   default=argparse.SUPPRESS if verb else None,
                   help="trust a plaintext collector (unix socket, loopback) served by this uid too; by "
                   "default only root's (or your own) is talked to (env GHOSTGPU_COLLECTOR_UID)")


def collector_uid_from_args(args: Any) -> int | None:
    """--collector-uid, else GHOSTGPU_COLLECTOR_UID; ValueError (one line) for a bad value."""
    import os

    value = getattr(args, "collector_uid", None)
    if value is None:
        text = os.environ.get("GHOSTGPU_COLLECTOR_UID", "").strip()
        if not text:
            return None
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"GHOSTGPU_COLLECTOR_UID {text!r}: not a uid (a number)") from None
    if value < 0:
        raise ValueError(f"--collector-uid {value}: a uid is 0 or more")
    return int(value)


def add_server_security_flags(p: argparse.ArgumentParser) -> None:
    """The collector's (and `up`'s): who may connect, and the record of what they did."""
    with contextlib.suppress(argparse.ArgumentError):  # `up` has it from its tracer's flags already
        p.add_argument("--insecure", action="store_true", help=INSECURE_HELP)
    p.add_argument("--policy", metavar="FILE",
                   help="authorization policy, YAML (docs/SECURITY.md); reloaded on SIGHUP and when "
                   "the file changes. Default: the local root user is admin, nobody else anything")
    p.add_argument("--audit-log", dest="audit_log", metavar="FILE",
                   help="append-only audit log, JSON lines (default: beside --db, NAME.audit.jsonl)")


def add_tls_server_name_flag(p: argparse.ArgumentParser, *, verb: bool = False) -> None:
    """--tls-server-name: a client command's (ps, findings, faults, trace, audit, remediate) name to
    check the collector's certificate against, when the address dialled is not one it names: a
    `kubectl port-forward` (cli/kubectl_plugin.py sets it), an SSH tunnel, an IP."""
    p.add_argument("--tls-server-name", dest="tls_server_name", metavar="NAME",
                   default=argparse.SUPPRESS if verb else None,
                   help="over TLS, the name the collector's certificate must carry, instead of the host "
                   "dialled (e.g. ghostgpu-collector.ghostgpu.svc through a port-forward); no variable")


def tls_from_args(args: Any) -> TlsFiles:
    """The TLS files of a client command's flags, else GHOSTGPU_TLS_* (TlsFiles.resolve), and
    --tls-server-name where the command has it."""
    return TlsFiles.resolve(getattr(args, "tls_cert", None), getattr(args, "tls_key", None),
                            getattr(args, "tls_ca", None), getattr(args, "tls_trust_domain", None),
                            server_name=getattr(args, "tls_server_name", None))
