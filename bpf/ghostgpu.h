/* ghostgpu kernel side: shared event struct, map keys, maps, constants and the prefix matcher.
 *
 * Compiled by bcc as ONE program together with trace.bpf.c, alloc.bpf.c, open.bpf.c, fd.bpf.c,
 * ioctl.bpf.c and sched.bpf.c (in that order: trace.bpf.c's and alloc.bpf.c's helpers are called
 * by the others).
 * tracer/bpf_source.py concatenates the files (with #line markers) instead of #include-ing them:
 * bcc 0.26 rewrites map calls (m.lookup()) and TRACEPOINT_PROBE argument structs only in its main
 * file, so an #include'd program fails to load ("unknown opcode 8d").
 *
 * Rule for every file: read ONLY tracepoint arguments and helper results, never kernel structs
 * (no task_struct, no CO-RE). The kernel headers here are Debian 6.1 ones used for a 6.18 kernel;
 * that mismatch is harmless only while no struct layout is read.
 *
 * Constants come in as -D cflags built by tracer/bpf_source.py:build_cflags(). The defaults below
 * only make the header self-contained for an editor or a syntax check.
 *
 * No atomic fetch: bcc 0.26 cannot pass -mcpu=v3 to LLVM, so "__sync_fetch_and_add" with its
 * result used fails ("Invalid usage of the XADD return value"). Counters are therefore bumped with
 * a plain XADD and read back; the rare races that leaves are called out where they matter.
 */
#ifndef GHOSTGPU_H
#define GHOSTGPU_H

#ifndef GG_PATH_LEN
#define GG_PATH_LEN 48
#endif
#ifndef GG_NPREFIX /* with the prefix words GG_P<i>_W<j>/_M<j>: build_cflags() in tracer/bpf_source.py */
#error "compile through tracer/bpf_source.py: the device prefixes come in as -D flags"
#endif
#ifndef GG_COMMON_LEN /* "/dev/" read as a little-endian u64, and the mask of its 5 bytes */
#define GG_COMMON_PREFIX "/dev/"
#define GG_COMMON_LEN 5
#define GG_COMMON_U64 0x2f7665642fULL
#define GG_COMMON_MASK 0xffffffffffULL
#endif
#ifndef GG_MAX_FDS
#define GG_MAX_FDS 65536
#endif
#ifndef GG_MAX_HOLDS
#define GG_MAX_HOLDS 16384
#endif
#ifndef GG_MAX_PROCS
#define GG_MAX_PROCS 8192
#endif
#ifndef GG_MAX_IOCTLS
#define GG_MAX_IOCTLS 131072
#endif
#ifndef GG_MAX_DEVS
#define GG_MAX_DEVS 4096
#endif
#ifndef GG_MAX_PENDING
#define GG_MAX_PENDING 4096
#endif
#ifndef GG_RINGBUF_PAGES
#define GG_RINGBUF_PAGES 64
#endif
#ifndef GG_OPEN_SKIP_FLAGS /* O_DIRECTORY | O_PATH of the target ABI, from Python's os module */
#define GG_OPEN_SKIP_FLAGS 0
#endif
#ifndef GG_ID_SLOTS /* byte-flag slots of 4096 ids: pid_max / 4096, rounded up */
#define GG_ID_SLOTS 8
#endif

_Static_assert(sizeof(GG_COMMON_PREFIX) - 1 == GG_COMMON_LEN, "GG_COMMON_LEN must match GG_COMMON_PREFIX");
_Static_assert(GG_COMMON_LEN >= 1 && GG_COMMON_LEN <= 7, "common prefix must fit the 8-byte probe");

/* Event kinds and flags: tracer/bpf_source.py mirrors these numbers. */
#define GG_EV_OPEN 1
#define GG_EV_CLOSE 2
#define GG_EV_MMAP 3
#define GG_EV_FORK 4
#define GG_EV_EXEC 5
#define GG_EV_EXIT 6
#define GG_EV_RENAME 9 /* a holder renamed itself (prctl PR_SET_NAME, /proc/self/comm): reread its comm */
/* Bookkeeping records, never shown: they tell user space which keys a tgid owns, so that its
 * exec and exit touch only those (tracer/kernel_tables.py) instead of walking whole maps. */
#define GG_EV_FD 7        /* another fd on a device the tgid already holds: fd, dev_id */
#define GG_EV_IOCTL_KEY 8 /* a new ioctls counter: fd, dev_id, arg = the request word */
/* A memory call the driver accepted (alloc.bpf.c): a longer record, struct gg_memcall, decoded
 * into tracer/memcalls.py MemCall; never a SourceEvent. */
#define GG_EV_MEMCALL 10

#define GG_FLAG_MAPPED 1u      /* CLOSE: the device is still mapped */
#define GG_FLAG_LEADER_ONLY 2u /* EXIT without group_dead: only the leader is known to be gone */

#define GG_FD_SEEDED 1u /* fds value flag: inserted by user space from a /proc scan */
#define GG_FD_DUP 2u    /* fds value flag: made by dup/dup2/dup3/fcntl(F_DUPFD*) */

#define GG_SLOW_SETTLE 0 /* gg_settle in fd.bpf.c */
#define GG_SLOW_OPEN 1   /* gg_open_match in open.bpf.c */

#define GG_OP_OPEN 1
#define GG_OP_DUP 2

/* Kernel ids stay below this; user space interns devices found by /proc scans from here up. */
#define GG_USER_ID_BASE 0x80000000u

/* stats slots: tracer/bpf_source.py STAT_NAMES mirrors this order. */
#define GG_STAT_RINGBUF_DROPS 0
#define GG_STAT_FDS_FULL 1
#define GG_STAT_HOLDS_FULL 2
#define GG_STAT_PROCS_FULL 3
#define GG_STAT_IOCTLS_FULL 4
#define GG_STAT_DEV_IDS_FULL 5
#define GG_STAT_PENDING_FULL 6
#define GG_STAT_FORKING_FULL 7
#define GG_STAT_ALLOCS_FULL 8 /* alloc.bpf.c: a tgid's allocation record could not be kept */
/* alloc.bpf.c, memory calls read at the ioctl's exit: */
#define GG_STAT_MEM_REFUSED 9   /* the ioctl returned 0 but the block's status was not NV_OK */
#define GG_STAT_MEM_FAILED 10   /* the ioctl returned an error (or its block could not be read back) */
#define GG_STAT_MEM_LOST 11     /* the exit found no entry stashed (mem_stash full: LRU eviction) */
#define GG_STAT_MEM_CLIENTS_FULL 12 /* an accepted client's fd could not be kept: its CLOSE is lost */
#define GG_STAT_MEM_DROPS 13    /* an accepted call had no room in the ring buffer: the accountant is short */
#define GG_STAT_MAX 14

#define GG_CLONE_THREAD 0x00010000ULL /* include/uapi/linux/sched.h, stable ABI */
#define GG_MAP_ANONYMOUS 0x20UL       /* x86_64 and arm64 value (asm-generic/mman-common.h) */
#define GG_F_DUPFD 0
#define GG_F_DUPFD_CLOEXEC 1030

/* 48 bytes, no implicit padding: decoded by struct format "=QQIIIiIIII" in bpf_source.py. */
struct gg_event {
    u64 ts_ns;     /* bpf_ktime_get_boot_ns(): CLOCK_BOOTTIME, like /proc start times */
    u64 cgroup_id; /* cgroup v2 id of the task that caused the event */
    u32 kind;
    u32 tgid;
    u32 tid;
    s32 fd;
    u32 dev_id;
    u32 arg; /* FORK: the child's pid; IOCTL_KEY: the request word */
    u32 flags;
    u32 pad;
};

struct gg_path_key {
    char path[GG_PATH_LEN]; /* zero padded so equal paths are equal keys */
} __attribute__((aligned(8))); /* the prefix matcher reads it as u64 words */
struct gg_fd_key {
    u32 tgid;
    s32 fd;
};
struct gg_fd_val {
    u32 dev_id;
    u32 flags;
};
struct gg_hold_key {
    u32 tgid;
    u32 dev_id;
};
struct gg_hold_val {
    u32 nfds;
    u32 mapped;
};
struct gg_pending {
    u32 dev_id;
    s32 fd; /* dup2/dup3: the target fd; -1 otherwise */
    u32 op;
    s32 nr; /* syscall number of the enter: an exit only settles its own syscall's entry */
    u32 oflags; /* GG_OP_OPEN: the open flags, for a trace session's OPEN record */
    u32 pad;
};
struct gg_scratch {
    u64 filename; /* GG_SLOW_OPEN: user pointer to the path */
    s64 ret;      /* GG_SLOW_SETTLE: the syscall's return value */
    s32 nr;       /* both: the syscall number */
    u32 pad;
    u64 oflags;   /* GG_SLOW_OPEN: the open flags */
};
struct gg_ioctl_key {
    u32 tgid;
    s32 fd;
    u32 dev_id;
    u32 cmd;
};
/* pending_bytes values, by tid: what this thread's syscall left for its exit. A thread is in one
 * syscall at a time, so one byte serves every exit: open/dup (gg_set_pending), and the ioctl exit
 * (GG_PB_MEM: alloc.bpf.c stashed a memory call; GG_PB_TRACE: a trace session keeps the call in
 * flight). Only the thread itself writes its byte. */
#define GG_PB_FD 1u
#define GG_PB_MEM 2u
#define GG_PB_TRACE 4u
#define GG_PB_MAYBE 8u /* gg_take_call only: no byte to ask (see there) */

/* Byte flags per pid (holder_bytes by tgid, pending_bytes by tid): one byte each, so two CPUs
 * flagging neighbouring ids never lose each other's store (a u64 bitmap would need atomic OR,
 * which needs -mcpu=v3 as well). Sized from pid_max at load; an id beyond answers "maybe". */
struct gg_byte_slot {
    u8 b[4096];
};

BPF_HASH(dev_ids, struct gg_path_key, u32, GG_MAX_DEVS);
BPF_PERCPU_ARRAY(dev_seq, u32, 1);
BPF_HASH(fds, struct gg_fd_key, struct gg_fd_val, GG_MAX_FDS);
BPF_HASH(holds, struct gg_hold_key, struct gg_hold_val, GG_MAX_HOLDS);
BPF_HASH(procs, u32, u32, GG_MAX_PROCS);
BPF_HASH(pending, u32, struct gg_pending, GG_MAX_PENDING);
BPF_HASH(forking, u32, u32, GG_MAX_PENDING);
BPF_HASH(ioctls, struct gg_ioctl_key, u64, GG_MAX_IOCTLS);
BPF_PERCPU_ARRAY(stats, u64, GG_STAT_MAX);
/* Mappable so user space (seed/forget) can store single bytes: writing a whole 4 KiB slot with
 * bpf_map_update_elem could undo a kernel store to a neighbouring tgid made meanwhile. */
BPF_F_TABLE("array", u32, struct gg_byte_slot, holder_bytes, GG_ID_SLOTS, BPF_F_MMAPABLE);
/* Set when a tgid released an fd (close, dup2/dup3 over another): with the fd count of
 * /proc/PID/fd, how user space knows which fd tables changed since its last periodic rescan
 * (tracer/rescan.py). A device fd received over a socket while another fd is closed leaves the
 * count as it was; the close shows here. User space clears the bytes it takes (mappable, as above). */
BPF_F_TABLE("array", u32, struct gg_byte_slot, touched_bytes, GG_ID_SLOTS, BPF_F_MMAPABLE);
BPF_ARRAY(pending_bytes, struct gg_byte_slot, GG_ID_SLOTS);
/* Entries in `pending`, node-wide: almost always 0, which lets every open/dup/fcntl exit return
 * after one inlined array load, before even a helper call. */
BPF_ARRAY(pending_count, u64, 1);
BPF_RINGBUF_OUTPUT(events, GG_RINGBUF_PAGES);
/* Slow paths reached by tail call (slots filled by bpf_source.py, same order as GG_SLOW_*), and
 * the per-CPU scratch that carries their arguments: a program and the one it tail-calls run on
 * the same CPU without interruption by another program of ours. */
BPF_PROG_ARRAY(slow, 2);
BPF_PERCPU_ARRAY(scratch, struct gg_scratch, 1);

static __always_inline void gg_stat(u32 slot)
{
    u64 *v = stats.lookup(&slot);
    if (v)
        *v += 1; /* per-CPU slot: no other CPU writes it */
}

/* The hot-path filter: may this tgid hold a GPU fd? An array lookup (inlined by the verifier)
 * and a byte load are far cheaper than a hash miss in fds, which every ioctl/close/mmap of every
 * process would otherwise pay. A tgid beyond the array answers yes, falling back to the hash. */
static __always_inline bool gg_maybe_holder(u32 tgid)
{
#ifdef GG_NO_HOLDER_FILTER /* bench/bench_syscall_cost.py measures the filter's worth */
    return true;
#endif
    u32 slot = tgid >> 12;
    struct gg_byte_slot *s = holder_bytes.lookup(&slot);
    if (!s)
        return true;
    return s->b[tgid & 4095] != 0;
}

/* Is `fd` of `tgid` a GPU fd? The one check every ioctl, close, mmap and dup of the node pays:
 * the holder filter, then (for holders only) one lookup in fds. NULL for nearly every call. */
static __always_inline struct gg_fd_val *gg_gpu_fd(u32 tgid, s32 fd)
{
    if (!gg_maybe_holder(tgid))
        return NULL;
    struct gg_fd_key fk = {.tgid = tgid, .fd = fd};
    return fds.lookup(&fk);
}

/* Mark tgid's fd table as changed: an inlined array load, and a store only when the byte is not set
 * yet (a busy process dirties its cache line once per rescan period, not once per close). */
static __always_inline void gg_touch(u32 tgid)
{
    u32 slot = tgid >> 12;
    struct gg_byte_slot *s = touched_bytes.lookup(&slot);
    if (s && !s->b[tgid & 4095])
        s->b[tgid & 4095] = 1;
}

static __always_inline void gg_set_holder(u32 tgid, u8 on)
{
    u32 slot = tgid >> 12;
    struct gg_byte_slot *s = holder_bytes.lookup(&slot);
    if (s)
        s->b[tgid & 4095] = on;
}

/* Same filter for the exit side of open/dup: has this thread left something in pending? Only the
 * thread itself sets and clears its byte, so there is no race on it. */
static __always_inline bool gg_maybe_pending(u32 tid)
{
#ifdef GG_NO_HOLDER_FILTER
    return true;
#endif
    u32 slot = tid >> 12;
    struct gg_byte_slot *s = pending_bytes.lookup(&slot);
    if (!s)
        return true;
    return (s->b[tid & 4095] & GG_PB_FD) != 0;
}

static __always_inline bool gg_any_pending(void)
{
#ifdef GG_NO_HOLDER_FILTER
    return true;
#endif
    u32 zero = 0;
    u64 *count = pending_count.lookup(&zero);
    return !count || *count != 0;
}

static __always_inline void gg_set_pending(u32 tid, struct gg_pending *p)
{
    bool fresh = pending.lookup(&tid) == NULL;
    if (pending.update(&tid, p) != 0) {
        gg_stat(GG_STAT_PENDING_FULL);
        return;
    }
    u32 zero = 0;
    u64 *count = pending_count.lookup(&zero);
    if (count && fresh)
        __sync_fetch_and_add(count, 1); /* a full barrier: the exit of this thread sees it */
    u32 slot = tid >> 12;
    struct gg_byte_slot *s = pending_bytes.lookup(&slot);
    if (s)
        s->b[tid & 4095] |= GG_PB_FD;
}

/* The ioctl entry left work for the exit (GG_PB_MEM, GG_PB_TRACE): set that bit of the byte. */
static __always_inline void gg_mark_call(u32 tid, u8 bit)
{
    u32 slot = tid >> 12;
    struct gg_byte_slot *s = pending_bytes.lookup(&slot);
    if (s)
        s->b[tid & 4095] |= bit;
}

/* The ioctl exit's bits of tid's byte (GG_PB_MEM, GG_PB_TRACE), cleared: what its entry left.
 * GG_PB_MAYBE is added when the byte cannot say (a tid beyond the array, or no filter for the
 * bench): the exit then looks the maps up, and a miss means nothing. The open/dup bit stays. */
static __always_inline u32 gg_take_call(u32 tid)
{
    u32 slot = tid >> 12;
    struct gg_byte_slot *s = pending_bytes.lookup(&slot);
    if (!s)
        return GG_PB_MAYBE;
    u32 b = s->b[tid & 4095];
    u32 bits = b & (GG_PB_MEM | GG_PB_TRACE);
    if (bits)
        s->b[tid & 4095] = b & GG_PB_FD;
#ifdef GG_NO_HOLDER_FILTER
    bits |= GG_PB_MAYBE;
#endif
    return bits;
}

/* Take this thread's pending entry if it belongs to syscall nr; false when there is none. */
static __always_inline bool gg_take_pending(u32 tid, s32 nr, struct gg_pending *out)
{
    if (!gg_maybe_pending(tid))
        return false;
    u32 slot = tid >> 12;
    struct gg_byte_slot *s = pending_bytes.lookup(&slot);
    if (s)
        s->b[tid & 4095] &= ~GG_PB_FD; /* the ioctl bits are the ioctl exit's to take */
    struct gg_pending *p = pending.lookup(&tid);
    if (!p)
        return false;
    *out = *p;
    if (pending.delete(&tid) == 0) {
        u32 zero = 0;
        u64 *count = pending_count.lookup(&zero);
        if (count)
            __sync_fetch_and_add(count, (u64)-1);
    }
    return out->nr == nr;
}

static __always_inline void gg_emit(u32 kind, u32 tgid, u32 tid, s32 fd, u32 dev_id, u32 arg,
                                    u32 flags)
{
    struct gg_event *e = events.ringbuf_reserve(sizeof(struct gg_event));
    if (!e) {
        gg_stat(GG_STAT_RINGBUF_DROPS);
        return;
    }
    e->ts_ns = bpf_ktime_get_boot_ns();
    e->cgroup_id = bpf_get_current_cgroup_id();
    e->kind = kind;
    e->tgid = tgid;
    e->tid = tid;
    e->fd = fd;
    e->dev_id = dev_id;
    e->arg = arg;
    e->flags = flags;
    e->pad = 0;
    events.ringbuf_submit(e, 0);
}

/* Prefix compare, 8 bytes at a time: prefix i's word j and mask come in as -DGG_P<i>_W<j> and
 * -DGG_P<i>_M<j> (mask 0 past the prefix's end, so that word always matches). Word compares keep
 * the program small and need no read-only data section, which bcc 0.26 cannot load. */
#define GG_PW(buf, i, j) ((((const u64 *)(buf))[j] & GG_P##i##_M##j) == GG_P##i##_W##j)
#define GG_PREFIX_IS_N(buf, i) (GG_PW(buf, i, 0) && GG_PW(buf, i, 1) && GG_PW(buf, i, 2) && \
                                GG_PW(buf, i, 3) && GG_PW(buf, i, 4) && GG_PW(buf, i, 5))
#if GG_PATH_LEN != 48
#error "GG_PREFIX_IS_N compares exactly six words: keep GG_PATH_LEN at 48"
#endif

static __always_inline bool gg_match_prefixes(const char *buf)
{
#if GG_NPREFIX > 0
    if (GG_PREFIX_IS_N(buf, 0))
        return true;
#endif
#if GG_NPREFIX > 1
    if (GG_PREFIX_IS_N(buf, 1))
        return true;
#endif
#if GG_NPREFIX > 2
    if (GG_PREFIX_IS_N(buf, 2))
        return true;
#endif
#if GG_NPREFIX > 3
    if (GG_PREFIX_IS_N(buf, 3))
        return true;
#endif
#if GG_NPREFIX > 4
    if (GG_PREFIX_IS_N(buf, 4))
        return true;
#endif
#if GG_NPREFIX > 5
    if (GG_PREFIX_IS_N(buf, 5))
        return true;
#endif
#if GG_NPREFIX > 6
    if (GG_PREFIX_IS_N(buf, 6))
        return true;
#endif
#if GG_NPREFIX > 7
    if (GG_PREFIX_IS_N(buf, 7))
        return true;
#endif
    return false;
}

/* Shared by the open and dup exits: almost always one inlined load and out. Otherwise hand over
 * to gg_settle (fd.bpf.c) by tail call with the syscall's result in `scratch`: the heavy fd-table
 * code then exists once instead of inlined into seven exit programs (bcc's compile time, most of
 * tracer start-up, went from ~1.5 s to ~1.0 s). */
static __always_inline int gg_fd_exit(void *ctx, long ret, s32 nr)
{
    if (!gg_any_pending())
        return 0;
    u32 zero = 0;
    struct gg_scratch *s = scratch.lookup(&zero);
    if (!s)
        return 0;
    s->ret = ret;
    s->nr = nr;
    slow.call(ctx, GG_SLOW_SETTLE);
    return 0; /* reached only if the slot is empty (the instant between attach and fill) */
}

#endif /* GHOSTGPU_H */
