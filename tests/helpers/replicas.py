"""Collector replicas in the test process, sharing one PostgreSQL database (tests/helpers/postgres.py).

    with replica(tmp_path, dsn, "a", settings={"lease_ttl_s": 2}, trace_timing=FAST) as a: ...

`settings` are CollectorConfig fields; the other keywords are the Collector's collaborators (stand-in
resolvers, trace timings). With `listening_s`, the replica is yielded once its LISTEN connection
(collector/notify.py) listens, so a test's first change on another replica is heard.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ghostgpu.collector.config import CollectorConfig
from ghostgpu.collector.main import Collector


@contextlib.contextmanager
def replica(tmp_path: Path, dsn: str, name: str, *, settings: dict[str, Any] | None = None,
            listening_s: float | None = None, **collaborators: Any) -> Iterator[Collector]:
    config = CollectorConfig(listen=("127.0.0.1:0",), db_path=str(tmp_path / f"{name}-unused.db"),
                             store_url=dsn, replica_id=name, **(settings or {}))
    c = Collector(config, **collaborators).start()
    try:
        if listening_s is not None:
            assert c.notifier.wait_listening(listening_s), f"replica {name} never listened"
        yield c
    finally:
        c.stop(grace_s=0.5)


# The one container of the trainer_runtime fixture's pod (tests/integration/conftest.py).
TRAINER_CID = "ab" * 32
