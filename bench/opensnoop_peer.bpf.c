/* opensnoop_peer.bpf.c: a program of opensnoop's shape, the peer of bench/bench_syscall_cost.py.
 *
 * bcc's tools/opensnoop.py (and libbpf-tools/opensnoop.bpf.c, which uses these same tracepoints)
 * keeps, at every open's entry, the filename pointer and flags in a hash keyed by the thread; at the
 * exit it reads the WHOLE filename from user memory (NAME_MAX bytes), the comm and uid, and submits
 * the record to a perf buffer, then deletes the hash entry. ghostgpu instead reads 8 bytes at the
 * entry and leaves at once unless they start a device path.
 *
 * Written for bcc like bench/empty.bpf.c, with the same GG_HAVE_* guards. The bench never reads the
 * perf buffer: once it is full each submit fails early, so this peer costs at most what opensnoop
 * costs (its user space also prints every line).
 */

#define GG_NAME_MAX 255 /* NAME_MAX, as opensnoop sizes its filename */
#define GG_COMM_LEN 16  /* TASK_COMM_LEN */

struct gg_peer_args {
    u64 ts_ns;
    const char *fname;
    int flags;
    int pad;
};

struct gg_peer_event {
    u64 id;
    u64 ts_ns;
    u32 uid;
    int ret;
    int flags;
    char comm[GG_COMM_LEN];
    char fname[GG_NAME_MAX];
};

BPF_HASH(peer_start, u64, struct gg_peer_args, 10240);
BPF_PERF_OUTPUT(peer_events);

static __always_inline int peer_enter(const char *filename, int flags)
{
    u64 id = bpf_get_current_pid_tgid();
    struct gg_peer_args a = {.ts_ns = bpf_ktime_get_ns(), .fname = filename, .flags = flags};
    peer_start.update(&id, &a);
    return 0;
}

static __always_inline int peer_exit(void *ctx, long ret)
{
    u64 id = bpf_get_current_pid_tgid();
    struct gg_peer_args *a = peer_start.lookup(&id);
    if (!a)
        return 0;
    struct gg_peer_event e = {};
    e.id = id;
    e.ts_ns = a->ts_ns;
    e.uid = (u32)bpf_get_current_uid_gid();
    e.ret = (int)ret;
    e.flags = a->flags;
    bpf_get_current_comm(&e.comm, sizeof(e.comm));
    bpf_probe_read_user_str(&e.fname, sizeof(e.fname), a->fname);
    peer_events.perf_submit(ctx, &e, sizeof(e));
    peer_start.delete(&id);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_openat)
{
    return peer_enter(args->filename, (int)args->flags);
}

TRACEPOINT_PROBE(syscalls, sys_exit_openat)
{
    return peer_exit(args, args->ret);
}

#ifdef GG_HAVE_SYS_OPENAT2
TRACEPOINT_PROBE(syscalls, sys_enter_openat2)
{
    return peer_enter(args->filename, 0);
}

TRACEPOINT_PROBE(syscalls, sys_exit_openat2)
{
    return peer_exit(args, args->ret);
}
#endif

#ifdef GG_HAVE_SYS_OPEN
TRACEPOINT_PROBE(syscalls, sys_enter_open)
{
    return peer_enter(args->filename, (int)args->flags);
}

TRACEPOINT_PROBE(syscalls, sys_exit_open)
{
    return peer_exit(args, args->ret);
}
#endif
