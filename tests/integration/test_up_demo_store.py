"""`ghostgpu up --demo` keeps its records in a store of its own: a demo, then a plain `up`, both without
--db, and the second sees none of the demo's history.

Both run in a mount namespace of their own whose /var/lib is a temp dir, so the default store
(/var/lib/ghostgpu/collector.db) is really the one written, but there and never in the host's.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.integration.test_up import (
    REPO,
    _demo_workdirs,
    _environment,
    _prefixes,
    _processes_with,
    _up,
    assert_demo_gone,
    demo_guard,
    needs_bpf,
)

__all__ = ["demo_guard"]  # the fixture, found by pytest under this name


def _private_var_lib(var_lib: Path, cmd: list[str]) -> list[str]:
    """cmd in a mount namespace of its own whose /var/lib is var_lib: the default store
    (/var/lib/ghostgpu/collector.db) lands there, never in the host's."""
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
            'mount --bind "$0" /var/lib && exec "$@"', str(var_lib), *cmd]


def _store_bytes(db: Path) -> bytes:
    """The SQLite file and its WAL, as bytes: a container ID is in them in any column or blob."""
    return b"".join(p.read_bytes() for p in db.parent.glob(f"{db.name}*"))


@needs_bpf
def test_demo_keeps_its_records_in_a_store_of_its_own(tmp_path: Path, root_bpf: None,
                                                      demo_guard: set[str]) -> None:
    """`up --demo` then a plain `up`, both without --db: the second sees none of the demo's history."""
    var_lib = tmp_path / "var-lib"
    var_lib.mkdir()
    demo_dir, plain_dir = tmp_path / "demo", tmp_path / "plain"
    demo_dir.mkdir()
    plain_dir.mkdir()
    done = subprocess.run(_private_var_lib(var_lib, _up(demo_dir, "--demo", "--once", store=False)),
                          env=_environment(), capture_output=True, text=True, timeout=180, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    rows = {line.split()[4]: line.split() for line in out.splitlines() if line.startswith("up-node ")}
    assert rows["ghostgpu-demo/hidden-trainer/trainer"][5] == "hidden", out
    store = re.search(r"^ghostgpu up: collector \S+ \(db (/\S+/ghostgpu-demo-\w+/collector\.db), the demo's "
                      r"own, removed on exit\)", out, re.M)
    assert store, out
    assert not Path(store.group(1)).parent.exists()  # removed with the demo's processes
    assert sorted(var_lib.rglob("*")) == []  # the default store was never touched
    prefixes = _prefixes(out)
    assert_demo_gone(prefixes)
    assert _demo_workdirs() <= demo_guard

    done = subprocess.run(_private_var_lib(var_lib, _up(plain_dir, "--once", store=False)),
                          env=_environment(), capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "(db /var/lib/ghostgpu/collector.db)" in out
    default_store = var_lib / "ghostgpu" / "collector.db"
    assert default_store.exists()  # the plain run did write the default store, in var_lib
    assert not [p for p in prefixes if p in out], out  # no finding or event of the demo's in the view
    history = _store_bytes(default_store)
    assert not [p for p in prefixes if p.encode() in history]
    assert _processes_with(str(tmp_path)) == []
