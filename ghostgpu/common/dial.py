"""One way to open a gRPC channel to the collector, plaintext or mTLS, for every client: the
tracer's stream (tracer/stream_session.py) and the commands (ghostgpu/cli/client.py).

A channel is made per connection attempt by the tracer and per command by the CLI, and the TLS
files are read each time: a certificate rotated on disk (cert-manager rewriting a mounted Secret)
is used from the next connection on, with no restart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from ghostgpu.common.tls import TlsFiles, channel_credentials


def open_channel(target: str, tls: TlsFiles | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A channel to `target` (HOST:PORT or unix:///path); mTLS when `tls` names files.
    A unix socket is always plaintext: the collector knows its peer from SO_PEERCRED."""
    if tls is None or not tls.enabled or target.startswith("unix:"):
        return grpc.insecure_channel(target, options=list(options))
    return grpc.secure_channel(target, channel_credentials(tls), options=list(options))
