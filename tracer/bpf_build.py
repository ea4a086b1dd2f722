"""How the kernel side is built: the -D flags that configure bpf/*.bpf.c, the program text, and the
preflight checks (tracefs, capabilities, tracepoint fields). Pure functions, testable without bcc."""

from __future__ import annotations

import os
import re
import string
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path

from ghostgpu.tracer import nvabi
from ghostgpu.tracer.config import TracerConfig

from ghostgpu.common.system.settings import default_of

BPF_FILES = ("ghostgpu.h", "trace.bpf.c", "alloc.bpf.c", "open.bpf.c", "fd.bpf.c", "ioctl.bpf.c",
             "sched.bpf.c", "printk.bpf.c")


def find_bpf_dir(source_root: Path | None = None, data_root: Path | None = None) -> Path:
    """bpf/ beside the sources (a checkout or an editable install), else where a wheel installs it
    (pyproject's data-files: share/ghostgpu/bpf under the environment's prefix, e.g. in the image)."""
    beside = (source_root or Path(__file__).resolve().parent.parent) / "bpf"
    if (beside / BPF_FILES[0]).is_file():
        return beside
    return (data_root or Path(sysconfig.get_path("data"))) / "share" / "ghostgpu" / "bpf"


BPF_DIR = find_bpf_dir()
PATH_LEN = 48
PID_MAX_LIMIT = 1 << 22  # the kernel's ceiling for /proc/sys/kernel/pid_max on 64-bit
MAX_PREFIXES = 8
# Syscall tracepoints that not every ABI has: openat2 since 5.6, open and dup2 on x86_64 only.
OPTIONAL_SYSCALLS = ("openat2", "open", "dup2")
TRACEFS_CANDIDATES = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")
_PREFIX_CHARS = frozenset(string.ascii_letters + string.digits + "/_.-:")  # safe in a C literal


def prefix_ok(prefix: str) -> bool:
    """Whether the kernel matcher can take `prefix`: an absolute path of at most 40 plain characters."""
    return prefix.startswith("/") and len(prefix) <= PATH_LEN - 8 and set(prefix) <= _PREFIX_CHARS


def common_prefix(prefixes: Iterable[str]) -> str:
    """The leading bytes all prefixes share, at most 7 (the kernel probes 8 bytes, NUL included).
    Byte-wise on purpose, not os.path.commonpath: "/dev/nvidia" and "/dev/kfd" share "/dev/"."""
    return os.path.commonprefix(list(prefixes))[:7]  # noqa: RUF071


def prefix_words(prefix: str, path_len: int = 48) -> list[tuple[int, int]]:
    """(value, mask) of each 8-byte word of `prefix` as the kernel compares them, path_len // 8 of
    them; words past the prefix have mask 0 (always equal)."""
    raw = prefix.encode()
    out = []
    for start in range(0, path_len, 8):
        chunk = raw[start:start + 8]
        mask = int.from_bytes(b"\xff" * len(chunk) + b"\0" * (8 - len(chunk)), sys.byteorder)
        out.append((int.from_bytes(chunk.ljust(8, b"\0"), sys.byteorder), mask))
    return out


def prefix_word(prefix: str) -> tuple[int, int]:
    """(value, mask) of `prefix` read as a native-endian u64, as the kernel compares it."""
    raw = prefix.encode()
    if not 1 <= len(raw) <= 7:
        raise ValueError(f"common prefix {prefix!r} must be 1 to 7 bytes")
    mask = int.from_bytes(b"\xff" * len(raw) + b"\0" * (8 - len(raw)), sys.byteorder)
    return int.from_bytes(raw.ljust(8, b"\0"), sys.byteorder), mask


def map_sizes(max_fds: int) -> dict[str, int]:
    """Every map is bounded by the one fd budget: a CUDA process holds ~4 devices with ~30 fds."""
    # GG_MAX_ALLOCS: one record per tgid that made an allocation call, kept (like its ioctl
    # counters) until user space forgets it after its EXIT: twice procs, for the dead not yet swept.
    # GG_MAX_MEM_INFLIGHT: threads inside a memory call at once (an LRU map: never leaks).
    # GG_MAX_MEM_CLIENTS: (tgid, fd) owning an RM client; a CUDA process has one or two.
    return {"GG_MAX_FDS": max_fds, "GG_MAX_HOLDS": max(256, max_fds // 4),
            "GG_MAX_PROCS": max(128, max_fds // 8), "GG_MAX_IOCTLS": max(1024, max_fds * 2),
            "GG_MAX_DEVS": 4096, "GG_MAX_PENDING": 4096, "GG_MAX_ALLOCS": max(256, max_fds // 4),
            "GG_MAX_MEM_INFLIGHT": 4096, "GG_MAX_MEM_CLIENTS": max(256, max_fds // 16)}


RM_ALLOC_NR = 0x2B  # NV_ESC_RM_ALLOC (nv_escape.h)


def rm_alloc_layout(driver_version: str | None) -> dict[str, int]:
    """Where NV_ESC_RM_ALLOC's status sits for this driver release, as bpf/alloc.bpf.c takes it:
    NVOS21's status offset (its size is 32 in every release) and NVOS64's size and status offset
    (docs/reference/nvidia-ioctl-abi.md §3.1, §5.2, from tracer/nvabi.py). A version the tables do
    not cover (unknown, older than 515, newer than the baseline) gets the baseline 595.45.04 layout;
    one between two compared tags gets the older tag's."""
    version = (driver_version or "").strip()
    tag = nvabi.bracket(nvabi.RM_TAGS, version)[0] if nvabi.covers(version) else nvabi.BASELINE
    at = {block.struct: nvabi.layout_at(block.history, tag) for block in nvabi.RM_BLOCKS
          if block.nr == RM_ALLOC_NR}
    nvos21, nvos64 = at["NVOS21_PARAMETERS"], at["NVOS64_PARAMETERS"]
    assert nvos21 is not None and nvos64 is not None  # both exist from the oldest tag on
    return {"GG_NVOS21_STATUS": nvos21.status, "GG_NVOS64_SIZE": nvos64.size,
            "GG_NVOS64_STATUS": nvos64.status}


def build_cflags(
    prefixes: tuple[str, ...], *, max_fds: int = default_of(TracerConfig, "bpf_max_fds"),
    ringbuf_pages: int = default_of(TracerConfig, "bpf_ringbuf_pages"),
    pid_max: int = PID_MAX_LIMIT, have_group_dead: bool = True, syscalls: Iterable[str] = (),
    bpf_dir: Path = BPF_DIR, holder_filter: bool = True, driver_version: str | None = None,
    kmsg_origin: bool = False,
) -> list[str]:
    """The -D/-I flags that configure bpf/*.bpf.c. Constants are never spliced into the text.
    driver_version: the node's NVIDIA driver (None: unknown), for RM_ALLOC's status offsets.
    kmsg_origin: bpf/printk.bpf.c may tell user-written lines (kmsg_origin_supported)."""
    if not 1 <= len(prefixes) <= MAX_PREFIXES:
        raise ValueError(f"need 1 to {MAX_PREFIXES} device prefixes, got {len(prefixes)}")
    for prefix in prefixes:
        if not prefix_ok(prefix):
            raise ValueError(f"device prefix {prefix!r}: an absolute path of at most 40 plain characters")
    common = common_prefix(prefixes)
    value, mask = prefix_word(common)
    flags = [f"-I{bpf_dir}", f"-DGG_PATH_LEN={PATH_LEN}", f"-DGG_NPREFIX={len(prefixes)}"]
    flags += [f'-DGG_PREFIX{i}="{prefix}"' for i, prefix in enumerate(prefixes)]
    # The matcher compares words, not string literals: with several long literals clang keeps
    # them in .rodata, which bcc 0.26 cannot load (the load fails with E2BIG).
    for i, prefix in enumerate(prefixes):
        for j, (word, word_mask) in enumerate(prefix_words(prefix, PATH_LEN)):
            flags += [f"-DGG_P{i}_W{j}={word:#x}ULL", f"-DGG_P{i}_M{j}={word_mask:#x}ULL"]
    flags += [f'-DGG_COMMON_PREFIX="{common}"', f"-DGG_COMMON_LEN={len(common.encode())}",
              f"-DGG_COMMON_U64={value:#x}ULL", f"-DGG_COMMON_MASK={mask:#x}ULL",
              f"-DGG_RINGBUF_PAGES={ringbuf_pages}", f"-DGG_OPEN_SKIP_FLAGS={os.O_DIRECTORY | os.O_PATH:#x}",
              f"-DGG_ID_SLOTS={max(1, -(-min(pid_max, PID_MAX_LIMIT) // 4096))}"]
    flags += [f"-D{name}={size}" for name, size in map_sizes(max_fds).items()]
    flags += [f"-D{name}={value}" for name, value in rm_alloc_layout(driver_version).items()]
    if have_group_dead:
        flags.append("-DGG_HAVE_GROUP_DEAD=1")
    flags += [f"-DGG_HAVE_SYS_{name.upper()}=1" for name in sorted(set(syscalls))]
    if not holder_filter:
        flags.append("-DGG_NO_HOLDER_FILTER=1")
    if kmsg_origin:
        flags.append("-DGG_KMSG_ORIGIN=1")
    return flags


def kmsg_origin_supported(release: str, machine: str, have_btf: bool) -> bool:
    """Whether bpf/printk.bpf.c can read the writer's syscall: bpf_task_pt_regs since Linux 5.15,
    bpf_get_current_task_btf (kernel BTF), and the syscall number where the program looks for it
    (orig_ax: x86_64 only)."""
    m = re.match(r"(\d+)\.(\d+)", release)
    if m is None or machine != "x86_64" or not have_btf:
        return False
    return (int(m[1]), int(m[2])) >= (5, 15)


def program_text(bpf_dir: Path = BPF_DIR) -> str:
    """The files as one text: bcc 0.26 rewrites map calls only in its main file, so they cannot be
    #include'd; #line keeps compiler messages pointing at the real file and line."""
    return "\n".join(f'#line 1 "{bpf_dir / n}"\n{(bpf_dir / n).read_text()}' for n in BPF_FILES)


def format_has_field(format_text: str, field: str) -> bool:
    """Whether a tracepoint format file (events/<group>/<name>/format) declares `field`."""
    return re.search(rf"^\s*field:[^;]*[\s*]{re.escape(field)}(\[\d*\])?;", format_text, re.M) is not None


def has_caps(cap_eff_hex: str) -> bool:
    """CapEff (/proc/self/status) allows tracing BPF: CAP_SYS_ADMIN (21), or CAP_BPF (39) with
    CAP_PERFMON (38)."""
    caps = int(cap_eff_hex, 16)
    return bool(caps >> 21 & 1) or bool(caps >> 39 & 1 and caps >> 38 & 1)


def find_tracefs() -> str | None:
    return next((p for p in TRACEFS_CANDIDATES if os.path.isdir(f"{p}/events/syscalls")), None)
