"""group_gone and exit_stage: when a thread group holds nothing any more, and whether its exit
tracepoint may still be ahead of it, from /proc/<tgid>/stat alone."""

from __future__ import annotations

import pytest
from ghostgpu.tracer.identity import ALIVE, DEAD, EXITING, PF_EXITING, exit_stage, group_gone


def stat(state: str, threads: int, flags: int = 0x400040, comm: str = "python3") -> str:
    # fields 3.. : state ppid pgrp session tty tpgid FLAGS minflt ... num_threads (20) ...
    return f"42 ({comm}) {state} 1 42 42 0 -1 {flags} 0 0 0 0 0 0 0 0 20 0 {threads} 0 12345\n"


@pytest.mark.parametrize(
    ("text", "gone"),
    [
        ("", True),  # reaped: /proc/<tgid> is gone
        (stat("S", 1), False),
        (stat("R", 1), False),
        (stat("R", 1, flags=0x400040 | PF_EXITING), True),  # last task inside do_exit: fds closing
        (stat("D", 1, flags=PF_EXITING), True),
        (stat("R", 3, flags=PF_EXITING), False),  # the leader exits alone; two threads live on
        (stat("Z", 1), True),  # exited, not reaped yet
        (stat("Z", 3), False),  # zombie leader, threads alive (and maybe holding the GPU)
        (stat("X", 0), True),
        (stat("Z", 1, comm="a) R 1 2 (b"), True),  # comm with ") " and a fake state in it
        ("42 (x) S 1 2", True),  # truncated: treated as gone
        (stat("S", 1, flags=-1), True),  # unparseable flags: treated as gone, never as a holder
    ],
)
def test_group_gone(text: str, gone: bool) -> None:
    assert group_gone(text) is gone


@pytest.mark.parametrize(
    ("text", "stage"),
    [
        ("", DEAD),  # reaped
        (stat("S", 1), ALIVE),
        (stat("R", 1, flags=0x400040 | PF_EXITING), EXITING),  # inside do_exit: not a zombie yet
        (stat("R", 3, flags=PF_EXITING), ALIVE),
        (stat("Z", 1, flags=PF_EXITING), DEAD),  # exit_notify() ran: the exit tracepoint is behind it
        (stat("Z", 3), ALIVE),
        (stat("X", 0), DEAD),
        (stat("S", 1, flags=-1), DEAD),
    ],
)
def test_exit_stage(text: str, stage: str) -> None:
    assert exit_stage(text) == stage
    assert group_gone(text) is (stage != ALIVE)
