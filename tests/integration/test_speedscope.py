"""`ghostgpu trace --chrome-trace` opens in a real viewer: speedscope, in Debian's headless Chromium.

How: speedscope's npm package ships the whole offline viewer (node_modules/speedscope/dist/release);
it is installed once into tests/helpers/build (git-ignored, kept between runs). A Python HTTP server
on loopback serves that viewer and the Chrome trace made by ghostgpu.cli.chrome_trace from the
records of tests/unit/test_chrome_trace.py; Chromium opens

    http://127.0.0.1:PORT/index.html#profileURL=<the trace's URL>&view=sandwich

(speedscope's documented hash parameters: profileURL loads a profile by URL, view picks the view),
runs it under a virtual time budget and prints the DOM it ended with (--dump-dom). The flame chart
is a canvas, but the sandwich view is an HTML table of every frame, and the toolbar names the
profile: so the DOM proves the trace parsed (speedscope sets the page title only after an import
succeeds), that the process and thread names reached the viewer, and that every ioctl became a
slice with the call's name. Nothing leaves the machine: the viewer, the trace and the browser are
all local, and Chromium's background networking is off.
"""

from __future__ import annotations

import functools
import html
import json
import os
import re
import shutil
import subprocess
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from ghostgpu.cli.chrome_trace import chrome_trace

from tests.helpers.npm_cache import npm_install_once
from tests.unit.test_chrome_trace import SESSION, sample_records

REPO = Path(__file__).resolve().parents[2]
SPEEDSCOPE_VERSION = "1.25.0"  # pinned: the viewer's DOM is what this test reads
CACHE = REPO / "tests" / "helpers" / "build" / f"speedscope-{SPEEDSCOPE_VERSION}"
RELEASE = CACHE / "node_modules" / "speedscope" / "dist" / "release"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--virtual-time-budget=10000"]
CHROMIUM_TIMEOUT_S = 90


def _chromium() -> str:
    path = CHROMIUM if os.access(CHROMIUM, os.X_OK) else shutil.which("chromium")
    if not path:
        pytest.skip("chromium is not installed (apt-get install chromium; scripts/bootstrap.sh install)")
    return path


@pytest.fixture(scope="module")
def speedscope() -> Path:
    """The viewer's release folder, installed from the npm registry on first use."""
    npm_install_once(CACHE, [f"speedscope@{SPEEDSCOPE_VERSION}"], [RELEASE / "index.html"])
    return RELEASE


# speedscope reports a profile it cannot import with alert(), which would block headless Chromium
# until the timeout: the page served here puts the message in the title instead, for the assertion.
ALERT_TO_TITLE = b"<script>window.alert = (m) => { document.title = 'ALERT: ' + m }</script>"


class Site:
    """The viewer's files, plus /trace.json from memory, on 127.0.0.1; index.html with ALERT_TO_TITLE."""

    def __init__(self, root: Path, trace: bytes) -> None:
        page = (root / "index.html").read_bytes().replace(b"<head>", b"<head>" + ALERT_TO_TITLE, 1)
        files = {"/trace.json": (trace, "application/json"), "/index.html": (page, "text/html")}

        class Handler(SimpleHTTPRequestHandler):
            def do_GET(self) -> None:
                body, kind = files.get(self.path.split("?")[0], (b"", ""))
                if not kind:
                    super().do_GET()
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def site(speedscope: Path) -> Iterator[Site]:
    trace = json.dumps(chrome_trace(sample_records(), SESSION)).encode()
    s = Site(speedscope, trace)
    yield s
    s.close()


def render(site: Site, tmp_path: Path, **params: str) -> str:
    """The DOM headless Chromium ends with after opening the viewer on the trace; its text, tags
    stripped and entities decoded, one node a line."""
    hash_params = urllib.parse.urlencode({"profileURL": f"{site.url}/trace.json", **params})
    url = f"{site.url}/index.html#{hash_params}"
    argv = [_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}", "--dump-dom", url]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=CHROMIUM_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"chromium did not print the page within {CHROMIUM_TIMEOUT_S} s: "
                             f"{(exc.stderr or b'')[-3000:]!r}") from None
    assert done.returncode == 0 and "<html" in done.stdout, f"chromium failed:\n{done.stderr[-3000:]}"
    text = re.sub(r"<[^>]+>", "\n", re.sub(r"<(script|style)\b.*?</\1>", "", done.stdout, flags=re.S))
    return "\n".join(line.strip() for line in html.unescape(text).splitlines() if line.strip())


def test_speedscope_opens_the_chrome_trace(site: Site, tmp_path: Path) -> None:
    _chromium()
    dom = render(site, tmp_path, view="sandwich")
    lines = dom.splitlines()
    # The page title is set only once an import succeeded: "trace.json - speedscope".
    assert "trace.json - speedscope" in lines, dom[:2000]  # else "ALERT: <why>" (ALERT_TO_TITLE)
    # One profile per thread with a slice, named from the process_name and thread_name events:
    # pid 4242 on gpu-1 has tids 4242 and 4243; gpu-2's process has only an instant (no slice).
    assert "ml/trainer-0/main (pid 4242) (pid 4242), tid 4242 (tid 4242)" in lines, dom[:2000]
    assert "(1/2)" in lines
    # The sandwich table of the first thread: each ioctl a frame named by its call (speedscope
    # appends the event's args as JSON), with its time.
    names = {line.split(" {")[0]: line for line in lines if " {" in line}
    assert set(names) == {"RM_ALLOC NV01_ROOT", "RM_CONTROL NV2080_CTRL_CMD_GPU_GET_INFO", "UNKNOWN_ESCAPE"}
    assert json.loads(names["RM_ALLOC NV01_ROOT"].split(" ", 2)[2])["nv_status_name"] == "NV_OK"
    assert '"errno":"ENOTTY"' in names["UNKNOWN_ESCAPE"]
    assert "25.50µs (87%)" in lines  # RM_ALLOC: 25.5 of the thread's 29.3 µs
