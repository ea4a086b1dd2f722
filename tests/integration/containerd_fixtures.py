"""Fixtures for tests against a real containerd (CRI), imported by tests/integration/conftest.py.

One containerd serves the whole session (about 0.5 s to start and import the images): tests
create their own pods and remove them. A test that stops containerd gets it back running for the
next test from the function-scoped `containerd` fixture.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.containerd import Containerd, missing


@pytest.fixture(scope="session")
def containerd_session() -> Iterator[Containerd]:
    reason = missing()
    if reason:
        pytest.skip(reason)
    with Containerd() as c:
        yield c


@pytest.fixture
def containerd(containerd_session: Containerd) -> Containerd:
    """The session's containerd, running (started again if an earlier test stopped it)."""
    return containerd_session.start()
