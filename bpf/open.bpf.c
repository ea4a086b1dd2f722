/* open.bpf.c: open/openat/openat2 of a GPU device path -> fds/holds/procs, OPEN on a tgid's
 * first fd on a device.
 *
 * Hot path (every open on the node): a flags test, one 8-byte user read and a masked compare on
 * enter; one inlined array load (pending_count) on exit.
 *
 * Only absolute paths are matched: openat(dirfd, "nvidia0") relative to an open /dev, symlinks
 * such as /dev/char/195:0, or a device bind-mounted elsewhere are missed here; the periodic rescan
 * reads the table of a process whose fd count changed (tracer/rescan.py), finds those fds and seeds
 * them (BpfSource.seed) so they are tracked from then on.
 * glibc and musl route open(2) through openat; open(2) itself (x86_64 only, used by static or
 * raw-syscall binaries) is hooked where the tracepoint exists.
 */

/* Id of a device path, interning it on first sight. Ids come from a per-CPU counter,
 * (cpu + 1) << 20 | n, because a shared atomic counter needs fetch-and-add (see ghostgpu.h); the plain
 * read-modify-write is safe because tracing programs never nest on a CPU (trace_call_bpf's
 * bpf_prog_active guard). Two CPUs interning the same new path race on the NOEXIST insert; the
 * loser adopts the winner's id. */
static __always_inline u32 gg_intern(struct gg_path_key *key)
{
    u32 *known = dev_ids.lookup(key);
    if (known)
        return *known;
    u32 zero = 0;
    u32 *seq = dev_seq.lookup(&zero);
    if (!seq)
        return 0;
    u32 n = *seq + 1;
    u32 cpu = bpf_get_smp_processor_id();
    if (n >= (1u << 20) || cpu >= 2047)
        return 0; /* id space of this CPU spent: the /proc scan still sees the device */
    *seq = n;
    u32 id = ((cpu + 1) << 20) | n;
    if (dev_ids.insert(key, &id) == 0)
        return id;
    known = dev_ids.lookup(key);
    if (known)
        return *known;
    gg_stat(GG_STAT_DEV_IDS_FULL);
    return 0;
}

/* The enter side's slow path, by tail call once the first bytes matched (one copy of the
 * prefix compare and interning instead of one per open flavour). */
int gg_open_match(void *ctx)
{
    u32 zero = 0;
    struct gg_scratch *s = scratch.lookup(&zero);
    if (!s)
        return 0;
    struct gg_path_key key = {};
    if (bpf_probe_read_user_str(key.path, sizeof(key.path), (const char *)s->filename) <= 0)
        return 0;
    if (!gg_match_prefixes(key.path))
        return 0;
    u32 dev_id = gg_intern(&key);
    if (dev_id == 0)
        return 0;
    struct gg_pending p = {.dev_id = dev_id, .fd = -1, .op = GG_OP_OPEN, .nr = s->nr,
                           .oflags = (u32)s->oflags};
    gg_set_pending((u32)bpf_get_current_pid_tgid(), &p);
    return 0;
}

/* flags: the open flags, or 0 where they are not a tracepoint argument (openat2 has them in user
 * memory). O_DIRECTORY and O_PATH opens are skipped before the user read: neither opens a device
 * (O_DIRECTORY fails on one; O_PATH never calls the driver, and ioctl/mmap on it fail), and
 * opendir() is common (kubelet, runtimes walking /proc and cgroups). It also keeps
 * opendir("/dev/nvidia-caps") from passing for a device hold. Values from Python's os module:
 * they differ between ABIs (O_DIRECTORY is 0x10000 on x86_64, 0x4000 on arm64). */
static __always_inline int gg_open_enter(void *ctx, const char *filename, u64 flags, s32 nr)
{
    if (flags & GG_OPEN_SKIP_FLAGS)
        return 0;
    u64 head = 0;
    long n = bpf_probe_read_user_str(&head, sizeof(head), filename);
    /* n counts the NUL; a string shorter than the common prefix cannot match any prefix. */
    if (n < GG_COMMON_LEN + 1 || (head & GG_COMMON_MASK) != GG_COMMON_U64)
        return 0;
    u32 zero = 0;
    struct gg_scratch *s = scratch.lookup(&zero);
    if (!s)
        return 0;
    s->filename = (u64)filename;
    s->oflags = flags;
    s->nr = nr;
    slow.call(ctx, GG_SLOW_OPEN);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_openat)
{
    return gg_open_enter(args, args->filename, (u64)args->flags, args->__syscall_nr);
}

TRACEPOINT_PROBE(syscalls, sys_exit_openat)
{
    return gg_fd_exit(args, args->ret, args->__syscall_nr);
}

#ifdef GG_HAVE_SYS_OPENAT2 /* openat2 exists since Linux 5.6 */
TRACEPOINT_PROBE(syscalls, sys_enter_openat2)
{
    return gg_open_enter(args, args->filename, 0, args->__syscall_nr);
}

TRACEPOINT_PROBE(syscalls, sys_exit_openat2)
{
    return gg_fd_exit(args, args->ret, args->__syscall_nr);
}
#endif

#ifdef GG_HAVE_SYS_OPEN /* x86_64 has open(2); arm64 and other newer ABIs only have openat */
TRACEPOINT_PROBE(syscalls, sys_enter_open)
{
    return gg_open_enter(args, args->filename, (u64)args->flags, args->__syscall_nr);
}

TRACEPOINT_PROBE(syscalls, sys_exit_open)
{
    return gg_fd_exit(args, args->ret, args->__syscall_nr);
}
#endif
