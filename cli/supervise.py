"""`ghostgpu up`'s tracer child and its supervisor: restart with jittered backoff, and give up after N
failed restarts in a row with the reason.

A tracer dies for reasons a restart cures (the OOM killer, an operator's `kill -9` of a wedged
NVML call, a crash in a native library) and for reasons it does not (a --jsonl path in a directory
that does not exist). The first kind must not take the collector and the live view down with it;
the second must end `up` with its reason instead of looping for ever. So every exit not caused by
`up` itself is restarted after a delay that doubles with each quick failure (BACKOFF_MIN_S to
BACKOFF_MAX_S, ±BACKOFF_JITTER, so a crash loop neither burns a core nor keeps step with anything
periodic on the node); a child that ran HEALTHY_RUN_S starts a new streak; and the exit that follows
`max_restarts` failed restarts in a row ends `up` with one line naming the exit and its stderr.

The rules are pure functions (exit_words, next_streak, gives_up, restart_backoff_s and the lines),
table-tested in tests/unit/test_supervise.py; TracerSupervisor only applies them to real processes.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ghostgpu.cli.view import age

BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 30.0
BACKOFF_JITTER = 0.2  # ±20 % of the delay
HEALTHY_RUN_S = 60.0  # a child that ran this long was working: its exit starts a new streak
DEFAULT_MAX_RESTARTS = 5
TRACER_STOP_S = 10.0
STDERR_TAIL_LINES = 3  # of the last child's stderr in the give-up line: a traceback's last frame and error

log = logging.getLogger("ghostgpu.up")


def exit_words(returncode: int) -> str:
    """Popen's returncode as words: "killed by SIGKILL", "exit status 3"."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def next_streak(streak: int, ran_s: float, healthy_run_s: float = HEALTHY_RUN_S) -> int:
    """Exits in a row counting this one, which came after `ran_s` of running: a child that ran
    healthy_run_s had recovered, so its exit is the first of a new streak."""
    return 1 if ran_s >= healthy_run_s else streak + 1


def gives_up(streak: int, max_restarts: int) -> bool:
    """A streak of k exits is k - 1 failed restarts; once max_restarts of them failed, stop."""
    return streak > max_restarts


def restart_backoff_s(streak: int, jitter_unit: float, min_s: float = BACKOFF_MIN_S,
                      max_s: float = BACKOFF_MAX_S, jitter: float = BACKOFF_JITTER) -> float:
    """Seconds to wait before restarting after the `streak`-th exit in a row: min_s doubling per exit
    up to max_s, scaled by 1 ± jitter (jitter_unit 0 -> -jitter, 1 -> +jitter), never over max_s."""
    doublings = min(max(streak, 1) - 1, 32)  # 2**32 * min_s is far past any max_s: no float overflow
    base_s = min(max_s, min_s * 2 ** doublings)
    return min(max_s, base_s * (1 + jitter * (2 * jitter_unit - 1)))


@dataclass(frozen=True)
class TracerExit:
    """One tracer child's end, as the view and the give-up line tell it."""

    pid: int
    returncode: int
    ran_s: float
    at_unix_s: float
    stderr_tail: tuple[str, ...]

    @property
    def words(self) -> str:
        return exit_words(self.returncode)


def clock(unix_s: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(unix_s))


def exit_line(ex: TracerExit, delay_s: float) -> str:
    """The view's line when a tracer dies and a restart is scheduled."""
    return f"pid {ex.pid} {ex.words} after {age(ex.ran_s)}; restarting it in {delay_s:.1f}s"


def restart_line(ex: TracerExit, restarts: int, streak: int, max_restarts: int, pid: int) -> str:
    """The view's line when the successor starts: why, which restart, how close to giving up."""
    return (f"restarted ({ex.words} at {clock(ex.at_unix_s)}), restart {restarts} "
            f"({streak} of at most {max_restarts} in a row), now pid {pid}")


def stderr_text(tail: Sequence[str]) -> str:
    return " | ".join(line.strip() for line in tail) if tail else "(no output on stderr)"


def give_up_line(ex: TracerExit, max_restarts: int) -> str:
    """The one line `up` exits 1 with."""
    flag = f"--tracer-max-restarts {max_restarts}"
    if max_restarts == 0:
        head = f"the tracer stopped and is not restarted ({flag})"
    else:
        s = "" if max_restarts == 1 else "s"
        head = f"the tracer failed {max_restarts} restart{s} in a row; giving up ({flag})"
    return (f"{head}: its last run (pid {ex.pid}) ended with {ex.words} after {age(ex.ran_s)}; "
            f"stderr: {stderr_text(ex.stderr_tail)}")


class TracerChild:
    """The tracer subprocess; keeps the tail of its stderr for the view and for its obituary."""

    def __init__(self, cmd: list[str], env: dict[str, str], on_line: Callable[[str], None] | None = None,
                 on_eof: Callable[[], None] | None = None) -> None:
        self.started_s = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, env=env, text=True, errors="replace")
        self.lines: collections.deque[str] = collections.deque(maxlen=50)
        self._on_line, self._on_eof = on_line, on_eof
        self._reader = threading.Thread(target=self._read, name="ghostgpu-tracer-stderr", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if line.strip():
                self.lines.append(line.rstrip())
                if self._on_line is not None:
                    self._on_line(line.rstrip())
        if self._on_eof is not None:
            # The pipe closes as the child dies, a moment before it can be reaped: wait for that, then
            # wake the view so it restarts the tracer now rather than at its next redraw.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=1.0)
            self._on_eof()

    def join_reader(self) -> None:
        self._reader.join(timeout=1.0)  # an exited tracer's last words may still be in the pipe

    def stop(self) -> None:
        """SIGTERM (the tracer detaches its BPF programs), then SIGKILL past TRACER_STOP_S."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=TRACER_STOP_S)
            except subprocess.TimeoutExpired:
                log.warning("tracer %d did not stop within %g s of SIGTERM; killing it", self.proc.pid,
                            TRACER_STOP_S)
                self.proc.kill()
                self.proc.wait()
        self.join_reader()


class TracerSupervisor:
    """Keeps one tracer child running. The view's loop calls poll(); nothing here runs on its own
    thread, so a restart can never race `up`'s shutdown: stop() ends the child and all restarts."""

    def __init__(self, cmd: list[str], env: dict[str, str], max_restarts: int = DEFAULT_MAX_RESTARTS,
                 rng: random.Random | None = None, clock_s: Callable[[], float] = time.monotonic) -> None:
        self.cmd, self.env, self.max_restarts = cmd, env, max_restarts
        self.rng = rng or random.Random()
        self.clock_s = clock_s  # monotonic seconds; the unit tests step it instead of waiting out backoffs
        # Every child's stderr, numbered across restarts so the view can tell new lines from shown ones.
        self.stderr: collections.deque[tuple[int, str]] = collections.deque(maxlen=200)
        self._numbers = itertools.count()
        self.child: TracerChild | None = None
        self.streak = 0  # exits in a row, each after less than HEALTHY_RUN_S of running
        self.restarts = 0  # since `up` started
        self.last_exit: TracerExit | None = None
        self.restart_due_s: float | None = None  # monotonic; set while a restart waits out its backoff
        self.gave_up: str | None = None
        self._stopped = False
        self.on_change: Callable[[], None] = lambda: None  # the view's wake-up
        self.on_notice: Callable[[str], None] = lambda text: None  # a line for the view's recent events

    def start(self) -> TracerSupervisor:
        self.child = self._spawn()
        return self

    def _spawn(self) -> TracerChild:
        child = TracerChild(self.cmd, self.env, on_line=self._line, on_eof=lambda: self.on_change())
        child.started_s = self.clock_s()
        return child

    def _line(self, line: str) -> None:
        self.stderr.append((next(self._numbers), line))

    def poll(self) -> str | None:
        """Reap an exited child and start its successor once its backoff is over. Returns the
        give-up line once restarts are spent (then nothing runs), else None."""
        now = self.clock_s()
        child = self.child
        if self._stopped or self.gave_up is not None:
            return self.gave_up
        if child is not None and child.proc.poll() is not None:
            self._reap(child, now)
        if self.child is None and self.restart_due_s is not None and now >= self.restart_due_s:
            self._restart()
        return self.gave_up

    def _reap(self, child: TracerChild, now_s: float) -> None:
        child.join_reader()
        self.child = None
        ran_s = now_s - child.started_s
        ex = TracerExit(pid=child.proc.pid, returncode=child.proc.returncode, ran_s=ran_s,
                        at_unix_s=time.time(), stderr_tail=tuple(child.lines)[-STDERR_TAIL_LINES:])
        self.last_exit = ex
        self.streak = next_streak(self.streak, ran_s)
        if gives_up(self.streak, self.max_restarts):
            self.gave_up = give_up_line(ex, self.max_restarts)
            return
        delay_s = restart_backoff_s(self.streak, self.rng.random())
        self.restart_due_s = now_s + delay_s
        log.info("tracer %s", exit_line(ex, delay_s))
        self.on_notice(exit_line(ex, delay_s))

    def _restart(self) -> None:
        assert self.last_exit is not None
        self.restart_due_s = None
        self.restarts += 1
        child = self.child = self._spawn()
        line = restart_line(self.last_exit, self.restarts, self.streak, self.max_restarts, child.proc.pid)
        log.info("tracer %s", line)
        self.on_notice(line)

    def due_in_s(self) -> float | None:
        """Seconds until a pending restart (the view wakes for it), None when none is pending."""
        if self.restart_due_s is None or self._stopped:
            return None
        return max(0.0, self.restart_due_s - self.clock_s())

    def last_line(self) -> str:
        child = self.child
        if child is not None and child.proc.poll() is not None:
            child.join_reader()  # its last words may still be in the pipe
        return self.stderr[-1][1] if self.stderr else "(no output on stderr)"

    def describe(self) -> str:
        """The tracer's part of the view's top line."""
        ex = self.last_exit
        if self.child is not None:
            text = f"tracer pid {self.child.proc.pid}"
            if self.restarts and ex is not None:
                times = "once" if self.restarts == 1 else f"{self.restarts} times"
                text += f" (restarted {times}, last: {ex.words} at {clock(ex.at_unix_s)})"
            return text
        if ex is None:
            return "tracer stopped"
        due_s = self.due_in_s()
        if due_s is not None:
            return f"tracer DOWN ({ex.words} at {clock(ex.at_unix_s)}), restarting in {age(due_s)}"
        times = "once" if self.restarts == 1 else f"{self.restarts} times"
        return f"tracer stopped ({ex.words} at {clock(ex.at_unix_s)}; restarted {times})"

    def stop(self) -> None:
        """End the child (if any) and every restart still to come."""
        self._stopped = True
        self.restart_due_s = None
        if self.child is not None:
            self.child.stop()
