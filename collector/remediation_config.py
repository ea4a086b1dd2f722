"""The remediation policy in force: the `remediation:` section of the collector's `--config FILE`
(collector/remediation_policy.py), re-read as the security policy is (collector/policy.py).

    config = RemediationConfig("/etc/ghostgpu/collector.yaml")   # ConfigError (one line) for a bad section
    config()                                                    # the RemediationPolicy in force
    config.on_change.append(lambda old, new: ...)               # the engine audits remediation.config
    config.maybe_reload()                                       # once a second, from the collector's loop
    config.reload()                                             # SIGHUP

The file is looked at once a second (ghostgpu/common/system/filewatch.py: a rewrite, a rename over
it, a ConfigMap's symlink swap) and re-read on SIGHUP. Only the section is taken from a re-read: the
collector's other keys are read at start only, as ever. A good section that differs from the one in
force replaces it, logs one line naming what changed ("mode: off -> dry-run") and calls each
`on_change(old, new)`; a bad one (or a file that cannot be read) keeps the old policy, logs one line
of at most RELOAD_LINE_MAX characters and calls each `on_refused(line)`, once per change of the
file, however many looks or SIGHUPs see it. At start a bad section is fatal: better no collector
than one that acts on a policy nobody wrote.

The file is opened without blocking and read only when it is a regular file: a re-read runs on the
collector's event loop, which a FIFO without a writer would hold forever.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from ghostgpu.collector.remediation_policy import (
    RemediationPolicy,
    changes,
    parse_remediation,
    remediation_section,
)

from ghostgpu.common.model.names import one_line
from ghostgpu.common.system.configfile import ConfigError, is_yaml_name, parse_document, read_config_text
from ghostgpu.common.system.filewatch import FileWatch

log = logging.getLogger(__name__)

RELOAD_LINE_MAX = 250  # a reload's log line (and its audit detail), whatever the file holds
TABLE = "collector"  # the collector's table of the config file; `remediation` may sit in it or at the top
_KEPT = "; the old remediation policy stays in force"
# --config must be a regular file: the loop re-reads it (collector/main.py's tick) and must never block
_REGULAR_ONLY = ("the collector re-reads its remediation section when it changes: point --config at the "
                 "file itself")

ChangeHook = Callable[[RemediationPolicy, RemediationPolicy], None]
RefusedHook = Callable[[str], None]


def load_remediation(path: str, where: str | None = None) -> RemediationPolicy:
    """The policy the file at `path` sets (TOML, or YAML by its name); the defaults (mode off) when it
    has no `remediation` section. ConfigError (one line) for anything wrong with the file or section,
    or with the ticket headers file it names (collector/tickets.py reads it for each ticket)."""
    where = where or f"--config {path}"
    doc = parse_document(read_config_text(path, where=where, regular_only=_REGULAR_ONLY), where=where,
                         yaml=is_yaml_name(path))
    policy = parse_remediation(remediation_section(doc, TABLE, where), where)
    if policy.ticket.url and policy.ticket.headers_file:
        from ghostgpu.collector.tickets import TicketError, read_headers

        try:  # read again for each ticket (a rotated token); checked here so a bad one fails at load
            read_headers(policy.ticket.headers_file)
        except TicketError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    return policy


class RemediationConfig:
    """The remediation policy in force (call it: the zero-argument callable the engine takes),
    reloaded when its file changes or on SIGHUP. With no file: the defaults, for good."""

    def __init__(self, path: str | None, policy: RemediationPolicy | None = None) -> None:
        """`policy`: the one in force at start when the caller has it already (a test); else the file's,
        read now (ConfigError propagates: a bad section at start is fatal)."""
        self.path = path or None
        self.where = f"--config {path}"
        self.on_change: list[ChangeHook] = []
        self.on_refused: list[RefusedHook] = []
        self._lock = threading.Lock()
        self._watch = FileWatch((self.path,))  # taken before the first read: a change while reading is seen
        self._refused: tuple[object, str] | None = None  # (signature, line) of the last refused reload
        if policy is not None:
            self.policy = policy
        else:
            self.policy = load_remediation(self.path, self.where) if self.path else RemediationPolicy()

    def __call__(self) -> RemediationPolicy:
        return self.policy

    def maybe_reload(self) -> bool:
        """Re-read the file when it changed since the last look; True when a new policy is in force."""
        if not self.path or not self._watch.poll():
            return False
        return self.reload()

    def reload(self) -> bool:
        """Re-read the file now (SIGHUP); True when a new policy is in force."""
        if not self.path:
            log.info("no --config file: remediation stays off")
            return False
        with self._lock:
            self._watch.poll()  # taken before reading: a change while reading is seen next time
            try:
                new = load_remediation(self.path, self.where)
            except Exception as exc:  # of any kind (MemoryError, RecursionError too): the old policy stays
                why = str(exc) if isinstance(exc, ConfigError) else (
                    f"{self.where}: cannot load its remediation section ({type(exc).__name__}: {exc})")
                line = one_line(why, RELOAD_LINE_MAX - len(_KEPT)) + _KEPT
                if (self._watch.signature, line) == self._refused:
                    return False  # the same file refused the same way (a SIGHUP after the look): said once
                self._refused = (self._watch.signature, line)
                log.error("%s", line)
                _call(self.on_refused, line)
                return False
            old, self._refused = self.policy, None
            if new == old:
                log.debug("%s: re-read, remediation unchanged", self.where)
                return False
            self.policy = new
        what = "; ".join(changes(old, new))
        line = one_line(f"{self.where}: remediation reloaded: {what}", RELOAD_LINE_MAX)
        log.warning("%s", line)
        _call(self.on_change, old, new)
        return True


def _call(hooks: Sequence[Callable[..., None]], *args: object) -> None:
    """Each hook with `args`; one that raises is logged and the others still run."""
    for hook in list(hooks):
        try:
            hook(*args)
        except Exception:
            log.exception("remediation config: a reload hook failed")
