"""Authorization: who may call what (docs/SECURITY.md, "Authorization").

The policy file (YAML, `--policy FILE`) maps subjects to roles:

    rules:
      - role: viewer
        subjects: [group:ops, uid:1000]
      - role: trace-operator
        subjects: [user:alice]
        namespaces: [ml-*, research]     # globs; default ["*"]; trace-operator only
        max_duration: 10m                # default: the collector's own limit; trace-operator only
      - role: tracer
        subjects: ["node:*"]             # a node certificate speaks only for its own node
      - role: remediator
        subjects: [user:oncall]          # `ghostgpu remediate`: by hand, pause, resume, the mode

Subjects: `user:NAME` (a user certificate), `node:NAME` (a tracer certificate), `group:NAME` (a
certificate's O), `uid:N` (the unix socket, or a loopback peer), and `anonymous` (plaintext with
--insecure). NAME (and N) may be a glob. A principal holds the roles of every rule naming one of
its subjects; admin may do everything. Which role each RPC needs is METHOD_ROLES, the one table.

With no file, Policy.default(): uid 0 and the collector's own uid are admin, `node:*` is tracer
(the node check at Hello keeps each to its own node), nobody else anything. PolicyWatcher reloads
the file when it changes (stat, once a second) or on SIGHUP; a bad file keeps the old policy.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

import yaml

from ghostgpu.common.model.durations import parse_duration_s
from ghostgpu.common.model.names import one_line
from ghostgpu.common.system import safe_yaml
from ghostgpu.common.system.filewatch import FileWatch
from ghostgpu.common.transport.principal import Principal

log = logging.getLogger(__name__)

VIEWER, TRACER, TRACE_OPERATOR, ADMIN = "viewer", "tracer", "trace-operator", "admin"
REMEDIATOR = "remediator"  # acts on findings (docs/REMEDIATION.md): kills, pauses, sets the mode
ROLES = (VIEWER, TRACER, TRACE_OPERATOR, REMEDIATOR, ADMIN)
RULE_KEYS = ("role", "subjects", "namespaces", "max_duration")
_QUERY = "/ghostgpu.v1.Query/"
# The role each RPC needs (any one of them; admin always will do). A method not here is admin only,
# so a new RPC is closed until someone decides who may call it (tests/unit/test_policy.py checks
# that every RPC of the API is listed).
METHOD_ROLES: dict[str, tuple[str, ...]] = {
    "/ghostgpu.v1.NodeStream/Connect": (TRACER,),
    **{_QUERY + m: (VIEWER,) for m in ("ListConsumers", "WatchFindings", "ListFindings", "NodeStatus",
                                       "ListEvents", "ListFaults")},
    _QUERY + "ListTraces": (VIEWER, TRACE_OPERATOR),
    _QUERY + "WatchTrace": (VIEWER, TRACE_OPERATOR),
    _QUERY + "StartTrace": (TRACE_OPERATOR,),
    _QUERY + "StopTrace": (TRACE_OPERATOR,),
    _QUERY + "ListAudit": (ADMIN,),
    _QUERY + "Remediate": (REMEDIATOR,),
    _QUERY + "RemediationControl": (REMEDIATOR,),
}
_SUBJECT = re.compile(r"(user|node|group):(\S.*)|uid:([0-9*?\[\]!-]+)|anonymous")
_SUBJECT_HELP = "write user:NAME, node:NAME, group:NAME, uid:N or anonymous (NAME may be a glob)"


class PolicyError(ValueError):
    """One line: `policy FILE: KEY: what is wrong; what to do`."""


@dataclass(frozen=True)
class Rule:
    index: int  # its place in the file's rules list, for messages
    role: str
    subjects: tuple[str, ...]
    namespaces: tuple[str, ...] = ("*",)
    max_duration_s: float | None = None  # None: no limit of the rule's own
    max_duration: str = ""  # as written

    def matches(self, principal: Principal) -> bool:
        return any(fnmatchcase(s, pattern) for pattern in self.subjects for s in principal.subjects())


def format_duration(seconds: float) -> str:
    """10m, 1h, 90s, 1.5s: how limits and requests are named in a denial."""
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def _strings(value: object, where: str, example: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise PolicyError(f"{where}: use a non-empty list, e.g. [{example}]")
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item.strip():
            raise PolicyError(f"{where}[{i}]: {item!r} is not a non-empty string")
    return tuple(value)


def _rule(i: int, raw: object, where: str) -> Rule:
    if not isinstance(raw, dict):
        raise PolicyError(f"{where}: use a mapping with keys {', '.join(RULE_KEYS)}")
    for key in raw:
        if key not in RULE_KEYS:
            raise PolicyError(f"{where}.{key}: unknown key; use {', '.join(RULE_KEYS)}")
    role = raw.get("role")
    if role not in ROLES:
        what = "is missing" if role is None else f"{role!r} is not a role"
        raise PolicyError(f"{where}.role: {what}; use one of {', '.join(ROLES)}")
    if "subjects" not in raw:
        raise PolicyError(f"{where}.subjects: is missing; list who has role {role}, e.g. [user:alice]")
    subjects = _strings(raw["subjects"], f"{where}.subjects", "user:alice, group:ops")
    for j, subject in enumerate(subjects):
        if not _SUBJECT.fullmatch(subject):
            raise PolicyError(f"{where}.subjects[{j}]: {subject!r} is not a subject; {_SUBJECT_HELP}")
    for key in ("namespaces", "max_duration"):
        if key in raw and role != TRACE_OPERATOR:
            raise PolicyError(f"{where}.{key}: only a trace-operator rule takes {key}; remove it "
                              f"from this {role} rule")
    namespaces: tuple[str, ...] = ("*",)
    if "namespaces" in raw:
        namespaces = _strings(raw["namespaces"], f"{where}.namespaces", "ml-*, research")
    max_s, max_text = None, ""
    if "max_duration" in raw:
        max_text = str(raw["max_duration"])
        try:
            max_s = parse_duration_s(raw["max_duration"], f"{where}.max_duration")
        except ValueError as e:
            raise PolicyError(str(e)) from None
    return Rule(i, role, subjects, namespaces, max_s, max_text)


class Policy:
    def __init__(self, rules: Sequence[Rule], source: str) -> None:
        self.rules = tuple(rules)
        self.source = source

    @classmethod
    def parse(cls, text: str, source: str) -> Policy:
        """PolicyError naming `source`, the key and what to do, for anything but a valid policy."""
        try:
            return cls(cls._rules(text), source)
        except PolicyError as e:
            raise PolicyError(f"policy {source}: {e}") from None

    @staticmethod
    def _rules(text: str) -> list[Rule]:
        try:
            # No anchors, aliases or duplicate keys (ghostgpu/common/system/safe_yaml.py).
            doc = safe_yaml.load(text)
        except safe_yaml.YamlRefused as e:
            raise PolicyError(str(e)) from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f"line {mark.line + 1} column {mark.column + 1}: " if mark is not None else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise PolicyError(f"{at}not valid YAML ({problem})") from None
        if not isinstance(doc, dict):
            raise PolicyError("empty or not a mapping; write `rules:` and a list of "
                              "{role, subjects, namespaces, max_duration}")
        for key in doc:
            if key != "rules":
                raise PolicyError(f"{key}: unknown key; the file holds only `rules:`")
        rules = doc.get("rules")
        if not isinstance(rules, list):
            raise PolicyError("rules: use a list of {role, subjects, namespaces, max_duration} "
                              "(`rules: []` allows nobody anything)")
        return [_rule(i, raw, f"rules[{i}]") for i, raw in enumerate(rules)]

    @classmethod
    def load(cls, path: str) -> Policy:
        try:
            text = safe_yaml.read_capped(path)  # 64 KiB at most
        except safe_yaml.YamlRefused as e:
            raise PolicyError(f"policy {path}: {e}") from None
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
            raise PolicyError(f"policy {path}: cannot read it ({why}); pass a readable YAML file "
                              "with --policy") from None
        return cls.parse(text, path)

    @classmethod
    def default(cls, own_uid: int | None = None) -> Policy:
        """No --policy: root and the collector's own user are admin; node certificates are tracers."""
        uid = os.getuid() if own_uid is None else own_uid
        admins = tuple(dict.fromkeys(("uid:0", f"uid:{uid}")))
        return cls([Rule(0, ADMIN, admins), Rule(1, TRACER, ("node:*",))], "(built in: no --policy)")

    def roles(self, principal: Principal) -> frozenset[str]:
        return frozenset(r.role for r in self.rules if r.matches(principal))

    def check(self, principal: Principal, method: str) -> str | None:
        """None when `principal` may call `method`; else the missing role, e.g. "role trace-operator"."""
        roles = self.roles(principal)
        needed = METHOD_ROLES.get(method, (ADMIN,))
        if ADMIN in roles or roles.intersection(needed):
            return None
        return "role " + " or ".join(needed)

    def denial(self, principal: Principal, method: str) -> str | None:
        """None, or the PERMISSION_DENIED line: the method, the subject and the missing role."""
        missing = self.check(principal, method)
        if missing is None:
            return None
        return (f"{method} denied to {principal.subject}: it needs {missing} (policy {self.source}); "
                "ask an admin to grant it")

    def trace_denial(self, principal: Principal, namespace: str | None, duration_s: float) -> str | None:
        """None when `principal` may trace `namespace` for `duration_s`; else why not, naming the rule's
        limit. A trace with no namespace (by node or pid) needs admin or namespaces ["*"]."""
        if ADMIN in self.roles(principal):
            return None
        who = principal.subject
        rules = [r for r in self.rules if r.role == TRACE_OPERATOR and r.matches(principal)]
        if not rules:
            return f"{who} may not start or stop trace sessions: it needs role trace-operator"
        if namespace:
            fit = [r for r in rules if any(fnmatchcase(namespace, g) for g in r.namespaces)]
        else:
            fit = [r for r in rules if "*" in r.namespaces]
        if not fit:
            if not namespace:
                return (f"a trace without a namespace (by node or pid) needs role admin or a trace-operator "
                        f"rule with namespaces [\"*\"]; {who} has neither")
            globs = ", ".join(dict.fromkeys(g for r in rules for g in r.namespaces))
            return f"namespace {namespace!r} is outside {who}'s trace namespaces ({globs})"
        if any(r.max_duration_s is None or duration_s <= r.max_duration_s + 1e-9 for r in fit):
            return None
        best = max(fit, key=lambda r: r.max_duration_s or 0.0)
        where = f"namespace {namespace!r}" if namespace else "a trace without a namespace"
        return (f"{format_duration(duration_s)} is over {who}'s limit of {best.max_duration} for {where} "
                f"(policy {self.source}: rules[{best.index}].max_duration); ask for a shorter trace")


# A refused reload is one log line (the logger's "ghostgpu: ghostgpu.collector.policy: " before it
# stays under 300 characters) and the same line in its audit record, whatever the file holds.
RELOAD_LINE_MAX = 250
_KEPT = "; the old policy stays in force"


class PolicyWatcher:
    """The policy in force, reloaded when its file changes (maybe_reload, once a second from the
    collector's loop) or on SIGHUP (reload). A bad file (or any error reading it) logs one line of at
    most RELOAD_LINE_MAX characters, reports "policy.reload_error" through on_event, once per change
    of the file, and keeps the old policy; a good one reports "policy.reload"."""

    def __init__(self, path: str | None, on_event: Callable[[str, str], None] | None = None,
                 own_uid: int | None = None) -> None:
        self.path = path
        self.on_event = on_event
        self._lock = threading.Lock()
        self._watch = FileWatch((path,))  # follows symlinks: a ConfigMap's ..data swap changes the inode
        self._refused: tuple[object, str] | None = None  # (signature, line) of the last refused reload
        # At start a bad file is fatal (PolicyError propagates): better no collector than a wrong one.
        self.policy = Policy.load(path) if path else Policy.default(own_uid)

    def maybe_reload(self) -> bool:
        """Reload when the file changed since the last look (filewatch.py); True if reloaded."""
        if not self.path:
            return False
        if not self._watch.poll():
            return False
        return self.reload()

    def reload(self) -> bool:
        """Read the file again (SIGHUP); True when a new policy is in force."""
        if not self.path:
            log.info("no --policy file: the built-in policy stays")
            return False
        with self._lock:
            self._watch.poll()  # taken before reading: a change while reading is seen next time
            try:
                new = Policy.load(self.path)
            except Exception as e:  # of any kind (MemoryError, RecursionError too): the old policy stays
                why = str(e) if isinstance(e, PolicyError) else (
                    f"policy {self.path}: cannot load it ({type(e).__name__}: {e})")
                line = one_line(why, RELOAD_LINE_MAX - len(_KEPT)) + _KEPT
                if (self._watch.signature, line) == self._refused:
                    return False  # the same file refused the same way (SIGHUP after the look): said once
                self._refused = (self._watch.signature, line)
                log.error("%s", line)
                self._emit("policy.reload_error", line)
                return False
            self.policy, self._refused = new, None
        line = f"policy {self.path}: reloaded, {len(new.rules)} rules in force"
        log.warning("%s", line)
        self._emit("policy.reload", line)
        return True

    def _emit(self, action: str, detail: str) -> None:
        if self.on_event is not None:
            try:
                self.on_event(action, detail)
            except Exception:
                log.exception("policy: reporting %s failed", action)
