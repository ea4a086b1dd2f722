"""Raise this process's soft RLIMIT_NOFILE to its hard limit.

Every connection costs a descriptor (three for one relayed by the collector's unix gate), and the
soft limit is often 1024 where the hard one is far higher (systemd's default is 1024:524288;
containerd gives pods 1048576 for both): a flood of idle connections then runs a server out of
descriptors long before the caps that protect it. `ghostgpu collector`, `ghostgpu tracer` and
`ghostgpu up` call raise_fd_limit() first. Where the hard limit is itself small, the caps are
what protects (the collector sizes its default --max-connections from the limit).
"""

from __future__ import annotations

import resource


def raise_fd_limit() -> tuple[int, int]:
    """(soft, hard) after raising soft to hard; unchanged where the kernel refuses."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:  # NOFILE cannot exceed fs.nr_open
        try:
            with open("/proc/sys/fs/nr_open") as f:
                target = int(f.read())
        except (OSError, ValueError):
            return soft, hard
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft, hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft, hard
    return target, hard
