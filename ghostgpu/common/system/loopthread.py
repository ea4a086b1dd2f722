"""An asyncio loop of its own, in a thread of its own, serving one accept coroutine until stopped.

The HTTP ports (ghostgpu/common/web/httpserve.py) accept on a listening socket from such a loop, so
that a flood of connections waits on neither the collector's gRPC loop nor a thread per connection.
Stopping (`loop.stop()` from any thread through `call_soon_threadsafe`) cancels the accept task and
every connection's task, gives them 2 s to finish, then closes the listening socket and the loop.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Coroutine
from typing import Any

STOP_GRACE_S = 2.0  # tasks cancelled at stop get this long to run their cleanup


def serve_until_stopped(loop: asyncio.AbstractEventLoop, accept: Callable[[], Coroutine[Any, Any, None]],
                        listening: socket.socket) -> None:
    """The thread's body: run `accept()` on `loop` until the loop is stopped, then wind it down."""
    asyncio.set_event_loop(loop)
    accepting = loop.create_task(accept())
    try:
        loop.run_forever()
    finally:
        accepting.cancel()
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=STOP_GRACE_S))
        loop.run_until_complete(asyncio.sleep(0))  # let aborted transports run their close callbacks
        listening.close()
        loop.close()
