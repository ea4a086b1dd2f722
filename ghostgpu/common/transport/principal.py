"""Who is calling the collector: the one identity type that TLS, the policy and the audit share.

Where an identity comes from (docs/SECURITY.md):
- a tracer's client certificate: URI SAN spiffe://TRUST_DOMAIN/node/NAME -> `node:NAME`;
- a user's client certificate: URI SAN spiffe://TRUST_DOMAIN/user/NAME, else the subject's CN
  -> `user:NAME`, with the subject's O values as its groups (`group:NAME`);
- the collector's unix socket: the peer's uid from SO_PEERCRED -> `uid:N`;
- a loopback TCP peer without a certificate: the uid owning the peer's socket, read from
  /proc/net/tcp{,6} (the kernel's word, as identd did) -> `uid:N`;
- anything else (plaintext on another address, allowed only with --insecure) -> `anonymous`.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("node", "user", "uid", "anonymous")


@dataclass(frozen=True)
class Principal:
    kind: str  # one of KINDS
    name: str = ""  # node or user name, the uid as text; "" for anonymous
    groups: tuple[str, ...] = ()  # a certificate subject's O values
    via: str = ""  # "mtls" | "unix" | "loopback" | "plaintext": how the identity was established
    peer: str = ""  # the transport peer (gRPC's context.peer()), for the audit

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"principal kind {self.kind!r}: use one of {', '.join(KINDS)}")

    @property
    def subject(self) -> str:
        """`node:n1`, `user:alice`, `uid:0` or `anonymous`: how the policy and the audit name it."""
        return "anonymous" if self.kind == "anonymous" else f"{self.kind}:{self.name}"

    def subjects(self) -> tuple[str, ...]:
        """Every policy subject this principal matches: itself, then `group:G` for each group."""
        return (self.subject, *(f"group:{g}" for g in self.groups))

    def __str__(self) -> str:
        return self.subject


ANONYMOUS = Principal("anonymous")
