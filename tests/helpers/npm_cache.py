"""npm packages the integration tests read (the trace viewer, the custom resources' schemas), installed
once from the npm registry into a folder under tests/helpers/build (git-ignored, kept between runs)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

NPM_TIMEOUT_S = 600


def npm_install_once(cache: Path, packages: Sequence[str], installed: Sequence[Path]) -> Path:
    """`cache`, with `packages` in its node_modules: installed now unless every `installed` file is
    there. Skips naming the fix without npm; a failed install fails the test with npm's output."""
    if all(p.exists() for p in installed):
        return cache
    npm = shutil.which("npm")
    if not npm:
        pytest.skip("npm is not installed (apt-get install npm; scripts/bootstrap.sh install)")
    staging = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    done = subprocess.run([npm, "install", "--prefix", str(staging), "--no-audit", "--no-fund",
                           "--no-update-notifier", *packages],
                          capture_output=True, text=True, timeout=NPM_TIMEOUT_S)
    assert done.returncode == 0, f"npm install {' '.join(packages)} failed:\n{done.stdout}\n{done.stderr}"
    try:
        staging.rename(cache)  # whole or not at all: a broken install is never taken for the cache
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)  # another run installed it meanwhile
    missing = [str(p) for p in installed if not p.exists()]
    assert not missing, f"npm install {' '.join(packages)} left no {missing}"
    return cache
