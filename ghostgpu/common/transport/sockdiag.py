"""The uid owning one TCP socket, asked of the kernel by its exact 4-tuple (sock_diag netlink), with
/proc/net/tcp where netlink is refused. Both sides ask: the collector who its loopback client is
(collector/peers.py), and a client who serves the loopback port it dialled
(ghostgpu/common/transport/dial.py).

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
TCP_LISTEN = 10
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


def build_request(src: str, sport: int, dst: str, dport: int, seq: int = 1,
                  state: int = TCP_ESTABLISHED) -> bytes:
    """The SOCK_DIAG_BY_FAMILY request for the one TCP socket with this local (src, sport) and
    remote (dst, dport) end. The kernel looks the 4-tuple up as a packet's would be: the established
    socket, else the listener that would take it (dst 0.0.0.0 or ::, dport 0: a listener)."""
    family, src_b = _packed(src)
    _, dst_b = _packed(dst)
    body = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 1 << state)
    body += struct.pack(">HH", sport, dport) + src_b + dst_b
    body += struct.pack("=III", 0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE)
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, seq, 0) + body


def parse_reply(data: bytes) -> int | None:
    """The uid in a SOCK_DIAG_BY_FAMILY answer; None for "no such socket" (ENOENT)."""
    found = parse_reply_state(data)
    return found[1] if found is not None else None


def parse_reply_state(data: bytes) -> tuple[int, int] | None:
    """(the socket's TCP state, its uid) in a SOCK_DIAG_BY_FAMILY answer; None for ENOENT."""
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
    return data[_NLMSGHDR.size + 1], uid  # inet_diag_msg: idiag_family, idiag_state, ...


def socket_uid(src: str, sport: int, dst: str, dport: int) -> int | None:
    """The uid owning the established TCP socket (src:sport -> dst:dport) in this network namespace,
    None when there is none (it closed). DiagUnavailable when netlink cannot be asked."""
    found = _ask(build_request(src, sport, dst, dport))
    return found[1] if found is not None else None


def listener_uid(host: str, port: int) -> int | None:
    """The uid owning the TCP socket listening for connections to host:port (the one the kernel
    would hand a new connection), None when nobody listens there. Only a socket in LISTEN counts:
    a closed connection's time-wait remnant reads as uid 0. DiagUnavailable when netlink cannot be
    asked."""
    anywhere = "::" if ":" in host else "0.0.0.0"
    found = _ask(build_request(host, port, anywhere, 0, state=TCP_LISTEN))
    return found[1] if found is not None and found[0] == TCP_LISTEN else None


def _ask(request: bytes) -> tuple[int, int] | None:
    try:
        nl = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
    except OSError as e:
        raise DiagUnavailable(e.errno, f"sock_diag netlink: {e.strerror}") from None
    with contextlib.closing(nl):
        nl.settimeout(1.0)
        try:
            nl.sendto(request, (0, 0))
            return parse_reply_state(nl.recv(_REPLY_BYTES))
        except TimeoutError:
            raise DiagUnavailable(errno.ETIMEDOUT, "sock_diag did not answer") from None


# ---- /proc/net/tcp, where netlink cannot be asked ---------------------------------------------

TCP_ESTABLISHED_ST = 1  # the st column of /proc/net/tcp (include/net/tcp_states.h)
TCP_LISTEN_ST = 10
TcpRow = tuple[str, int, str, int, int, int]  # local ip, local port, remote ip, remote port, state, uid


def _hex_ip(text: str) -> str:
    """/proc/net/tcp's address: IPv4 as one little-endian 32-bit word, IPv6 as four of them."""
    raw = bytes.fromhex(text)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    if len(words) == 4:
        return socket.inet_ntop(socket.AF_INET, words)
    ip6 = socket.inet_ntop(socket.AF_INET6, words)
    return ip6[7:] if ip6.startswith("::ffff:") and "." in ip6 else ip6  # a v4-mapped peer


def parse_tcp_row(line: str) -> TcpRow | None:
    """One row of /proc/net/tcp or tcp6; None for the header or a line cut by a concurrent change
    (the next lookup reads it whole)."""
    fields = line.split()
    if len(fields) < 8:
        return None
    try:
        (lip, lport), (rip, rport) = (f.split(":") for f in fields[1:3])
        return _hex_ip(lip), int(lport, 16), _hex_ip(rip), int(rport, 16), int(fields[3], 16), int(fields[7])
    except ValueError:
        return None


def parse_proc_net_tcp(text: str) -> list[TcpRow]:
    """The rows of /proc/net/tcp or tcp6, past its header line."""
    return [row for line in text.splitlines()[1:] if (row := parse_tcp_row(line)) is not None]


def proc_net_listener_uid(host: str, port: int, proc_net: str = "/proc/self/net") -> int | None:
    """listener_uid() read from /proc/net/tcp{,6}: the socket listening on host:port itself, else on
    the wildcard address; None when nobody listens there."""
    needle = f":{port:04X} "
    found: dict[str, int] = {}
    for name in ("tcp", "tcp6"):
        try:
            with open(f"{proc_net}/{name}") as f:
                rows = [row for line in f if needle in line and (row := parse_tcp_row(line)) is not None]
        except OSError:
            continue
        for lip, lport, _rip, _rport, state, uid in rows:
            if lport == port and state == TCP_LISTEN_ST:
                found.setdefault(lip, uid)
    for where in (host, "::ffff:" + host, "0.0.0.0", "::"):
        if where in found:
            return found[where]
    return None
