"""PostgreSQL LISTEN/NOTIFY between collector replicas: the listener, and the NOTIFY a write sends.

    notifier = notifier_for(store, password_file)        # a NullNotifier with SQLite
    unsubscribe = notifier.subscribe("ghostgpu_findings", on_findings)   # on_findings(payload | None)
    notifier.start(loop)        # callbacks run on `loop`, the collector's event loop
    ...
    notifier.stop()

Sending: `notify_op(channel, payloads)` is a Store.op_call that runs `SELECT pg_notify(...)` in the
write group's transaction, beside the rows it announces, so PostgreSQL delivers the notification at
that commit and never before: a listener that reads the rows on hearing of them finds them there. A
fenced-out job (collector/leases.py) is dropped whole, its NOTIFY with it. `finding_announcer` and
`trace_announcer` build those ops for collector/cluster.py and collector/trace_store.py.

Listening: one dedicated connection in autocommit mode (a LISTEN inside an open transaction would
hear nothing until it ends) on a thread of its own, which LISTENs on every subscribed channel and
waits in psycopg's `Connection.notifies(timeout=...)` (psycopg 3.2+; the timeout lets the thread see
stop() and channels subscribed since), handing each (channel, payload) to the loop with
call_soon_threadsafe. When the connection breaks (PostgreSQL restarts, the network drops: libpq's
TCP keepalives, collector/db.py) the thread reconnects with backoff; notifications sent meanwhile are
lost, so after every (re)connect, the first one included, each subscriber is called with None
("resync"): the listener hears everything committed from now on; re-read what you may have missed.

With SQLite there is one collector, whose watchers see every change in memory already: a
NullNotifier takes the subscriptions and never calls them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ghostgpu.collector.db import StoreUrl, connect_postgresql, db_errors
from ghostgpu.collector.notices import (
    CHANNELS,
    FINDINGS_CHANNEL,
    PAYLOAD_MAX_BYTES,
    TRACE_CHANNEL,
    Change,
    check_source,
    encode_findings,
    encode_trace,
)
from ghostgpu.collector.store import CallOp, Store, StoreError

log = logging.getLogger(__name__)

Callback = Callable[[str | None], None]  # the payload; None: resync (re-read what may have been missed)
WAIT_S = 0.25  # how long one notifies() wait lasts: stop() and new channels take effect within it
RECONNECT_MAX_S = 2.0
_CHANNEL = re.compile(r"[a-z_][a-z0-9_]{0,62}")


def notify_op(channel: str, payloads: Sequence[str]) -> CallOp:
    """A write op: NOTIFY `channel` with each payload, in the transaction of the group it joins."""
    sized = [p for p in payloads if len(p.encode()) <= PAYLOAD_MAX_BYTES]
    if len(sized) < len(payloads):  # would fail the whole write group: the encoders never make one
        log.error("%s: %d notification payload(s) over %d bytes left out", channel,
                  len(payloads) - len(sized), PAYLOAD_MAX_BYTES)

    def run(conn: Any) -> None:
        if isinstance(conn, sqlite3.Connection):  # one collector: nobody listens
            return
        for payload in sized:
            conn.execute("SELECT pg_notify(?, ?)", (channel, payload))

    return Store.op_call(run)


def finding_announcer(source: str) -> Callable[[Sequence[Change]], CallOp]:
    """(finding id, FindingEvent.Kind) changes -> the op announcing them on ghostgpu_findings."""
    check_source(source)
    return lambda changes: notify_op(FINDINGS_CHANNEL, encode_findings(source, changes))


def trace_announcer(source: str) -> Callable[[str], CallOp]:
    """A trace session id -> the op announcing that its row or records changed (ghostgpu_trace)."""
    check_source(source)
    return lambda session: notify_op(TRACE_CHANNEL, [encode_trace(source, session)])


class Notifications(Protocol):
    """What the collector's pieces take: a Notifier, or a NullNotifier with SQLite."""

    def subscribe(self, channel: str, callback: Callback) -> Callable[[], None]: ...

    def start(self, loop: asyncio.AbstractEventLoop) -> None: ...

    def stop(self, timeout_s: float = 5.0) -> None: ...

    def wait_listening(self, timeout_s: float) -> bool: ...


class NullNotifier:
    """SQLite: one collector, nothing to listen for. Subscriptions are kept and never called."""

    engine = "sqlite"

    def subscribe(self, channel: str, callback: Callback) -> Callable[[], None]:
        _check_channel(channel)
        return lambda: None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        pass

    def stop(self, timeout_s: float = 5.0) -> None:
        pass

    def wait_listening(self, timeout_s: float) -> bool:
        return True


def _check_channel(channel: str) -> None:
    if not _CHANNEL.fullmatch(channel):
        raise ValueError(f"notification channel {channel!r}: write a lower-case SQL name "
                         "(letters, digits, _), such as ghostgpu_commands")


class Notifier:
    """See the module docstring. subscribe() from any thread; callbacks run on the loop."""

    engine = "postgresql"

    def __init__(self, url: StoreUrl, password_file: str | None = None, replica_id: str = "collector", *,
                 wait_s: float = WAIT_S) -> None:
        self.url = url
        self._password_file = password_file
        self.application_name = f"ghostgpu-collector {replica_id} listen"
        self.wait_s = wait_s
        self._subs: dict[str, list[Callback]] = {channel: [] for channel in CHANNELS}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._listening = threading.Event()
        self.down_since: float | None = None  # monotonic time the listener lost its connection
        self.notifications_total = 0
        # by channel, for /metrics (collector/metrics.py): written by the listener thread only; a
        # scrape copies it (dict(), one C-level copy under the GIL)
        self.notifications_by_channel: dict[str, int] = dict.fromkeys(CHANNELS, 0)
        self.reconnects_total = 0

    # ---- the API ---------------------------------------------------------------------------------

    def subscribe(self, channel: str, callback: Callback) -> Callable[[], None]:
        """Call `callback(payload)` on the loop for each notification on `channel`, and
        `callback(None)` after each (re)connect. Returns the unsubscribe function. A channel new
        to the listener is LISTENed within wait_s; ghostgpu_findings, _trace and _commands always are."""
        _check_channel(channel)
        with self._lock:
            self._subs.setdefault(channel, []).append(callback)

        def unsubscribe() -> None:
            with self._lock, contextlib.suppress(ValueError):
                self._subs.get(channel, []).remove(callback)

        return unsubscribe

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._thread is not None:
            return
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="collector-listen", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop listening (within wait_s), close the connection. Idempotent."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def wait_listening(self, timeout_s: float) -> bool:
        """Whether the listener is connected and LISTENing, waiting up to timeout_s for it."""
        return self._listening.wait(timeout_s)

    @property
    def listening(self) -> bool:
        return self._listening.is_set()

    # ---- the listener thread -----------------------------------------------------------------------

    def _channels(self) -> set[str]:
        with self._lock:
            return set(self._subs)

    def _run(self) -> None:
        attempt = 0
        broken: tuple[type[BaseException], ...] = (*db_errors(), OSError, StoreError)
        while not self._stopping.is_set():
            conn: Any = None
            try:
                conn = connect_postgresql(self.url, self._password_file,
                                          application_name=self.application_name)
                listened = self._listen(conn.raw, self._channels())
                self._listening.set()
                if self.down_since is not None:
                    log.warning("%s: listening for other replicas' changes again after %.1f s", self.url.flag,
                                time.monotonic() - self.down_since)
                    self.down_since = None
                    self.reconnects_total += 1
                attempt = 0
                self._post_all(None)  # anything committed before this LISTEN went unheard: re-read
                self._listen_loop(conn.raw, listened)
            except broken as e:
                self._listening.clear()
                if self.down_since is None:
                    self.down_since = time.monotonic()
                    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    log.error("%s: not listening for other replicas' changes (%s); reconnecting",
                              self.url.flag, first)
                attempt += 1
                self._stopping.wait(min(RECONNECT_MAX_S, 0.05 * (2 ** min(attempt, 6))))
            finally:
                self._listening.clear()
                if conn is not None:
                    with contextlib.suppress(*db_errors()):
                        conn.close()

    @staticmethod
    def _listen(raw: Any, channels: set[str]) -> set[str]:
        for channel in sorted(channels):  # names checked by subscribe(): safe to write as identifiers
            raw.execute(f"LISTEN {channel}")
        return channels

    def _listen_loop(self, raw: Any, listened: set[str]) -> None:
        while not self._stopping.is_set():
            # psycopg 3.2+: yields each notification as it arrives, returns after wait_s without one
            for n in raw.notifies(timeout=self.wait_s):
                self.notifications_total += 1
                by_channel = self.notifications_by_channel
                by_channel[n.channel] = by_channel.get(n.channel, 0) + 1
                self._post(n.channel, n.payload)
            if new := self._channels() - listened:
                listened |= self._listen(raw, new)
                self._post_all(None, only=new)

    def _post(self, channel: str, payload: str | None) -> None:
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the collector stops
                loop.call_soon_threadsafe(self._deliver, channel, payload)

    def _post_all(self, payload: None, only: set[str] | None = None) -> None:
        for channel in self._channels():
            if only is None or channel in only:
                self._post(channel, payload)

    def _deliver(self, channel: str, payload: str | None) -> None:
        """On the loop: every subscriber of the channel; one that raises does not stop the others."""
        with self._lock:
            callbacks = list(self._subs.get(channel, ()))
        for callback in callbacks:
            try:
                callback(payload)
            except Exception:
                log.exception("notification on %s: a subscriber failed", channel)


def notifier_for(store: Store, password_file: str | None = None) -> Notifier | NullNotifier:
    """The store's notifier: a Notifier on its PostgreSQL database, a NullNotifier with SQLite."""
    if store.engine != "postgresql":
        return NullNotifier()
    return Notifier(store.url, password_file, store.replica_id)
