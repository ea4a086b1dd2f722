"""Direct push of findings to Alertmanager's v2 API (`ghostgpu collector --alertmanager URL`).

The Prometheus rules (deploy/prometheus/ghostgpu-rules.yaml) alert on a finding after a scrape and
their `for:`; this path posts it the moment it opens. The two carry the same alert names, labels
(plus source="ghostgpu-collector") and texts, so Alertmanager groups and routes them alike.

The pusher is a watcher of the cluster table. `push()` runs on the collector's event loop for
every finding event and only files it in a map keyed by finding ID (the latest event wins, so
memory is bounded by the findings, not by how far an Alertmanager has fallen behind) and wakes
the sender threads, one per Alertmanager (an HA pair's members each get every alert, and one that
hangs never delays the other). A sender turns those events into the alert book (label set ->
alert) and posts what its Alertmanager has not yet acknowledged, or everything every `resend_s`:
firing alerts without endsAt (so Alertmanager's resolve_timeout ends them if the collector dies),
resolved ones with endsAt for `resolved_keep_s`, as Alertmanager's docs ask of a direct client.

Remediation (collector/remediation.py) adds to it: `offer_remediation()` files what was (or would be)
done for a finding, sent as its alert's `remediation` annotation, and `set_remediation_paused()` fires
or resolves the GhostGPURemediationPaused alert.

GPU faults (collector/faults.py) come the same way: the fault book calls `offer_fault()` on the loop
for each new fault and each change of its pod names; it is filed by fault ID (the latest wins) and
becomes one alert with endsAt `fault_hold_s` after the fault (collector/alertbook.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ghostgpu.collector.alertbook import (
    ALERT_ANNOTATIONS,
    BUILTIN_LABELS,
    FINDING_ALERTS,
    SOURCE,
    AlertBook,
    Due,
    check_label_name,
)
from ghostgpu.collector.alertsend import Endpoint, PostResult, Sender
from ghostgpu.collector.cluster import Watcher

from ghostgpu.v1 import query_pb2

__all__ = ["ALERT_ANNOTATIONS", "FINDING_ALERTS", "SOURCE", "AlertPushStats", "AlertPusher",
           "parse_alert_labels", "parse_alertmanager_urls"]

log = logging.getLogger("ghostgpu.alertpush")
MAX_INBOX = 200_000  # findings awaiting a sender; only reached when none runs
MAX_LOGGED_REASONS = 100  # distinct 400 reasons logged once each; past this, counted only


@dataclass(frozen=True)
class AlertPushStats:
    posts_ok_total: int
    posts_failed_total: int  # no answer, 5xx and 400 (the API refused part of a batch)
    posts_rejected_total: int  # the 400s among them
    alerts_sent_total: int  # alerts in POSTs an Alertmanager accepted, counted per Alertmanager
    pending: int  # alerts some Alertmanager has not yet taken at their latest state (or held to settle)
    last_success_unix_s: float  # 0.0: never
    last_error: str  # "" until a POST fails


def parse_alertmanager_urls(values: Iterable[str]) -> list[str]:
    """--alertmanager is repeatable and also takes comma-separated URLs; duplicates count once.
    ValueError (one line) on a URL that is not http(s)://HOST[:PORT][/prefix]."""
    urls: list[str] = []
    for value in values:
        for url in (u.strip() for u in value.split(",")):
            if url and Endpoint.parse(url).display not in {Endpoint.parse(u).display for u in urls}:
                urls.append(url)
    return urls


def parse_alert_labels(values: Iterable[str]) -> dict[str, str]:
    """--alert-label KEY=VALUE (repeatable) as a dict; ValueError (one line) on a bad one."""
    labels: dict[str, str] = {}
    for value in values:
        key, sep, val = value.partition("=")
        if not sep:
            raise ValueError(f"--alert-label {value!r}: use KEY=VALUE (e.g. cluster=prod-eu)")
        labels[key.strip()] = val
    check_extra_labels(labels)
    return labels


def check_extra_labels(labels: Mapping[str, str]) -> None:
    for key, val in labels.items():
        check_label_name(key, "--alert-label")
        if key in BUILTIN_LABELS:
            raise ValueError(f"--alert-label {key}={val}: {key} is set by ghostgpu for every alert; "
                             "pick another name")
        if not val:
            raise ValueError(f"--alert-label {key}=: an empty value is dropped by Alertmanager; give a value")


class _PushWatcher(Watcher):
    """Every finding, every class; never dropped: it keeps only the latest event per finding."""

    def __init__(self, pusher: AlertPusher) -> None:
        super().__init__(node="", namespace="", classes=())
        self._pusher = pusher

    def push(self, event: query_pb2.FindingEvent) -> None:
        self._pusher._offer(event)


class _Target:
    """One Alertmanager: its sender (owned by its thread) and its schedule."""

    def __init__(self, endpoint: Endpoint, timeout_s: float) -> None:
        self.sender = Sender(endpoint, timeout_s)
        self.name = endpoint.display
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None
        self.retry_mono = 0.0  # no attempt before this (backoff after a failure)


class AlertPusher:
    def __init__(self, urls: list[str], *, resend_s: float, extra_labels: dict[str, str] | None = None,
                 resolved_keep_s: float = 300.0, timeout_s: float = 5.0,
                 settle_s: float = 1.0, max_batch: int = 500, fault_hold_s: float = 3600.0) -> None:
        endpoints = [Endpoint.parse(u) for u in parse_alertmanager_urls(urls)]
        if not endpoints:
            raise ValueError("--alertmanager: no URL given; use http://HOST:PORT (e.g. http://127.0.0.1:9093)")
        if not resend_s > 0:
            raise ValueError(f"--alertmanager-resend-s {resend_s}: must be above 0 (e.g. 60)")
        if not fault_hold_s > 0:
            raise ValueError(f"--alert-fault-hold {fault_hold_s}: must be above 0 (e.g. 1h)")
        if timeout_s <= 0 or resolved_keep_s < 0 or settle_s < 0 or max_batch < 1:
            raise ValueError(f"AlertPusher: timeout_s {timeout_s} must be > 0, resolved_keep_s "
                             f"{resolved_keep_s} and settle_s {settle_s} >= 0, max_batch {max_batch} >= 1")
        extra = dict(extra_labels or {})
        check_extra_labels(extra)
        self.resend_s, self.timeout_s, self.max_batch = resend_s, timeout_s, max_batch
        self.watcher: Watcher = _PushWatcher(self)
        self._targets = [_Target(e, timeout_s) for e in endpoints]
        self._book = AlertBook([t.name for t in self._targets], extra, resend_s=resend_s,
                               resolved_keep_s=resolved_keep_s, settle_s=settle_s)
        self._book.fault_hold_s = fault_hold_s
        self._inbox: dict[int, query_pb2.FindingEvent] = {}
        self._fault_inbox: dict[int, query_pb2.ClusterFault] = {}
        self._released: set[int] = set()  # findings whose node moved to another replica (release_findings)
        self._note_inbox: dict[int, str] = {}  # finding ID -> its remediation note (offer_remediation)
        self._paused_inbox: str | None = None  # the paused alert's reason to apply ("" resolves it)
        self._inbox_lock = threading.Lock()  # held only to file or swap the inbox: push() never waits long
        self._inbox_dropped = 0
        self._lock = threading.Lock()  # the book and the counters below; never held across a POST
        self._stopping = False
        self._stop_deadline = 0.0
        self._posts_ok = self._posts_failed = self._posts_rejected = self._alerts_sent = 0
        self._last_success_unix_s = 0.0
        self._last_error = ""
        self._logged_reasons: set[str] = set()

    @property
    def urls(self) -> list[str]:
        return [t.name for t in self._targets]

    # ---- the event loop's side -----------------------------------------------------------------

    def _offer(self, event: query_pb2.FindingEvent) -> None:
        """O(1), never blocks on a POST, never raises: the cluster table calls it for every event."""
        try:
            fid = event.finding.id
            with self._inbox_lock:
                full = len(self._inbox) >= MAX_INBOX and fid not in self._inbox
                if full:
                    self._inbox_dropped += 1  # no sender is draining (not started, or stopped by a bug)
                else:
                    self._inbox[fid] = event
            if full:
                if self._inbox_dropped == 1:
                    log.warning("alertpush: %d findings wait and no sender takes them (was start() called?); "
                                "further ones are not pushed", MAX_INBOX)
                return
            for t in self._targets:
                t.wake.set()
        except Exception:  # a watcher must not break ingest; the next event carries the state again
            log.exception("alertpush: could not queue a finding event")

    def release_findings(self, finding_ids: list[int]) -> None:
        """These findings' node moved to another collector replica, which pushes their alerts from now
        on: stop sending them, without resolving them (O(1) per id; ingest calls it)."""
        if not finding_ids:
            return
        with self._inbox_lock:
            for fid in finding_ids:
                self._inbox.pop(fid, None)
            self._released.update(finding_ids)
        for t in self._targets:
            t.wake.set()

    def offer_fault(self, fault: query_pb2.ClusterFault) -> None:
        """A new GPU fault, or new names for its pods: O(1), never blocks, never raises (ingest calls it)."""
        try:
            with self._inbox_lock:
                full = len(self._fault_inbox) >= MAX_INBOX and fault.id not in self._fault_inbox
                if full:
                    self._inbox_dropped += 1
                else:
                    self._fault_inbox[fault.id] = fault
            if not full:
                for t in self._targets:
                    t.wake.set()
        except Exception:  # as _offer: the next change carries the fault again
            log.exception("alertpush: could not queue a GPU fault")

    def offer_remediation(self, finding_id: int, note: str) -> None:
        """What remediation did or would do for a finding (collector/remediation.py): the `remediation`
        annotation of its alert. O(1), never blocks; the engine calls it on the loop."""
        with self._inbox_lock:
            self._note_inbox[finding_id] = note
        for t in self._targets:
            t.wake.set()

    def set_remediation_paused(self, reason: str) -> None:
        """Fire the GhostGPURemediationPaused alert (remediation paused, or its breaker open: `reason`),
        or resolve it (""). O(1), never blocks."""
        with self._inbox_lock:
            self._paused_inbox = reason
        for t in self._targets:
            t.wake.set()

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        for i, t in enumerate(self._targets):
            if t.thread is None:
                t.thread = threading.Thread(target=self._run, args=(t,), name=f"alertpush-{i}", daemon=True)
                t.thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """One last attempt (within `timeout_s` in all) to deliver resolutions not yet delivered;
        firing alerts are left to Alertmanager's resolve_timeout. Never waits past the deadline."""
        self._stop_deadline = time.monotonic() + timeout_s
        self._stopping = True
        for t in self._targets:
            t.wake.set()
        for t in self._targets:
            if t.thread is not None:
                t.thread.join(max(0.0, self._stop_deadline - time.monotonic()))
        for t in self._targets:
            if t.thread is not None and t.thread.is_alive():
                log.warning("alertpush: %s still busy at stop; resolutions it had not taken are left to "
                            "its resolve_timeout", t.name)

    def stats(self) -> AlertPushStats:
        with self._lock:
            return AlertPushStats(self._posts_ok, self._posts_failed, self._posts_rejected,
                                  self._alerts_sent, self._book.pending(), self._last_success_unix_s,
                                  self._last_error)

    # ---- sender threads --------------------------------------------------------------------------

    def _take_inbox(self, now_mono: float) -> None:
        """Move queued events into the book (the caller holds self._lock); wake every sender on a change."""
        with self._inbox_lock:
            events, self._inbox = self._inbox, {}
            faults, self._fault_inbox = self._fault_inbox, {}
            released, self._released = self._released, set()
            notes, self._note_inbox = self._note_inbox, {}
            paused, self._paused_inbox = self._paused_inbox, None
        changed = self._book.release(released) if released else False
        changed |= self._book.apply(events.values(), now_mono)
        changed |= self._book.apply_faults(faults.values(), now_mono)
        if notes:
            changed |= self._book.apply_notes(notes)
        if paused is not None:
            changed |= self._book.set_paused(paused, now_mono)
        if changed:
            for t in self._targets:
                t.wake.set()

    def _run(self, target: _Target) -> None:
        try:
            while not self._stopping:
                target.wake.clear()
                now = time.monotonic()
                with self._lock:
                    self._take_inbox(now)
                    batch, next_mono = self._book.due(target.name, now, self.max_batch)
                if batch and now >= target.retry_mono:
                    self._post(target, batch)
                    continue
                wake_at = target.retry_mono if batch else next_mono
                target.wake.wait(max(0.0, min(wake_at - now, self.resend_s)))
            self._last_attempt(target)
        except Exception:  # a bug here must not take the collector down; it is logged with its trace
            log.exception("alertpush: the sender for %s stopped", target.name)
        finally:
            target.sender.close()

    def _last_attempt(self, target: _Target) -> None:
        now = time.monotonic()
        with self._lock:
            self._take_inbox(now)
            batch = self._book.unsent_resolutions(target.name, self.max_batch)
        left_s = self._stop_deadline - time.monotonic()
        if batch and left_s > 0.05:
            self._post(target, batch, timeout_s=min(self.timeout_s, left_s))

    def _post(self, target: _Target, batch: list[Due], timeout_s: float | None = None) -> None:
        result = target.sender.post([body for _key, _version, body in batch], timeout_s)
        now = time.monotonic()
        with self._lock:
            if result.ok or result.rejected:
                # A 400 still stored the batch's valid alerts (the v2 API's postAlertsHandler): they are
                # taken; re-sending the invalid ones could only be refused again.
                self._book.taken(target.name, [(k, v) for k, v, _ in batch], now)
            if result.ok:
                self._posts_ok += 1
                self._alerts_sent += len(batch)
                self._last_success_unix_s = time.time()
            else:
                self._posts_failed += 1
                self._posts_rejected += result.rejected
                self._last_error = result.reason
        self._after(target, result, len(batch))

    def _after(self, target: _Target, result: PostResult, n: int) -> None:
        sender = target.sender
        if result.ok:
            if sender.failures:
                log.info("alertpush: %s took alerts again after %d failed attempts", target.name,
                         sender.failures)
            sender.failures = 0
            target.retry_mono = 0.0
            return
        if result.rejected:
            sender.failures = 0
            if result.reason not in self._logged_reasons and len(self._logged_reasons) < MAX_LOGGED_REASONS:
                self._logged_reasons.add(result.reason)
                log.warning("alertpush: %s refused alerts of a batch of %d (its valid ones are stored; "
                            "the rest are dropped): %s", target.name, n, result.reason)
            return
        sender.failures += 1
        delay_s = sender.backoff_s()
        target.retry_mono = time.monotonic() + delay_s
        if sender.failures == 1:
            log.warning("alertpush: POST to %s failed (%s); retrying with backoff up to 30 s, alerts kept",
                        target.name, result.reason)
        else:
            log.debug("alertpush: %s attempt %d failed (%s); next in %.1f s", target.name, sender.failures,
                      result.reason, delay_s)
