"""`ghostgpu up`'s tracer supervisor: the pure rules as tables, then the supervisor over real (tiny
Python) child processes with a stepped clock, so no test waits out a backoff."""

from __future__ import annotations

import random
import signal
import sys
from types import SimpleNamespace

import pytest
from ghostgpu.cli import main as cli
from ghostgpu.cli import up
from ghostgpu.cli.supervise import (
    BACKOFF_MAX_S,
    DEFAULT_MAX_RESTARTS,
    TracerExit,
    TracerSupervisor,
    exit_line,
    exit_words,
    give_up_line,
    gives_up,
    next_streak,
    restart_backoff_s,
    restart_line,
)

from tests.helpers.polling import wait_until


@pytest.mark.parametrize(("returncode", "words"), [
    (0, "exit status 0"),
    (1, "exit status 1"),
    (3, "exit status 3"),
    (255, "exit status 255"),
    (-signal.SIGKILL, "killed by SIGKILL"),
    (-signal.SIGTERM, "killed by SIGTERM"),
    (-signal.SIGSEGV, "killed by SIGSEGV"),
    (-200, "killed by signal 200"),  # no such signal: the number, not a crash
])
def test_exit_words(returncode: int, words: str) -> None:
    assert exit_words(returncode) == words


@pytest.mark.parametrize(("streak", "ran_s", "expected"), [
    (0, 0.1, 1),      # the first exit
    (1, 2.0, 2),      # died again soon after its restart
    (4, 59.9, 5),
    (4, 60.0, 1),     # ran the healthy minute: a new streak
    (9, 3600.0, 1),
])
def test_next_streak(streak: int, ran_s: float, expected: int) -> None:
    assert next_streak(streak, ran_s) == expected


@pytest.mark.parametrize(("streak", "max_restarts", "expected"), [
    (1, 0, True),     # 0: never restart, the first exit ends `up`
    (1, 1, False),
    (2, 1, True),     # the one restart failed
    (5, 5, False),    # four restarts failed, the fifth is still allowed
    (6, 5, True),     # five failed restarts in a row
])
def test_gives_up(streak: int, max_restarts: int, expected: bool) -> None:
    assert gives_up(streak, max_restarts) is expected


@pytest.mark.parametrize(("streak", "jitter_unit", "delay_s"), [
    (1, 0.5, 0.5),    # no jitter at the middle
    (1, 0.0, 0.4),    # -20 %
    (1, 1.0, 0.6),    # +20 %
    (2, 0.5, 1.0),
    (3, 0.5, 2.0),
    (7, 0.5, 30.0),   # 32 s capped
    (7, 0.0, 24.0),   # the cap, less 20 %
    (7, 1.0, 30.0),   # never past the cap
    (1000, 0.5, 30.0),  # a long streak does not overflow
    (0, 0.5, 0.5),    # nonsense streak reads as the first
])
def test_restart_backoff_s(streak: int, jitter_unit: float, delay_s: float) -> None:
    assert restart_backoff_s(streak, jitter_unit) == pytest.approx(delay_s)


def _exit(returncode: int = -9, ran_s: float = 42.0, tail: tuple[str, ...] = ()) -> TracerExit:
    return TracerExit(pid=123, returncode=returncode, ran_s=ran_s, at_unix_s=0.0, stderr_tail=tail)


@pytest.mark.parametrize(("ex", "max_restarts", "line"), [
    (_exit(2, 0.3, ("ghostgpu: --jsonl: directory /x does not exist",)), 5,
     "the tracer failed 5 restarts in a row; giving up (--tracer-max-restarts 5): its last run (pid 123) "
     "ended with exit status 2 after 0s; stderr: ghostgpu: --jsonl: directory /x does not exist"),
    (_exit(-9, 5.0), 1,
     "the tracer failed 1 restart in a row; giving up (--tracer-max-restarts 1): its last run (pid 123) "
     "ended with killed by SIGKILL after 5s; stderr: (no output on stderr)"),
    (_exit(1, 90.0, ("Traceback (most recent call last):", "  x()", "RuntimeError: boom")), 0,
     "the tracer stopped and is not restarted (--tracer-max-restarts 0): its last run (pid 123) ended "
     "with exit status 1 after 1m; stderr: Traceback (most recent call last): | x() | RuntimeError: boom"),
])
def test_give_up_line(ex: TracerExit, max_restarts: int, line: str) -> None:
    assert give_up_line(ex, max_restarts) == line


def test_view_lines() -> None:
    assert exit_line(_exit(), 0.5) == "pid 123 killed by SIGKILL after 42s; restarting it in 0.5s"
    line = restart_line(_exit(), restarts=2, streak=1, max_restarts=5, pid=456)
    assert line.startswith("restarted (killed by SIGKILL at ")
    assert line.endswith("), restart 2 (1 of at most 5 in a row), now pid 456")


class MiddleJitter(random.Random):
    """Jitter at the middle of its range: the schedule's bare delays."""

    def random(self) -> float:
        return 0.5


class SteppedClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _wait_dead(sup: TracerSupervisor) -> None:
    assert sup.child is not None
    sup.child.proc.wait(timeout=30)


FAILING = _python("import sys; print('starting', file=sys.stderr); "
                  "print('ghostgpu: cannot do it', file=sys.stderr); sys.exit(3)")


def test_restarts_with_backoff_then_gives_up_naming_the_last_exit() -> None:
    clock = SteppedClock()
    notices: list[str] = []
    sup = TracerSupervisor(FAILING, {}, max_restarts=2, rng=MiddleJitter(), clock_s=clock)
    sup.on_notice = notices.append
    sup.start()
    try:
        for restart, delay_s in ((1, 0.5), (2, 1.0)):
            _wait_dead(sup)
            assert sup.poll() is None
            assert sup.child is None and sup.due_in_s() == pytest.approx(delay_s)
            assert notices[-1].endswith(f"exit status 3 after 0s; restarting it in {delay_s:.1f}s")
            assert sup.describe().startswith("tracer DOWN (exit status 3 at ")
            clock.now_s += delay_s - 0.01
            assert sup.poll() is None and sup.child is None  # not before its time
            clock.now_s += 0.01
            assert sup.poll() is None and sup.child is not None
            assert sup.restarts == restart
            assert notices[-1].endswith(f"restart {restart} ({restart} of at most 2 in a row), "
                                        f"now pid {sup.child.proc.pid}")
            assert sup.describe().startswith(f"tracer pid {sup.child.proc.pid} (restarted ")
        _wait_dead(sup)
        failed = sup.poll()
        assert failed is not None and failed.startswith(
            "the tracer failed 2 restarts in a row; giving up (--tracer-max-restarts 2): its last run (pid ")
        assert failed.endswith("ended with exit status 3 after 0s; stderr: starting | ghostgpu: cannot do it")
        assert sup.child is None and sup.due_in_s() is None
        assert sup.poll() == failed  # and it stays given up: nothing more is started
        assert sup.child is None
        # The view numbers every child's stderr lines in one sequence.
        assert [n for n, _ in sup.stderr] == list(range(6))
        assert sup.last_line() == "ghostgpu: cannot do it"
    finally:
        sup.stop()


def test_a_child_that_ran_a_healthy_minute_starts_a_new_streak() -> None:
    clock = SteppedClock()
    sup = TracerSupervisor(FAILING, {}, max_restarts=1, rng=MiddleJitter(), clock_s=clock)
    sup.start()
    try:
        for _ in range(3):  # with max 1, three quick exits in a row would have given up at the second
            clock.now_s += 60.0
            _wait_dead(sup)
            assert sup.poll() is None
            assert sup.streak == 1 and sup.due_in_s() == pytest.approx(0.5)
            clock.now_s += 0.5
            assert sup.poll() is None and sup.child is not None
        assert sup.restarts == 3
    finally:
        sup.stop()


def test_max_restarts_0_gives_up_at_the_first_exit() -> None:
    sup = TracerSupervisor(_python("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"), {},
                           max_restarts=0, clock_s=SteppedClock()).start()
    try:
        _wait_dead(sup)
        failed = sup.poll()
        assert failed is not None
        assert failed.startswith("the tracer stopped and is not restarted (--tracer-max-restarts 0)")
        assert "ended with killed by SIGKILL after 0s; stderr: (no output on stderr)" in failed
    finally:
        sup.stop()


def test_stop_ends_the_child_and_every_restart_to_come() -> None:
    clock = SteppedClock()
    sup = TracerSupervisor(_python("import time; time.sleep(600)"), {}, clock_s=clock).start()
    child = sup.child
    assert child is not None
    child.proc.kill()
    child.proc.wait(timeout=30)
    assert sup.poll() is None and sup.due_in_s() is not None  # a restart is pending
    sup.stop()
    clock.now_s += BACKOFF_MAX_S
    assert sup.poll() is None and sup.child is None and sup.due_in_s() is None

    running = TracerSupervisor(_python("import time; time.sleep(600)"), {}, clock_s=clock).start()
    assert running.child is not None
    running.stop()  # SIGTERM: Python's default action ends it
    assert running.child.proc.returncode == -signal.SIGTERM
    assert running.poll() is None and running.restarts == 0


def test_the_child_exit_wakes_the_view() -> None:
    woken: list[bool] = []
    sup = TracerSupervisor(_python("pass"), {}, clock_s=SteppedClock())
    sup.on_change = lambda: woken.append(True)
    sup.start()
    try:
        wait_until(lambda: bool(woken), "the stderr reader's wake-up at the child's exit", timeout_s=30)
        assert sup.child is not None and sup.child.proc.poll() == 0  # reapable by then
    finally:
        sup.stop()


def test_up_flag_default_and_a_negative_value_is_one_line_and_exit_2(
        capsys: pytest.CaptureFixture[str]) -> None:
    parser = cli._build_parser()
    assert parser.parse_args(["up"]).tracer_max_restarts == DEFAULT_MAX_RESTARTS
    assert parser.parse_args(["up", "--tracer-max-restarts", "0"]).tracer_max_restarts == 0
    args = parser.parse_args(["up", "--tracer-max-restarts", "-1", "--listen", "127.0.0.1:0",
                              "--db", ":memory:"])
    assert up.run_up(SimpleNamespace(node_name="n1"), args, install_signals=lambda stop: None) == 2
    err = capsys.readouterr().err
    assert err == "ghostgpu: --tracer-max-restarts -1: must be 0 (never restart) or more\n"
