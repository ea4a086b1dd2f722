"""The uid owning one TCP socket, asked of the kernel by its exact 4-tuple (sock_diag netlink).

Why not /proc/net/tcp: reading and parsing it costs milliseconds per thousand sockets on the
host (TIME_WAIT ones included), on the collector's event loop, for every new loopback peer. One
SOCK_DIAG_BY_FAMILY request with the full socket id is answered from the kernel's established hash
(inet_diag_find_one_icsk, Linux 2.6.x and later) in tens of microseconds, whatever the number of
sockets. Reading another process's socket this way needs no privilege in one's own network
namespace.

Layouts from include/uapi/linux/netlink.h, sock_diag.h and inet_diag.h (stable ABI).
"""

from __future__ import annotations

import contextlib
import errno
import socket
import struct

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
TCP_ESTABLISHED = 1
INET_DIAG_NOCOOKIE = 0xFFFFFFFF
_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
# inet_diag_req_v2 (family, protocol, ext, pad, states) then inet_diag_sockid (sport, dport big
# endian, src[16], dst[16], interface, cookie[2]): 56 bytes, built in build_request.
_MSG_UID_OFFSET = 4 + 48 + 12  # inet_diag_msg: family..retrans, id, expires/rqueue/wqueue, then uid
_REPLY_BYTES = 8192


class DiagUnavailable(OSError):
    """sock_diag cannot be asked here (no netlink, a seccomp filter): use another way."""


def _packed(host: str) -> tuple[int, bytes]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return family, socket.inet_pton(family, host).ljust(16, b"\0")


def build_request(src: str, sport: int, dst: str, dport: int, seq: int = 1) -> bytes:
    """The SOCK_DIAG_BY_FAMILY request for the one TCP socket with this local (src, sport) and
    remote (dst, dport) end."""
    family, src_b = _packed(src)
    _, dst_b = _packed(dst)
    body = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 1 << TCP_ESTABLISHED)
    body += struct.pack(">HH", sport, dport) + src_b + dst_b
    body += struct.pack("=III", 0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE)
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, seq, 0) + body


def parse_reply(data: bytes) -> int | None:
    """The uid in a SOCK_DIAG_BY_FAMILY answer; None for "no such socket" (ENOENT)."""
    if len(data) < _NLMSGHDR.size:
        raise DiagUnavailable(errno.EPROTO, "short sock_diag answer")
    _length, kind, _flags, _seq, _pid = _NLMSGHDR.unpack_from(data)
    if kind == NLMSG_ERROR:
        (code,) = struct.unpack_from("=i", data, _NLMSGHDR.size)
        if -code in (errno.ENOENT, 0):
            return None
        raise DiagUnavailable(-code, f"sock_diag: {errno.errorcode.get(-code, -code)}")
    if kind != SOCK_DIAG_BY_FAMILY or len(data) < _NLMSGHDR.size + _MSG_UID_OFFSET + 4:
        raise DiagUnavailable(errno.EPROTO, f"sock_diag answered message type {kind}")
    (uid,) = struct.unpack_from("=I", data, _NLMSGHDR.size + _MSG_UID_OFFSET)
    return uid


def socket_uid(src: str, sport: int, dst: str, dport: int) -> int | None:
    """The uid owning the established TCP socket (src:sport -> dst:dport) in this network namespace,
    None when there is none (it closed). DiagUnavailable when netlink cannot be asked."""
    try:
        nl = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
    except OSError as e:
        raise DiagUnavailable(e.errno, f"sock_diag netlink: {e.strerror}") from None
    with contextlib.closing(nl):
        nl.settimeout(1.0)
        try:
            nl.sendto(build_request(src, sport, dst, dport), (0, 0))
            return parse_reply(nl.recv(_REPLY_BYTES))
        except TimeoutError:
            raise DiagUnavailable(errno.ETIMEDOUT, "sock_diag did not answer") from None
