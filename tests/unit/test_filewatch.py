"""The one "has this file changed" check (ghostgpu/common/system/filewatch.py)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from ghostgpu.common.system.filewatch import FileWatch, file_signature


def test_an_untouched_file_is_no_change(tmp_path: Path) -> None:
    path = tmp_path / "a.yml"
    path.write_text("one")
    watch = FileWatch([str(path)])
    assert not watch.poll() and not watch.poll()
    os.utime(path, ns=(1, 1))  # a new mtime, the content and size as they were
    assert watch.poll() and not watch.poll()


def test_a_rewrite_a_new_size_or_a_swap_is_a_change(tmp_path: Path) -> None:
    path, other = tmp_path / "cert.pem", tmp_path / "new.pem"
    path.write_text("one")
    watch = FileWatch([str(path)])
    stat = path.stat()
    path.write_text("one and more")  # a new size, whatever the clock's grain
    assert watch.poll()
    other.write_text("one and more")
    os.utime(other, ns=(stat.st_atime_ns, path.stat().st_mtime_ns))  # same size and mtime, new inode
    os.replace(other, path)
    assert watch.poll() and not watch.poll()


def test_a_symlink_is_followed(tmp_path: Path) -> None:
    """kubelet updates a mounted Secret by swapping the ..data symlink: the file's inode changes."""
    (tmp_path / "v1").mkdir()
    (tmp_path / "v2").mkdir()
    (tmp_path / "v1/tls.crt").write_text("cert")
    (tmp_path / "v2/tls.crt").write_text("cert")
    (tmp_path / "data").symlink_to("v1")
    watch = FileWatch([str(tmp_path / "data/tls.crt")])
    (tmp_path / "next").symlink_to("v2")
    os.replace(tmp_path / "next", tmp_path / "data")
    assert watch.poll()


def test_a_chmod_is_no_change(tmp_path: Path) -> None:
    """ctime is not in the signature: a chmod changes no content, so nothing reloads or is audited."""
    path = tmp_path / "policy.yml"
    path.write_text("rules: []")
    watch = FileWatch([str(path)])
    path.chmod(0o600)
    assert not watch.poll()


def test_a_missing_file_has_its_error_and_coming_back_is_a_change(tmp_path: Path) -> None:
    path = tmp_path / "key.pem"
    watch = FileWatch([str(path)])
    assert watch.signature == ((str(path), -1, errno.ENOENT),)
    assert not watch.poll()  # still missing: said once, not on every look
    path.write_text("key")
    assert watch.poll()
    path.unlink()
    assert watch.poll() and watch.signature == ((str(path), -1, errno.ENOENT),)


def test_empty_paths_name_no_file() -> None:
    """A TLS set without a CA, a policy without a file: nothing to watch, never a change."""
    watch = FileWatch([None, ""])
    assert watch.paths == () and watch.signature == () and not watch.poll()
    assert file_signature(["", None]) == ()


def test_the_signature_names_each_file_so_another_set_differs(tmp_path: Path) -> None:
    """A web config that names other files after a reload has another signature, even if their stats
    matched."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("x")
    b.write_text("x")
    sig_a, sig_b = file_signature([str(a)]), file_signature([str(b)])
    assert sig_a[0][0] == str(a) and sig_a != sig_b
    assert file_signature([str(a), str(b)]) == sig_a + sig_b
