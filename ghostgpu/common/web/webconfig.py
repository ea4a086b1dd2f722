"""The Prometheus exporter-toolkit web config file (`--web-config-file`) for /metrics and health ports.

    tls_server_config:
      cert_file: tls.crt              # relative paths are relative to this file's directory
      key_file: tls.key
      client_auth_type: RequireAndVerifyClientCert    # optional; then client_ca_file
      client_ca_file: ca.crt
      min_version: TLS12
    http_server_config:
      headers: {X-Content-Type-Options: nosniff}
    basic_auth_users:
      prometheus: $2y$10$...          # bcrypt (htpasswd -nBC 10 "" | tr -d ':\\n')
    rate_limit: {interval: 100ms, burst: 10}

The format is exporter-toolkit's (docs/web-configuration.md there), read strictly: an unknown key
is a one-line WebConfigError naming it. What Python's ssl cannot do is refused by name rather than
ignored: client_auth_type RequestClientCert and RequireAnyClientCert (a certificate asked for
but not verified). `http2` is accepted and has no effect (HTTP/1.1 only). Of curve_preferences
the first curve is used (Python's ssl sets one ECDH curve). The runtime side (reload, bcrypt cache,
rate limit) is ghostgpu/common/web/webguard.py.
"""

from __future__ import annotations

import os
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ghostgpu.common.model.durations import parse_duration_s
from ghostgpu.common.system import safe_yaml

FLAG = "--web-config-file"

TLS_KEYS = ("cert", "key", "client_ca", "cert_file", "key_file", "client_auth_type", "client_ca_file",
            "cipher_suites", "curve_preferences", "min_version", "max_version", "prefer_server_cipher_suites",
            "client_allowed_sans")
TOP_KEYS = ("tls_server_config", "http_server_config", "basic_auth_users", "rate_limit")
HTTP_KEYS = ("http2", "headers")
RATE_KEYS = ("interval", "burst")
CLIENT_AUTH: dict[str, ssl.VerifyMode] = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
_UNVERIFIED_AUTH = ("RequestClientCert", "RequireAnyClientCert", "RequireClientCert")
TLS_VERSIONS: dict[str, ssl.TLSVersion] = {
    "TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3,
}
# Go's crypto/tls names (what exporter-toolkit takes) -> OpenSSL's. TLS 1.3 suites are accepted and,
# as in Go, not configurable.
CIPHERS: dict[str, str] = {
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_AES_128_GCM_SHA256": "", "TLS_AES_256_GCM_SHA384": "", "TLS_CHACHA20_POLY1305_SHA256": "",
}
CURVES = {"CurveP256": "prime256v1", "CurveP384": "secp384r1", "CurveP521": "secp521r1", "X25519": "X25519"}
# exporter-toolkit's validateHeaderConfig: these headers only, some with fixed values.
HEADERS: dict[str, tuple[str, ...]] = {
    "Content-Security-Policy": (), "X-Frame-Options": ("deny", "sameorigin"),
    "X-Content-Type-Options": ("nosniff",), "X-XSS-Protection": (), "Strict-Transport-Security": (),
}
BCRYPT_PREFIXES = ("$2a$", "$2b$", "$2y$")
_BCRYPT = re.compile(r"\$2[aby]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}")


class WebConfigError(ValueError):
    """The web config is wrong: one line naming the file, the key and what to do."""


@dataclass(frozen=True)
class TlsServerConfig:
    cert_file: str = ""
    key_file: str = ""
    client_ca_file: str = ""
    cert: str = ""  # inline PEM, instead of cert_file
    key: str = ""
    client_ca: str = ""
    client_auth_type: str = "NoClientCert"
    min_version: str = "TLS12"
    max_version: str = "TLS13"
    cipher_suites: tuple[str, ...] = ()
    curve_preferences: tuple[str, ...] = ()
    prefer_server_cipher_suites: bool = True
    client_allowed_sans: tuple[str, ...] | None = None

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(p for p in (self.cert_file, self.key_file, self.client_ca_file) if p)


@dataclass(frozen=True)
class WebConfig:
    path: str
    tls: TlsServerConfig | None = None  # None: plain HTTP (a file with only basic_auth_users is valid)
    users: Mapping[str, bytes] = field(default_factory=dict)  # user -> bcrypt hash
    headers: Mapping[str, str] = field(default_factory=dict)
    http2: bool = True
    rate_interval_s: float = 0.0  # 0: no rate limit
    rate_burst: int = 0

    @property
    def files(self) -> tuple[str, ...]:
        """The config file and every file it names: what a reload watches."""
        return (self.path, *(self.tls.files if self.tls else ()))


def load_web_config(path: str) -> WebConfig:
    """Read and check `path` (YAML); WebConfigError with one line on anything wrong."""
    try:
        text = safe_yaml.read_capped(path)  # 64 KiB at most
    except safe_yaml.YamlRefused as e:
        raise WebConfigError(f"web config {path}: {e}") from None
    except UnicodeDecodeError:
        raise WebConfigError(f"web config {path}: not UTF-8 text; write it as UTF-8 YAML") from None
    except OSError as e:
        raise WebConfigError(f"{FLAG} {path}: cannot read: {e.strerror or e}; fix the path") from None
    return parse_web_config(text, path)


def parse_web_config(text: str, path: str) -> WebConfig:
    where = f"web config {path}"
    try:
        # No anchors, aliases or duplicate keys (ghostgpu/common/system/safe_yaml.py).
        doc = safe_yaml.load(text)
    except safe_yaml.YamlRefused as e:
        raise WebConfigError(f"{where}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise WebConfigError(f"{where}: not valid YAML{at}; fix the syntax") from None
    doc = {} if doc is None else doc
    _mapping(doc, where, "the file", TOP_KEYS)
    base = os.path.dirname(os.path.abspath(path))
    tls = _tls(doc.get("tls_server_config"), where, base)
    http = _mapping(doc.get("http_server_config") or {}, where, "http_server_config", HTTP_KEYS)
    http2 = http.get("http2", True)
    if not isinstance(http2, bool):
        raise WebConfigError(f"{where}: http_server_config.http2: {http2!r} is not true or false")
    headers = _headers(http.get("headers") or {}, where)
    users = _users(doc.get("basic_auth_users") or {}, where)
    rate = _mapping(doc.get("rate_limit") or {}, where, "rate_limit", RATE_KEYS)
    interval_s = _interval_s(rate.get("interval", 0), where)
    burst = rate.get("burst", 0)
    if isinstance(burst, bool) or not isinstance(burst, int) or burst < 0:
        raise WebConfigError(f"{where}: rate_limit.burst: {burst!r} is not a whole number >= 0")
    if interval_s and not burst:
        raise WebConfigError(f"{where}: rate_limit.burst: 0 would refuse every request; set burst >= 1")
    return WebConfig(os.path.abspath(path), tls, users, headers, http2, interval_s, burst)


def _mapping(value: object, where: str, key: str, known: tuple[str, ...]) -> dict[str, object]:
    if not isinstance(value, dict):
        raise WebConfigError(f"{where}: {key}: expected a mapping of keys, got {type(value).__name__}")
    for k in value:
        if k not in known:
            inside = "" if key == "the file" else f"{key}."
            raise WebConfigError(f"{where}: {inside}{k}: unknown key; known keys: {', '.join(known)}")
    return value


def _string(tls: Mapping[str, object], key: str, where: str) -> str:
    value = tls.get(key, "")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise WebConfigError(f"{where}: tls_server_config.{key}: expected a string, "
                             f"got {type(value).__name__}")
    return value


def _names(tls: Mapping[str, object], key: str, where: str, known: Mapping[str, str]) -> tuple[str, ...]:
    values = tls.get(key) or []
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise WebConfigError(f"{where}: tls_server_config.{key}: expected a list of names")
    for v in values:
        if v not in known:
            raise WebConfigError(f"{where}: tls_server_config.{key}: unknown name {v!r}; use one of "
                                 f"{', '.join(known)}")
    return tuple(values)


_TLS_STRINGS = ("cert", "key", "client_ca", "cert_file", "key_file", "client_auth_type", "client_ca_file",
                "min_version", "max_version")
_TLS_ON = ("cert", "key", "client_ca", "cert_file", "key_file", "client_ca_file", "client_auth_type")


def _tls(value: object, where: str, base: str) -> TlsServerConfig | None:
    """tls_server_config, checked in the order its errors are reported; None: plain HTTP."""
    if value is None:
        return None
    tls = _mapping(value, where, "tls_server_config", TLS_KEYS)
    s = {k: _string(tls, k, where) for k in _TLS_STRINGS}
    if not any(s[k] for k in _TLS_ON):
        return None  # exporter-toolkit: no TLS key set means plain HTTP
    for k in ("cert_file", "key_file", "client_ca_file"):
        if s[k] and not os.path.isabs(s[k]):
            s[k] = os.path.join(base, s[k])  # as exporter-toolkit's SetDirectory
    _check_key_pair(s, where)
    auth = _client_auth(s, where)
    min_version, max_version = _versions(s, where)
    prefer = tls.get("prefer_server_cipher_suites", True)
    if not isinstance(prefer, bool):
        raise WebConfigError(f"{where}: tls_server_config.prefer_server_cipher_suites: not true or false")
    sans = _allowed_sans(tls.get("client_allowed_sans"), auth, where)
    return TlsServerConfig(
        cert_file=s["cert_file"], key_file=s["key_file"], client_ca_file=s["client_ca_file"], cert=s["cert"],
        key=s["key"], client_ca=s["client_ca"], client_auth_type=auth, min_version=min_version,
        max_version=max_version, cipher_suites=_names(tls, "cipher_suites", where, CIPHERS),
        curve_preferences=_names(tls, "curve_preferences", where, CURVES),
        prefer_server_cipher_suites=prefer, client_allowed_sans=sans)


def _check_key_pair(s: dict[str, str], where: str) -> None:
    """Each of cert, key and client CA given once (inline PEM or file); a certificate and its key."""
    if any(s[k] and s[f"{k}_file"] for k in ("cert", "key", "client_ca")):
        raise WebConfigError(f"{where}: tls_server_config: give the inline PEM or the _file, not both")
    if not (s["cert"] or s["cert_file"]):
        raise WebConfigError(f"{where}: tls_server_config.cert_file: missing; TLS needs a certificate")
    if not (s["key"] or s["key_file"]):
        raise WebConfigError(f"{where}: tls_server_config.key_file: missing; TLS needs the certificate's key")


def _client_auth(s: dict[str, str], where: str) -> str:
    """client_auth_type (default NoClientCert): one that verifies what it asks for, with its CA."""
    auth = s["client_auth_type"] or "NoClientCert"
    if auth in _UNVERIFIED_AUTH:
        raise WebConfigError(f"{where}: tls_server_config.client_auth_type: {auth} (a certificate asked for "
                             "but not verified) is not supported; use VerifyClientCertIfGiven or "
                             "RequireAndVerifyClientCert")
    if auth not in CLIENT_AUTH:
        raise WebConfigError(f"{where}: tls_server_config.client_auth_type: {auth!r} is not one of "
                             f"{', '.join(CLIENT_AUTH)}")
    has_ca = bool(s["client_ca"] or s["client_ca_file"])
    if has_ca and auth == "NoClientCert":
        raise WebConfigError(f"{where}: tls_server_config.client_ca_file: set without a client_auth_type; "
                             "add client_auth_type: RequireAndVerifyClientCert")
    if auth != "NoClientCert" and not has_ca:
        raise WebConfigError(f"{where}: tls_server_config.client_ca_file: {auth} needs the CA that signs "
                             "client certificates")
    return auth


def _versions(s: dict[str, str], where: str) -> tuple[str, str]:
    """min_version and max_version (default TLS12 and TLS13), known and in order."""
    versions: dict[str, str] = {}
    for k, default in (("min_version", "TLS12"), ("max_version", "TLS13")):
        versions[k] = s[k] or default
        if versions[k] not in TLS_VERSIONS:
            raise WebConfigError(f"{where}: tls_server_config.{k}: {versions[k]!r} is not one of "
                                 f"{', '.join(TLS_VERSIONS)}")
    if TLS_VERSIONS[versions["min_version"]] > TLS_VERSIONS[versions["max_version"]]:
        raise WebConfigError(f"{where}: tls_server_config.min_version: above max_version")
    return versions["min_version"], versions["max_version"]


def _allowed_sans(sans: object, auth: str, where: str) -> tuple[str, ...] | None:
    """client_allowed_sans: a list of strings, only where every client shows a verified certificate."""
    if sans is None:
        return None
    if not isinstance(sans, list) or not all(isinstance(v, str) for v in sans):
        raise WebConfigError(f"{where}: tls_server_config.client_allowed_sans: expected a list of "
                             "strings")
    if auth != "RequireAndVerifyClientCert":
        raise WebConfigError(f"{where}: tls_server_config.client_allowed_sans: needs client_auth_type "
                             "RequireAndVerifyClientCert")
    return tuple(sans)


def _headers(value: object, where: str) -> dict[str, str]:
    headers = _mapping(value, where, "http_server_config.headers", tuple(HEADERS))
    out: dict[str, str] = {}
    for name, v in headers.items():
        if not isinstance(v, str):
            raise WebConfigError(f"{where}: http_server_config.headers.{name}: expected a string")
        allowed = HEADERS[name]
        if allowed and v.lower() not in allowed:
            raise WebConfigError(f"{where}: http_server_config.headers.{name}: {v!r} is not one of "
                                 f"{', '.join(allowed)}")
        if v:
            out[name] = v
    return out


def _users(value: object, where: str) -> dict[str, bytes]:
    if not isinstance(value, dict):
        raise WebConfigError(f"{where}: basic_auth_users: expected a mapping of user: bcrypt hash")
    users = {}
    for user, hashed in value.items():
        # $2a$/$2b$/$2y$, a cost of 04-31, then 53 characters of bcrypt's base64 (salt and hash); that
        # bcrypt can read it (a salt's last character, say) is checked when it loads (webguard.py).
        ok = isinstance(user, str) and isinstance(hashed, str) and _BCRYPT.fullmatch(hashed) is not None
        if not ok:
            raise WebConfigError(f"{where}: basic_auth_users.{user}: not a bcrypt hash ($2y$10$... , 60 "
                                 "characters); make one with htpasswd -nBC 10 \"\" | tr -d ':\\n'")
        users[user] = hashed.encode()
    return users


def _interval_s(value: object, where: str) -> float:
    if value in (0, "0", "", None):
        return 0.0
    try:
        return parse_duration_s(value, "rate_limit.interval")
    except ValueError as e:
        raise WebConfigError(f"{where}: {e}") from None


def server_context(tls: TlsServerConfig, where: str) -> ssl.SSLContext:
    """A server SSLContext for `tls`, its files read now; WebConfigError naming the file on failure."""
    for key in ("cert_file", "key_file", "client_ca_file"):
        name = getattr(tls, key)
        if name and not os.access(name, os.R_OK):
            why = "no such file" if not os.path.exists(name) else "not readable"
            raise WebConfigError(f"{where}: tls_server_config.{key}: {name}: {why}; fix the path or mount it")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = TLS_VERSIONS[tls.min_version]
    ctx.maximum_version = TLS_VERSIONS[tls.max_version]
    # No TLS 1.3 session tickets. Served by asyncio (CPython 3.11's sslproto, httpserve.py), the tickets
    # OpenSSL sends after the handshake can hold a new connection's first answer back by a delayed ACK
    # (about 40 ms; bench_tls.py's scrape on a new connection shows it). Prometheus opens no resumed
    # sessions, and scrapes reuse one keep-alive connection, so nothing uses them.
    ctx.num_tickets = 0
    try:
        if tls.cert_file and tls.key_file:
            ctx.load_cert_chain(tls.cert_file, tls.key_file)
        else:
            _load_inline_pair(ctx, tls)
    except (ssl.SSLError, OSError) as e:
        files = ", ".join(p for p in (tls.cert_file, tls.key_file) if p) or "inline cert and key"
        raise WebConfigError(f"{where}: tls_server_config: cannot load the certificate and key ({files}): "
                             f"{getattr(e, 'reason', None) or e}; check that the key matches the certificate"
                             ) from None
    ctx.verify_mode = CLIENT_AUTH[tls.client_auth_type]
    if tls.client_auth_type != "NoClientCert":
        try:
            if tls.client_ca_file:
                ctx.load_verify_locations(cafile=tls.client_ca_file)
            else:
                ctx.load_verify_locations(cadata=tls.client_ca)
        except (ssl.SSLError, OSError) as e:
            name = tls.client_ca_file or "client_ca"
            raise WebConfigError(f"{where}: tls_server_config.client_ca_file: {name}: cannot load: "
                                 f"{getattr(e, 'reason', None) or e}") from None
    tls12 = [CIPHERS[c] for c in tls.cipher_suites if CIPHERS[c]]
    if tls12:
        ctx.set_ciphers(":".join(tls12))
    if tls.curve_preferences:
        ctx.set_ecdh_curve(CURVES[tls.curve_preferences[0]])
    if tls.prefer_server_cipher_suites:
        ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    return ctx


def _load_inline_pair(ctx: ssl.SSLContext, tls: TlsServerConfig) -> None:
    """Python's ssl loads a key pair from files only: inline PEM goes through a private temp file."""
    import tempfile

    cert = tls.cert or Path(tls.cert_file).read_text()
    key = tls.key or Path(tls.key_file).read_text()
    with tempfile.NamedTemporaryFile("w", suffix=".pem") as f:  # 0600, removed on close
        f.write(cert + "\n" + key)
        f.flush()
        ctx.load_cert_chain(f.name)
