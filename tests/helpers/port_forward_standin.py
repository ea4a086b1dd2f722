"""A stand-in for `kubectl port-forward`, to test cli/port_forward.py's handling of its child process.

This is not a fake kubectl that a test of kubectl's behaviour relies on: what kubectl does with the
command line is kubectl's (tests/integration/test_kubectl_plugin.py runs the real one). It plays the
child's side of the contract PortForward depends on, in the way the test asks ($STANDIN_MODE):

- ready: print "Forwarding from 127.0.0.1:PORT -> REMOTE" (from the last argument, LOCAL:REMOTE; an
  empty LOCAL, as kubectl does, is a port it binds on 127.0.0.1 and holds), then N=$STANDIN_FLOOD
  "Handling connection for PORT" lines, then wait for a signal;
- fail: "error: services "x" not found" on stderr, exit 1 (kubectl's way to fail);
- silent: never say anything, wait for a signal;
- stubborn: ready, but ignore SIGTERM (so only SIGKILL ends it);
- grandchild: ready, with a child process of its own in its process group.

It appends a JSON line to $STANDIN_LOG: its argv, its pid, the grandchild's pid and its local port;
and "flooded" once the flood lines are written (the reader kept draining them).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys


def log(**fields: object) -> None:
    with open(os.environ["STANDIN_LOG"], "a") as f:
        f.write(json.dumps(fields) + "\n")


def main() -> int:
    mode = os.environ.get("STANDIN_MODE", "ready")
    argv = sys.argv[1:]
    local, _, remote = argv[-1].partition(":")
    listener = None
    if not local:  # kubectl's random local port: bound now, held while it runs
        listener = socket.create_server(("127.0.0.1", 0))
        local = str(listener.getsockname()[1])
    grandchild = None
    if mode == "grandchild":
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    log(argv=argv, pid=os.getpid(), grandchild=grandchild.pid if grandchild else None, local=int(local))
    if mode == "fail":
        print("E1202 memcache.go:265] couldn't get current server API group list", file=sys.stderr)
        print('error: services "x" not found', file=sys.stderr)
        return 1
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode != "silent":
        print(f"Forwarding from 127.0.0.1:{local} -> {remote}", flush=True)
        for _ in range(int(os.environ.get("STANDIN_FLOOD", "0"))):
            print(f"Handling connection for {local}")
        sys.stdout.flush()
        log(flooded=True)
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main())
