"""What the README's install leaves behind works for every local user, not only root.

`scripts/bootstrap.sh` points /usr/local/bin/ghostgpu at a venv every user can read: the checkout's
own when the directories above it are world-searchable, else a copy in /opt/ghostgpu (a clone under
/root, 0700 on Debian). `.ci/run` runs the suite from such a private directory, so in CI this test
runs the copy. uid 65534 runs it here with no capability at all, against a real collector whose
policy lets that uid view (the policy's `uid:` rules exist for exactly these users).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import require_root
from tests.helpers.collector_proc import CollectorProcess

INSTALLED = Path("/usr/local/bin/ghostgpu")
NOBODY = 65534
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
             "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]


@pytest.mark.root
def test_a_user_without_root_runs_the_installed_ghostgpu_ps(shared_dir: Path) -> None:
    require_root()
    if not INSTALLED.exists():
        pytest.skip(f"{INSTALLED} is not installed: run scripts/bootstrap.sh install")
    policy = shared_dir / "policy.yaml"
    policy.write_text(f'rules:\n  - role: viewer\n    subjects: ["uid:{NOBODY}"]\n')
    with CollectorProcess(shared_dir / "collector", args=["--policy", str(policy)]) as col:
        out = subprocess.run(
            [*AS_NOBODY, str(INSTALLED), "ps", "--collector", col.unix_address, "-o", "json"],
            capture_output=True, text=True, timeout=60, cwd="/", check=False,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent",
                 "PYTHONDONTWRITEBYTECODE": "1"})
    assert out.returncode == 0, (
        f"{INSTALLED} -> {os.path.realpath(INSTALLED)} as uid {NOBODY}: exit {out.returncode}: {out.stderr}")
    assert isinstance(json.loads(out.stdout), list), out.stdout
