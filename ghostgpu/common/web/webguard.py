"""What a web config (ghostgpu/common/web/webconfig.py) asks of each connection and request, kept current.

    guard = WebGuard("/etc/ghostgpu/web.yml", open_paths=("/healthz", "/readyz"))  # WebConfigError
    ctx = guard.context()                  # per accepted connection: the SSLContext, None for HTTP
    guard.peer_refused(tls_socket)         # after the handshake: client_allowed_sans
    guard.refuse(path, authorization, source)  # per request: (429 | 401, body, headers) or None
    guard.headers()                        # http_server_config.headers for every response

Reload, as exporter-toolkit does, but never on the caller's thread: context() and refuse() run on
the HTTP loop thread, which serves every connection and kubelet's probes, and a reload (YAML, every
bcrypt hash, an SSLContext) would stall them all. So a call stats the config file and the files it
names (ghostgpu/common/system/filewatch.py: a mounted Secret's symlink swap changes the inode) at
most once per RELOAD_CHECK_INTERVAL_S, and when one changed re-reads them on a thread of its own;
calls meanwhile get the current set. A good new set serves the connections after it is in; open
connections keep theirs. A bad one (half-written cert, key of another cert) keeps the old set and
logs one line per change. Whether the port speaks TLS is decided at start: a reload cannot turn it on or off.

Basic auth: bcrypt is slow on purpose (~50 ms at cost 10), and Prometheus sends the same credentials
every scrape, so successes are cached by SHA-256 of (user, hash, password), as exporter-toolkit does;
a failure is never cached, so wrong pairs cannot push the good one out. An unknown user is checked
against a fixed hash so that it takes as long as a known one. Any password is answered: one bcrypt
cannot take (over 72 bytes, which bcrypt 5 refuses with an exception) is a plain 401. Every hash is
checked at load (a malformed one is a WebConfigError naming the user, not a failing scrape later).
/healthz and /readyz (open_paths) need no credentials: kubelet's probes cannot send them (see
docs/SECURITY.md); TLS still applies to them.

rate_limit is a token bucket per source address (RATE_SOURCES_MAX of them, the least recently used
forgotten), checked before the password; the open paths are outside it, so junk requests from one
address neither starve other clients nor make kubelet's probes fail.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import ipaddress
import logging
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ghostgpu.common.system.filewatch import Signature, file_signature
from ghostgpu.common.web.webconfig import WebConfig, WebConfigError, load_web_config, server_context

log = logging.getLogger("ghostgpu.http")

AUTH_CACHE_MAX = 100  # verified (user, password) pairs remembered; a scraper uses one
BCRYPT_MAX_PASSWORD_BYTES = 72  # bcrypt reads no more; bcrypt 5 raises past it
RATE_SOURCES_MAX = 10_000  # per-address buckets kept; the least recently used is forgotten past it
RELOAD_CHECK_INTERVAL_S = 1.0  # how often the config's files are stat'ed for a change
# bcrypt of "ghostgpu: no such user" at cost 10: what an unknown user's password is checked against.
_NO_USER_HASH = b"$2b$10$A0xTZaiBgu17k1.wZ1wW5Okv9RoZKhTpFzXmnzxoV/ANa5kAeaAUK"


class BasicAuth:
    """bcrypt basic auth with exporter-toolkit's cache; thread-safe."""

    def __init__(self, users: Mapping[str, bytes]) -> None:
        self.users = dict(users)
        self._cache: OrderedDict[bytes, bool] = OrderedDict()  # verified pairs only
        self._lock = threading.Lock()

    def check(self, authorization: str | None) -> bool:
        if not authorization or not authorization.lower().startswith("basic "):
            return False
        try:
            decoded = base64.b64decode(authorization[6:].strip(), validate=True).decode()
            user, sep, password = decoded.partition(":")
        except (binascii.Error, UnicodeDecodeError, ValueError):
            return False
        if not sep:
            return False
        users = self.users
        known = user in users
        hashed = users[user] if known else _NO_USER_HASH
        secret = password.encode()
        key = hashlib.sha256(b"\0".join((user.encode(), hashed, secret))).digest()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return known
        if len(secret) > BCRYPT_MAX_PASSWORD_BYTES:
            return False  # no bcrypt hash matches it (bcrypt 5 raises rather than truncate)
        import bcrypt  # only where basic_auth_users is set

        try:
            ok = bcrypt.checkpw(secret, hashed)
        except ValueError:  # checked at load; a hash bcrypt cannot read matches nothing
            return False
        if not (ok and known):
            return False  # failures are not remembered: they cannot evict the scraper's pair
        with self._lock:
            self._cache[key] = True
            self._cache.move_to_end(key)
            while len(self._cache) > AUTH_CACHE_MAX:
                self._cache.popitem(last=False)  # the least recently used verified pair
        return True


class RateLimiter:
    """A token bucket: `burst` requests at once, one more every `interval_s` (exporter-toolkit's)."""

    def __init__(self, interval_s: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s, self.burst, self._clock = interval_s, burst, clock
        self._tokens = float(burst)
        self._last = clock()
        self._lock = threading.Lock()

    def allow(self) -> bool:
        if self.interval_s <= 0:
            return True
        with self._lock:
            now = self._clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._last) / self.interval_s)
            self._last = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return True
            return False


class SourceRateLimiter:
    """rate_limit per source address: one RateLimiter each, the least recently used forgotten past
    `max_sources` (a forgotten address starts again with a full bucket)."""

    def __init__(self, interval_s: float, burst: int, clock: Callable[[], float] = time.monotonic,
                 max_sources: int = RATE_SOURCES_MAX) -> None:
        self.interval_s, self.burst, self._clock, self.max_sources = interval_s, burst, clock, max_sources
        self._buckets: OrderedDict[str, RateLimiter] = OrderedDict()
        self._lock = threading.Lock()

    def allow(self, source: str) -> bool:
        if self.interval_s <= 0:
            return True
        with self._lock:
            bucket = self._buckets.get(source)
            if bucket is None:
                bucket = self._buckets[source] = RateLimiter(self.interval_s, self.burst, self._clock)
                while len(self._buckets) > self.max_sources:
                    self._buckets.popitem(last=False)
            else:
                self._buckets.move_to_end(source)
        return bucket.allow()


class WebGuard:
    def __init__(self, path: str, open_paths: Iterable[str] = (),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.open_paths = frozenset(open_paths)
        self._lock = threading.Lock()
        self._clock = clock
        self._next_check_s = clock() + RELOAD_CHECK_INTERVAL_S
        self._reloading = False  # a reload thread is running: no second one
        config = load_web_config(path)  # WebConfigError: the caller says it and exits 2
        self._check_bcrypt(config)
        self.tls = config.tls is not None
        self._config = config
        self._context = self._build_context(config)
        self._signature = file_signature(config.files)
        self._bad_signature: Signature | None = None
        self.auth = BasicAuth(config.users)
        self.limiter = SourceRateLimiter(config.rate_interval_s, config.rate_burst)
        self.reloads = 0
        self.reload_errors = 0

    @property
    def where(self) -> str:
        return f"web config {self.path}"

    @staticmethod
    def _check_bcrypt(config: WebConfig) -> None:
        """bcrypt is there, and can read every hash: a malformed one (a bad character, a salt bcrypt
        refuses) is one line naming its user now, rather than every scrape failing later."""
        if not config.users:
            return
        try:
            import bcrypt
        except ImportError:
            raise WebConfigError(f"web config {config.path}: basic_auth_users needs the bcrypt package; "
                                 "pip install bcrypt") from None
        for user, hashed in config.users.items():
            # The same salt and hash at the lowest cost: bcrypt parses it all in about a millisecond.
            cheap = hashed[:4] + b"04" + hashed[6:]
            try:
                bcrypt.checkpw(b"", cheap)
            except ValueError as e:
                raise WebConfigError(f"web config {config.path}: basic_auth_users.{user}: not a bcrypt hash "
                                     f"bcrypt can read ({e}); make one with htpasswd -nBC 10 \"\" | "
                                     "tr -d ':\\n'") from None

    def _build_context(self, config: WebConfig) -> ssl.SSLContext | None:
        return server_context(config.tls, f"web config {config.path}") if config.tls is not None else None

    def _refresh(self) -> None:
        """At most once per RELOAD_CHECK_INTERVAL_S: stat the config and its files, and when one
        changed since the last look, reload them on a thread of their own (see the module doc)."""
        now = self._clock()
        if now < self._next_check_s:
            return
        with self._lock:
            if now < self._next_check_s or self._reloading:
                return
            self._next_check_s = now + RELOAD_CHECK_INTERVAL_S
            signature = file_signature(self._config.files)
            if signature == self._signature or signature == self._bad_signature:
                return
            self._reloading = True
        try:
            threading.Thread(target=self._reload, args=(signature,), name="web-config-reload",
                             daemon=True).start()
        except RuntimeError:  # no thread to be had: try again at the next look
            with self._lock:
                self._reloading = False

    def _reload(self, signature: Signature) -> None:
        """Re-read the config and its files (`signature`: how they looked when the change was seen)."""
        try:
            try:
                config = load_web_config(self.path)
                self._check_bcrypt(config)
                if (config.tls is not None) != self.tls:
                    raise WebConfigError(f"{self.where}: tls_server_config was "
                                         f"{'removed' if self.tls else 'added'}; restart to change whether "
                                         "this port speaks TLS")
                context = self._build_context(config)
            except Exception as e:  # never let a reload take the server down: keep the old set
                self._bad_signature = signature
                self.reload_errors += 1
                log.warning("%s; keeping the previous web config", e)
                return
            self._config, self._context = config, context
            self._signature = file_signature(config.files)
            self._bad_signature = None
            self.auth.users = dict(config.users)
            self.limiter = SourceRateLimiter(config.rate_interval_s, config.rate_burst)
            self.reloads += 1
            log.info("%s: reloaded", self.where)
        finally:
            with self._lock:
                self._reloading = False

    def context(self) -> ssl.SSLContext | None:
        """The SSLContext a new connection is wrapped with (None: plain HTTP); cheap, never reloads
        on the caller's thread."""
        self._refresh()
        return self._context

    def peer_refused(self, sock: Any) -> str | None:
        """After the handshake: why the client's certificate is refused (client_allowed_sans), or None."""
        tls = self._config.tls
        if tls is None or tls.client_allowed_sans is None:
            return None
        cert = sock.getpeercert() or {}
        for kind, value in cert.get("subjectAltName", ()):
            for allowed in tls.client_allowed_sans:
                if value == allowed or (kind == "IP Address" and _same_ip(value, allowed)):
                    return None
        return "no subject alternative name of the client certificate is in client_allowed_sans"

    def refuse(self, path: str, authorization: str | None, source: str = ""
               ) -> tuple[int, bytes, dict[str, str]] | None:
        """(status, body, headers) when this request from `source` (the client's address) is not to be
        served, else None. The open paths (the probes) are neither rate-limited nor asked for a password."""
        self._refresh()
        if path in self.open_paths:
            return None
        if not self.limiter.allow(source):
            return 429, b"Too Many Requests\n", {}
        if not self.auth.users:
            return None
        if self.auth.check(authorization):
            return None
        return 401, b"Unauthorized\n", {"WWW-Authenticate": 'Basic realm="ghostgpu"'}

    def headers(self) -> Mapping[str, str]:
        return self._config.headers


def _same_ip(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a.strip()) == ipaddress.ip_address(b.strip())
    except ValueError:
        return False
