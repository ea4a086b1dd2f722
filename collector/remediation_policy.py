"""The `remediation:` section of the collector's config file (docs/REMEDIATION.md), typed, and its parser.

    remediation:
      mode: dry-run            # off (default) | dry-run | on
      min_age: 5m              # a finding this old, at least, before anything is done
      namespaces: {include: ["*"], exclude: ["kube-system"]}
      actions:
        kill_orphans: true     # action 1
        isolate_node: false    # action 2
        ticket: {url: "", headers_file: ""}   # action 3; empty url: off
      breaker: {max_actions: 10, window: 1h, max_per_node: 3, max_isolated_nodes_pct: 10}

That shape is a contract (keys, nesting, defaults); the keys past it extend it, under the same section:

      grace: 10s               # SIGTERM, then SIGKILL this long after
      allowlist: ["nv-hostengine", "/usr/bin/dcgm*"]   # exe or comm globs never acted on
      isolation:
        how: taint             # taint (ghostgpu.io/gpu-unhealthy=TRIGGER:NoSchedule) | cordon
        unaccounted_bytes: 0   # a GPU's memory no process owns above this (bytes, or 2GiB) ...
        unaccounted_for: 10m   # ... for this long is an isolation trigger; 0 bytes: no such trigger
        kubeconfig: ""         # the Kubernetes client's kubeconfig; "": the pod's service account

parse_remediation() reads the section as the config file's reader hands it over (TOML's or YAML's
values: both give str, int, float, bool, list and dict), each key checked, a key left out taking the
default above. Every error is a ConfigError of one line naming the file, the key's full path and what
to write instead: `--config c.yaml: remediation.breaker.window: '1x': use a duration like 30s, 5m or
1h (a number alone is seconds), e.g. 1h`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

from ghostgpu.collector.config import REMEDIATION_SECTION as SECTION  # top level, or in [collector]

from ghostgpu.common.model.durations import FLAG_DURATION, format_s, parse_duration_s
from ghostgpu.common.model.remediation import MAX_GRACE_S, MODE_OFF, MODES
from ghostgpu.common.system.configfile import ConfigError

ISOLATE_TAINT, ISOLATE_CORDON = "taint", "cordon"
ISOLATE_HOW = (ISOLATE_TAINT, ISOLATE_CORDON)


@dataclass(frozen=True)
class NamespaceFilter:
    include: tuple[str, ...] = ("*",)  # globs
    exclude: tuple[str, ...] = ("kube-system",)

    def admits(self, namespace: str) -> bool:
        from fnmatch import fnmatchcase

        return (any(fnmatchcase(namespace, g) for g in self.include)
                and not any(fnmatchcase(namespace, g) for g in self.exclude))


@dataclass(frozen=True)
class TicketAction:
    url: str = ""  # empty: no tickets
    headers_file: str = ""  # "Name: value" lines, re-read for each ticket (a rotated token)


@dataclass(frozen=True)
class IsolationSettings:
    """How action 2 isolates a node and when memory no process owns counts as fatal."""

    how: str = ISOLATE_TAINT  # taint | cordon
    unaccounted_bytes: int = 0  # a GPU's unaccounted memory above this ...
    unaccounted_for_s: float = 600.0  # ... for this long is a trigger; 0 bytes: no such trigger
    kubeconfig: str = ""  # the Kubernetes client's kubeconfig file; "": in-cluster (the service account)


@dataclass(frozen=True)
class Breaker:
    max_actions: int = 10  # acts (not dry runs) per window, cluster-wide
    window_s: float = 3600.0
    max_per_node: int = 3  # acts per node per window
    max_isolated_nodes_pct: float = 10.0  # minHealthy: isolate no node past this share of GPU nodes


@dataclass(frozen=True)
class RemediationPolicy:
    mode: str = MODE_OFF
    min_age_s: float = 300.0
    namespaces: NamespaceFilter = field(default_factory=NamespaceFilter)
    kill_orphans: bool = True
    isolate_node: bool = False
    ticket: TicketAction = field(default_factory=TicketAction)
    breaker: Breaker = field(default_factory=Breaker)
    isolation: IsolationSettings = field(default_factory=IsolationSettings)
    grace_s: float = 10.0  # SIGTERM, then SIGKILL after this long
    allowlist: tuple[str, ...] = ()  # exe or comm globs never acted on

    def settings(self) -> dict[str, str]:
        """Each key as the file writes it (its path -> its value, durations as 5m), for the audit line of
        a reload and for `describe`."""
        ns, b, iso = self.namespaces, self.breaker, self.isolation
        return {
            "mode": self.mode, "min_age": _dur(self.min_age_s),
            "namespaces.include": _globs(ns.include), "namespaces.exclude": _globs(ns.exclude),
            "actions.kill_orphans": _bool(self.kill_orphans),
            "actions.isolate_node": _bool(self.isolate_node),
            "actions.ticket.url": _url_shown(self.ticket.url),
            "actions.ticket.headers_file": self.ticket.headers_file,
            "breaker.max_actions": str(b.max_actions), "breaker.window": _dur(b.window_s),
            "breaker.max_per_node": str(b.max_per_node),
            "breaker.max_isolated_nodes_pct": f"{b.max_isolated_nodes_pct:g}",
            "grace": _dur(self.grace_s), "allowlist": _globs(self.allowlist),
            "isolation.how": iso.how, "isolation.unaccounted_bytes": str(iso.unaccounted_bytes),
            "isolation.unaccounted_for": _dur(iso.unaccounted_for_s), "isolation.kubeconfig": iso.kubeconfig,
        }

    def describe(self) -> str:
        """One line: what is in force, e.g. "mode dry-run, min_age 5m, actions kill_orphans, breaker 10
        per 1h (3 per node), isolated nodes at most 10%"."""
        switches = (("kill_orphans", self.kill_orphans), ("isolate_node", self.isolate_node),
                    ("ticket", bool(self.ticket.url)))
        acts = [name for name, on in switches if on]
        b = self.breaker
        return (f"mode {self.mode}, min_age {_dur(self.min_age_s)}, actions {', '.join(acts) or 'none'}, "
                f"breaker {b.max_actions} per {_dur(b.window_s)} ({b.max_per_node} per node), isolated nodes "
                f"at most {b.max_isolated_nodes_pct:g}%")


def changes(old: RemediationPolicy, new: RemediationPolicy) -> list[str]:
    """What a reload changed, one item a key: "mode: off -> dry-run", "breaker.window: 1h -> 30m"."""
    before, after = old.settings(), new.settings()
    return [f"{key}: {_shown(before[key])} -> {_shown(after[key])}"
            for key in after if before[key] != after[key]]


def _dur(seconds: float) -> str:
    from ghostgpu.common.model.durations import format_s

    return format_s(seconds) if seconds else "0s"


def _url_shown(url: str) -> str:
    """The ticket URL without what may be a secret (a query's token; user:password@ is refused by the
    parser, hidden here all the same): it goes to the log and the audit chain."""
    if not url:
        return ""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"[{host}]:{parts.port}" if ":" in host else f"{host}:{parts.port}"
    hidden = "?..." if parts.query or parts.fragment or parts.username or parts.password else ""
    return f"{parts.scheme}://{host}{parts.path}{hidden}"


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _globs(globs: tuple[str, ...]) -> str:
    return "[" + ", ".join(globs) + "]"


def _shown(value: str) -> str:
    return value if value else '""'


# ---- the parser ------------------------------------------------------------------------------------------

_TOP = ("mode", "min_age", "namespaces", "actions", "breaker", "grace", "allowlist", "isolation")
_NAMESPACES = ("include", "exclude")
_ACTIONS = ("kill_orphans", "isolate_node", "ticket")
_TICKET = ("url", "headers_file")
_BREAKER = ("max_actions", "window", "max_per_node", "max_isolated_nodes_pct")
_ISOLATION = ("how", "unaccounted_bytes", "unaccounted_for", "kubeconfig")
# min_age 0 acts on a finding as soon as it opens (a test, a lab): the one duration that may be 0.
_DURATION_OR_0 = replace(FLAG_DURATION, zero_allowed=True)
_SIZE = re.compile(r"(\d+)\s*(B|KiB|MiB|GiB|TiB)?")
_SIZE_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def _kind(value: object) -> str:
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
            dict: "a mapping", type(None): "an empty value"}.get(type(value), type(value).__name__)


class _Section:
    """One mapping of the section: its keys checked against the known ones, and each value read by
    the reader of its kind. Errors name the key's full path (remediation.breaker.window)."""

    def __init__(self, raw: object, path: str, known: tuple[str, ...], where: str, example: str) -> None:
        self.path, self.where = path, where
        if raw is None:  # `remediation:` with nothing under it (YAML): every default
            raw = {}
        if not isinstance(raw, Mapping):
            raise self.error(path, f"expected a mapping like {example}, got {_kind(raw)}")
        for key in raw:
            if key not in known:
                raise self.error(f"{path}.{key}", f"unknown key; known keys: {', '.join(sorted(known))}")
        self.raw: Mapping[Any, Any] = raw

    def error(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.where}: {key}: {problem}")

    def has(self, key: str) -> bool:
        return key in self.raw

    def key(self, key: str) -> str:
        return f"{self.path}.{key}"

    def boolean(self, key: str, default: bool) -> bool:
        if key not in self.raw:
            return default
        value = self.raw[key]
        if not isinstance(value, bool):
            raise self.error(self.key(key), f"{value!r}: expected true or false, got {_kind(value)}")
        return value

    def whole(self, key: str, default: int, least: int, advice: str) -> int:
        if key not in self.raw:
            return default
        value = self.raw[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(self.key(key), f"{value!r}: expected a whole number, got {_kind(value)}")
        if value < least:
            raise self.error(self.key(key), f"{value}: must be {least} or more{advice}")
        return value

    def number(self, key: str, default: float) -> float:
        if key not in self.raw:
            return default
        value = self.raw[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(self.key(key), f"{value!r}: expected a number, got {_kind(value)}")
        return float(value)

    def text(self, key: str, default: str) -> str:
        if key not in self.raw:
            return default
        value = self.raw[key]
        if not isinstance(value, str):
            raise self.error(self.key(key), f"{value!r}: expected a string, got {_kind(value)}")
        return value.strip()

    def duration_s(self, key: str, default: float, example: str, *, zero_ok: bool = False) -> float:
        if key not in self.raw:
            return default
        value = self.raw[key]
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise self.error(self.key(key),
                             f"{value!r}: expected a duration like {example}, got {_kind(value)}")
        try:
            return parse_duration_s(value, self.key(key), _DURATION_OR_0 if zero_ok else FLAG_DURATION)
        except ValueError:
            what = "0 or more" if zero_ok else "above 0"
            raise self.error(self.key(key), f"{value!r}: use a duration like 30s, 5m or 1h (a number "
                                            f"alone is seconds; {what}), e.g. {example}") from None

    def globs(self, key: str, default: tuple[str, ...], example: str) -> tuple[str, ...]:
        if key not in self.raw:
            return default
        value = self.raw[key]
        if not isinstance(value, list):
            raise self.error(self.key(key), f"expected a list of globs like {example}, got {_kind(value)}")
        for i, item in enumerate(value):
            if not isinstance(item, str) or not item.strip():
                raise self.error(f"{self.key(key)}[{i}]", f"{item!r} is not a non-empty string")
        return tuple(item.strip() for item in value)

    def section(self, key: str, known: tuple[str, ...], example: str) -> _Section:
        return _Section(self.raw.get(key), self.key(key), known, self.where, example)


def _mode(s: _Section) -> str:
    if not s.has("mode"):
        return MODE_OFF
    value = s.raw["mode"]
    if not isinstance(value, str):
        raise s.error(s.key("mode"), f"{value!r}: expected one of {', '.join(MODES)}, got {_kind(value)}")
    mode = value.strip().lower()
    if mode not in MODES:
        raise s.error(s.key("mode"), f"{value!r} is not a mode; use {', '.join(MODES)}")
    return mode


def _namespaces(s: _Section) -> NamespaceFilter:
    ns = s.section("namespaces", _NAMESPACES, '{include: ["*"], exclude: ["kube-system"]}')
    default = NamespaceFilter()
    include = ns.globs("include", default.include, '["*"]')
    if not include:
        raise ns.error(ns.key("include"), 'an empty list admits no namespace; write ["*"] for every one '
                                          "(or mode: off to do nothing)")
    return NamespaceFilter(include, ns.globs("exclude", default.exclude, '["kube-system"]'))


def _ticket(actions: _Section) -> TicketAction:
    t = actions.section("ticket", _TICKET, '{url: "https://tickets.example/hook", headers_file: ""}')
    url = t.text("url", "")
    if url:
        # The tickets' own rule (collector/tickets.py): a bad URL fails here, at load, not at the first
        # incident. Imported here: the parser is loaded by every command that builds the collector.
        from ghostgpu.collector.tickets import TicketError, TicketTarget

        try:
            TicketTarget.parse(url)
        except TicketError as exc:
            raise ConfigError(f"{t.where}: {exc}") from None
    return TicketAction(url, t.text("headers_file", ""))


def _breaker(s: _Section) -> Breaker:
    b = s.section("breaker", _BREAKER,
                  "{max_actions: 10, window: 1h, max_per_node: 3, max_isolated_nodes_pct: 10}")
    d = Breaker()
    never = " (to act never, set mode: dry-run)"
    pct = b.number("max_isolated_nodes_pct", d.max_isolated_nodes_pct)
    if not 0 < pct <= 100:
        raise b.error(b.key("max_isolated_nodes_pct"), f"{pct:g}: must be above 0 and at most 100 (to "
                                                       "isolate no node, set actions.isolate_node: false)")
    return Breaker(max_actions=b.whole("max_actions", d.max_actions, 1, never),
                   window_s=b.duration_s("window", d.window_s, "1h"),
                   max_per_node=b.whole("max_per_node", d.max_per_node, 1, never),
                   max_isolated_nodes_pct=pct)


def _size_bytes(s: _Section, key: str, default: int) -> int:
    if not s.has(key):
        return default
    value = s.raw[key]
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise s.error(s.key(key), f"{value}: must be 0 or more (0: no such trigger)")
        return value
    m = _SIZE.fullmatch(value.strip()) if isinstance(value, str) else None
    if m is None:
        raise s.error(s.key(key), f"{value!r}: use bytes (a whole number) or a size like 512MiB or 2GiB "
                                  "(0: no such trigger)")
    return int(m.group(1)) * _SIZE_UNITS[m.group(2) or "B"]


def _isolation(s: _Section) -> IsolationSettings:
    iso = s.section("isolation", _ISOLATION, '{how: taint, unaccounted_bytes: 2GiB, unaccounted_for: 10m}')
    d = IsolationSettings()
    how = iso.text("how", d.how).lower()
    if how not in ISOLATE_HOW:
        raise iso.error(iso.key("how"), f"{how!r}: use {' or '.join(ISOLATE_HOW)}")
    return IsolationSettings(how=how,
                             unaccounted_bytes=_size_bytes(iso, "unaccounted_bytes", d.unaccounted_bytes),
                             unaccounted_for_s=iso.duration_s("unaccounted_for", d.unaccounted_for_s, "10m"),
                             kubeconfig=iso.text("kubeconfig", d.kubeconfig))




def _grace_s(top: _Section, default: float) -> float:
    grace_s = top.duration_s("grace", default, "10s")
    if grace_s > MAX_GRACE_S:
        raise top.error(top.key("grace"), f"{format_s(grace_s)} is over the tracer's cap of "
                                          f"{format_s(MAX_GRACE_S)}; use 60s or less, e.g. 10s")
    return grace_s


def parse_remediation(raw: object, where: str) -> RemediationPolicy:
    """The section as the config file's reader gives it, a mapping (None: the file has none: every
    default).
    `where` names the file as the user gave it ("--config c.yaml"); ConfigError of one line otherwise."""
    top = _Section(raw, SECTION, _TOP, where, "{mode: dry-run, min_age: 5m}")
    actions = top.section("actions", _ACTIONS, '{kill_orphans: true, isolate_node: false, ticket: {url: ""}}')
    d = RemediationPolicy()
    return RemediationPolicy(
        mode=_mode(top),
        min_age_s=top.duration_s("min_age", d.min_age_s, "5m", zero_ok=True),
        namespaces=_namespaces(top),
        kill_orphans=actions.boolean("kill_orphans", d.kill_orphans),
        isolate_node=actions.boolean("isolate_node", d.isolate_node),
        ticket=_ticket(actions),
        breaker=_breaker(top),
        isolation=_isolation(top),
        grace_s=_grace_s(top, d.grace_s),
        allowlist=top.globs("allowlist", d.allowlist, '["nv-hostengine", "/usr/bin/dcgm*"]'),
    )


def remediation_section(doc: Mapping[str, Any], table: str, where: str) -> object:
    """The raw `remediation` section of a whole config document: at the top level, or in the process's
    table (`[collector.remediation]`); None when the file has none. Both at once: ConfigError."""
    inner = doc.get(table)
    in_table = isinstance(inner, Mapping) and SECTION in inner
    if in_table and SECTION in doc:
        raise ConfigError(f"{where}: {SECTION}: set twice (at the top level and in {table}); keep one")
    return inner[SECTION] if in_table and isinstance(inner, Mapping) else doc.get(SECTION)
