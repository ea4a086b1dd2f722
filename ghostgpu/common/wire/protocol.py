"""What the tracer, the collector and clients agree on besides the generated messages.

The API version travels in Hello/Welcome on the node stream and in the `ghostgpu-api-version`
request metadata of the query service. A peer speaking a version this side does not support gets
FAILED_PRECONDITION with a message naming both versions: never a crash, never a guess.
"""

from __future__ import annotations

from ghostgpu import __version__

API_VERSION = 1
SUPPORTED_API_VERSIONS = frozenset({1})
API_VERSION_METADATA = "ghostgpu-api-version"
MAX_MESSAGE_BYTES = 8 << 20  # what a tracer or client may send; larger is refused with RESOURCE_EXHAUSTED
# What a client may receive: a whole cluster's ListConsumers answer (1,000 nodes x 20 consumers is
# about 11 MB) must fit.
MAX_ANSWER_BYTES = 256 << 20
MAX_BATCH_EVENTS = 2000


def version_mismatch(peer_version: int, who: str) -> str | None:
    """None when `peer_version` is supported, else the one-line FAILED_PRECONDITION message."""
    if peer_version in SUPPORTED_API_VERSIONS:
        return None
    ours = ", ".join(f"v{v}" for v in sorted(SUPPORTED_API_VERSIONS))
    return (f"{who} speaks ghostgpu API v{peer_version}, this collector (ghostgpu {__version__}) "
            f"speaks {ours}; run matching versions of ghostgpu")


def channel_options(receive_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Channel limits: tracers receive small commands; query clients pass MAX_ANSWER_BYTES."""
    return [
        ("grpc.max_receive_message_length", receive_bytes),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]
