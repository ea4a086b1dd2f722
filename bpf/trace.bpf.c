/* trace.bpf.c: on-demand trace sessions (docs/TRACE.md). A session is data in maps, not a program:
 * user space (tracer/trace_kernel.py) writes which cgroups and tgids are in scope, per slot, and
 * the hooks of the other files call the gg_trace_* helpers below on the GPU calls they already
 * matched. This file's own hooks (the mmap exit, munmap) are attached only while a session runs,
 * so with no session nothing on the node pays for them. The ioctl exit is always attached, for the
 * memory calls too: it lives in ioctl.bpf.c and calls gg_trace_exit for a call whose entry marked
 * the thread's pending byte GG_PB_TRACE.
 *
 * Cost with no session: a GPU call pays one more inlined array load (trace_on); a non-GPU call
 * pays nothing (every helper is called after the hot-path filter said "GPU fd").
 *
 * Records go through their own ring buffer (trace_events), so a busy session can fill it and
 * lose records (counted per slot) without ever delaying or dropping the attribution events.
 */

#ifndef GG_TRACE_SLOTS
#define GG_TRACE_SLOTS 8 /* sessions at once per node; the scope maps hold a bit mask of slots */
#endif
#ifndef GG_TRACE_MAX_CGROUPS
#define GG_TRACE_MAX_CGROUPS 4096
#endif
#ifndef GG_TRACE_MAX_TGIDS
#define GG_TRACE_MAX_TGIDS 16384
#endif
#ifndef GG_TRACE_INFLIGHT
#define GG_TRACE_INFLIGHT 16384 /* threads inside a traced ioctl/mmap at once (LRU: a thread that
                                 * died mid-call is evicted, never leaked) */
#endif
#ifndef GG_TRACE_RINGBUF_PAGES
#define GG_TRACE_RINGBUF_PAGES 512
#endif
#define GG_TRACE_CAPTURE 56      /* bytes of a parameter block read at entry (tracer/call_decode.py
                                  * CAPTURE_MAX): up to the fd of RM_MAP_MEMORY's block, @48 */
#define GG_TRACE_NO_STATUS 0xFFFFu
#define GG_TRACE_MAX_STATUS_OFF 16384 /* NV_ABSOLUTE_MAX_IOCTL_SIZE (nv.h): no block is larger */

/* Record kinds: tracer/trace_kernel.py TRACE_KINDS mirrors them. */
#define GG_TK_IOCTL 1
#define GG_TK_OPEN 2
#define GG_TK_CLOSE 3
#define GG_TK_MMAP 4
#define GG_TK_MUNMAP 5
#define GG_TK_FORK 6
#define GG_TK_EXEC 7
#define GG_TK_EXIT 8

#define GG_TF_XFER 1u   /* the ioctl was NV_ESC_IOCTL_XFER_CMD: block/xfer_* describe the inner call */
#define GG_TF_STATUS 2u /* status was read at exit */

/* NV_ESC_IOCTL_XFER_CMD = _IOWR('F', 211, 16): its type and nr bytes (docs/reference/nvidia-ioctl-abi.md §1) */
#define GG_NV_TYPE_NR_XFER 0x46D3u

/* Per slot, written by user space at start (whole struct) and bumped by the kernel (XADD). */
struct gg_tslot {
    u64 records;     /* records the kernel handed to trace_events */
    u64 over_limit;  /* calls past max_records: counted, not recorded */
    u64 drops;       /* records trace_events had no room for */
    u64 max_records;
    u32 active;
    u32 pad;
};
struct gg_tlayout {
    u32 capture_len; /* bytes of the block to read at entry (<= GG_TRACE_CAPTURE) */
    u32 status_off;  /* where the u32 status sits, GG_TRACE_NO_STATUS when there is none */
};
/* One traced call between its entry and exit, per thread (a thread is in one syscall at a time). */
struct gg_tcall {
    u64 ts_ns;
    u64 block_ptr; /* user address of the (inner) parameter block */
    u64 a0, a1, a2;
    u32 kind;
    u32 slots;
    s32 fd;
    u32 dev_id;
    u32 request;
    u32 status_off;
    u32 xfer_nr;
    u32 xfer_size;
    u32 flags;
    u32 block_len;
    u8 block[64]; /* GG_TRACE_CAPTURE used; 64 so the verifier's bound (n & 63) fits the buffer */
};
/* 160 bytes, no implicit padding: struct format TREC in tracer/trace_kernel.py. */
struct gg_trec {
    u64 ts_ns;     /* entry, CLOCK_BOOTTIME */
    u64 dur_ns;    /* exit - entry; 0 for instants */
    u64 cgroup_id;
    u64 a0;        /* ioctl: block address; mmap: length; munmap: address; open: flags */
    u64 a1;        /* mmap: prot << 32 | flags; munmap: length */
    u64 a2;        /* mmap: offset; fork: child pid */
    s64 ret;
    u32 kind;
    u32 slots;     /* the sessions (bit per slot) that took this record */
    u32 tgid;
    u32 tid;
    s32 fd;
    u32 dev_id;
    u32 request;
    u32 status;
    u32 xfer_nr;
    u32 xfer_size;
    u32 flags;
    u32 block_len;
    u8 block[GG_TRACE_CAPTURE];
};
struct gg_tmap_key {
    u32 tgid;
    u32 pad;
    u64 addr;
};
struct gg_tmap_val {
    u64 len;
    u32 dev_id;
    s32 fd;
};

BPF_ARRAY(trace_on, u64, 1); /* active slots, written by user space: 0 = every helper returns at once */
BPF_ARRAY(trace_slots, struct gg_tslot, GG_TRACE_SLOTS);
BPF_HASH(trace_cgroups, u64, u32, GG_TRACE_MAX_CGROUPS); /* cgroup id -> slot mask */
BPF_HASH(trace_tgids, u32, u32, GG_TRACE_MAX_TGIDS);     /* tgid -> slot mask (forks inherit it) */
/* A pid scope keeps to the cgroups its process was in when the session started (its container's,
 * or its own cgroup on the host): a descendant in any other cgroup (one that joined another
 * container, as `runc exec` does, then exec'd) is out of that slot's scope, and at its exec it
 * leaves the slot for good. trace_pinned: the slots whose pid scope is pinned so; trace_pincg:
 * cgroup id -> the pinned slots that may run there. */
BPF_ARRAY(trace_pinned, u32, 1);
BPF_HASH(trace_pincg, u64, u32, GG_TRACE_MAX_CGROUPS);
BPF_HASH(trace_layout, u32, struct gg_tlayout, 1024);    /* effective request word -> layout */
/* traced fork child -> parent tgid, until user space seeds the child's fds or it execs; LRU so a
 * child that outlived every session (its entry is cleared when the last one ends) cannot fill it */
BPF_TABLE("lru_hash", u32, u32, trace_forked, GG_TRACE_MAX_TGIDS);
BPF_TABLE("lru_hash", u32, struct gg_tcall, trace_inflight, GG_TRACE_INFLIGHT);
BPF_TABLE("lru_hash", struct gg_tmap_key, struct gg_tmap_val, trace_maps, GG_TRACE_INFLIGHT); /* traced mappings */
BPF_PERCPU_ARRAY(trace_tmp, struct gg_tcall, 1); /* too big for the 512-byte stack with the rest */
BPF_RINGBUF_OUTPUT(trace_events, GG_TRACE_RINGBUF_PAGES);

/* Of a tgid's pid-scope slots `mask`, those whose pin lets it run in `cgroup_id`. */
static __always_inline u32 gg_trace_pinned(u32 mask, u64 cgroup_id)
{
    u32 zero = 0;
    u32 *pinned = trace_pinned.lookup(&zero);
    u32 held = pinned ? (*pinned & mask) : 0;
    if (!held)
        return mask;
    u32 *ok = trace_pincg.lookup(&cgroup_id);
    return mask & (~held | (ok ? *ok : 0));
}

/* Whether any session runs (one inlined array load). */
static __always_inline bool gg_trace_any(void)
{
    u32 zero = 0;
    u64 *on = trace_on.lookup(&zero);
    return !on || *on != 0;
}

/* The slot mask of the sessions this task is in, 0 when none (nearly always one array load). */
static __always_inline u32 gg_trace_scope(u32 tgid)
{
    u32 zero = 0;
    u64 *on = trace_on.lookup(&zero);
    if (!on || *on == 0)
        return 0;
    u32 *mask = trace_tgids.lookup(&tgid);
    u64 cgroup_id = bpf_get_current_cgroup_id();
    u32 slots = mask ? gg_trace_pinned(*mask, cgroup_id) : 0;
    u32 *by_cgroup = trace_cgroups.lookup(&cgroup_id);
    if (by_cgroup)
        slots |= *by_cgroup;
    return slots;
}

/* Of `slots`, those with room for one more record (counting the call for the others). Bounded
 * loop over the slots: the verifier unrolls it. */
static __always_inline u32 gg_trace_admit(u32 slots)
{
    u32 admitted = 0;
#pragma unroll
    for (u32 i = 0; i < GG_TRACE_SLOTS; i++) {
        if (!(slots & (1u << i)))
            continue;
        u32 key = i;
        struct gg_tslot *st = trace_slots.lookup(&key);
        if (!st || !st->active)
            continue;
        if (st->records >= st->max_records) {
            __sync_fetch_and_add(&st->over_limit, 1);
            continue;
        }
        admitted |= 1u << i;
    }
    return admitted;
}

/* Account a record as taken (or lost for want of ring-buffer room) by each admitted slot. */
static __always_inline void gg_trace_account(u32 slots, bool taken)
{
#pragma unroll
    for (u32 i = 0; i < GG_TRACE_SLOTS; i++) {
        if (!(slots & (1u << i)))
            continue;
        u32 key = i;
        struct gg_tslot *st = trace_slots.lookup(&key);
        if (!st)
            continue;
        if (taken)
            __sync_fetch_and_add(&st->records, 1);
        else
            __sync_fetch_and_add(&st->drops, 1);
    }
}

static __always_inline struct gg_trec *gg_trace_reserve(u32 slots)
{
    struct gg_trec *r = trace_events.ringbuf_reserve(sizeof(struct gg_trec));
    gg_trace_account(slots, r != NULL);
    return r;
}

/* An instant record (open, close, mmap without exit, fork, exec, exit). */
static __always_inline void gg_trace_instant(u32 kind, u32 tgid, u32 tid, s32 fd, u32 dev_id, s64 ret,
                                             u64 a0, u64 a1, u64 a2)
{
    u32 slots = gg_trace_scope(tgid);
    if (!slots)
        return;
    slots = gg_trace_admit(slots);
    if (!slots)
        return;
    struct gg_trec *r = gg_trace_reserve(slots);
    if (!r)
        return;
    __builtin_memset(r, 0, sizeof(*r));
    r->ts_ns = bpf_ktime_get_boot_ns();
    r->cgroup_id = bpf_get_current_cgroup_id();
    r->a0 = a0;
    r->a1 = a1;
    r->a2 = a2;
    r->ret = ret;
    r->kind = kind;
    r->slots = slots;
    r->tgid = tgid;
    r->tid = tid;
    r->fd = fd;
    r->dev_id = dev_id;
    trace_events.ringbuf_submit(r, 0);
}

/* The in-flight slot of a call entering now, filled with what every kind shares; NULL when the
 * caller is in no session or every session it is in is full (the call is counted there). */
static __always_inline struct gg_tcall *gg_trace_begin(u32 tgid, u32 kind, s32 fd, u32 dev_id)
{
    u32 slots = gg_trace_scope(tgid);
    if (!slots)
        return NULL;
    slots = gg_trace_admit(slots);
    if (!slots)
        return NULL;
    u32 zero = 0;
    struct gg_tcall *c = trace_tmp.lookup(&zero);
    if (!c)
        return NULL;
    __builtin_memset(c, 0, sizeof(*c));
    c->ts_ns = bpf_ktime_get_boot_ns();
    c->kind = kind;
    c->slots = slots;
    c->fd = fd;
    c->dev_id = dev_id;
    return c;
}

/* ioctl entry on a GPU fd (ioctl.bpf.c): keep the call in flight with the fixed bytes of its
 * parameter block. The layout (how many bytes, where the status is) comes from trace_layout,
 * which user space fills for the running driver version. */
static __always_inline void gg_trace_ioctl_enter(u32 tgid, u32 tid, s32 fd, u32 dev_id, u32 request, u64 arg)
{
    struct gg_tcall *c = gg_trace_begin(tgid, GG_TK_IOCTL, fd, dev_id);
    if (!c)
        return;
    c->request = request;
    u64 block = arg;
    u32 eff = request;
    if ((request & 0xFFFF) == GG_NV_TYPE_NR_XFER) {
        /* nv_ioctl_xfer_t {u32 cmd @0, u32 size @4, NvP64 ptr @8}: the real escape is inside. */
        struct { u32 cmd; u32 size; u64 ptr; } x = {};
        if (bpf_probe_read_user(&x, sizeof(x), (const void *)arg) == 0) {
            c->xfer_nr = x.cmd;
            c->xfer_size = x.size;
            c->flags |= GG_TF_XFER;
            block = x.ptr;
            eff = 0xC0000000u | ((x.size & 0x3FFFu) << 16) | 0x4600u | (x.cmd & 0xFFu);
        }
    }
    c->block_ptr = block;
    u32 n = 0;
    struct gg_tlayout *l = trace_layout.lookup(&eff);
    if (l) {
        n = l->capture_len;
        c->status_off = l->status_off;
    } else {
        /* A call the tables do not know: its _IOC size when it has one, and no status. */
        n = ((eff >> 8) & 0xFF) == 0x46 ? (eff >> 16) & 0x3FFF : 0;
        c->status_off = GG_TRACE_NO_STATUS;
    }
    if (n > GG_TRACE_CAPTURE)
        n = GG_TRACE_CAPTURE;
    /* clang may keep the clamp in another register than the one passed: bound it where used. */
    asm volatile("%[n] &= 0x3f" : [n] "+r"(n));
    if (n > 0 && bpf_probe_read_user(c->block, n, (const void *)block) == 0)
        c->block_len = n;
    if (trace_inflight.update(&tid, c) == 0)
        gg_mark_call(tid, GG_PB_TRACE); /* the ioctl exit (ioctl.bpf.c) takes it */
}

/* mmap entry on a GPU fd (ioctl.bpf.c): the exit gives the address (for munmap) and the result. */
static __always_inline void gg_trace_mmap_enter(u32 tgid, u32 tid, s32 fd, u32 dev_id, u64 len, u64 prot,
                                                u64 flags, u64 off)
{
    struct gg_tcall *c = gg_trace_begin(tgid, GG_TK_MMAP, fd, dev_id);
    if (!c)
        return;
    c->a0 = len;
    c->a1 = (prot << 32) | (flags & 0xFFFFFFFFull);
    c->a2 = off;
    trace_inflight.update(&tid, c);
}

/* Take this thread's in-flight call of `kind` and emit it with its exit. */
static __always_inline int gg_trace_exit(u32 kind, s64 ret)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    struct gg_tcall *c = trace_inflight.lookup(&tid);
    if (!c)
        return 0;
    if (c->kind != kind) /* left by a call whose exit hook was not attached yet */
        return 0;
    struct gg_trec *r = gg_trace_reserve(c->slots);
    if (r) {
        u64 now = bpf_ktime_get_boot_ns();
        r->ts_ns = c->ts_ns;
        r->dur_ns = now > c->ts_ns ? now - c->ts_ns : 0;
        r->cgroup_id = bpf_get_current_cgroup_id();
        r->a0 = kind == GG_TK_IOCTL ? c->block_ptr : c->a0;
        r->a1 = c->a1;
        r->a2 = c->a2;
        r->ret = ret;
        r->kind = kind;
        r->slots = c->slots;
        r->tgid = (u32)(id >> 32);
        r->tid = tid;
        r->fd = c->fd;
        r->dev_id = c->dev_id;
        r->request = c->request;
        r->status = 0;
        r->xfer_nr = c->xfer_nr;
        r->xfer_size = c->xfer_size;
        r->flags = c->flags;
        r->block_len = c->block_len;
        __builtin_memcpy(r->block, c->block, GG_TRACE_CAPTURE);
        u32 off = c->status_off;
        /* The driver copies the whole block back whatever it returns (nv.c, uvm.c): the status is
         * read after the call, at the offset of this driver's layout. */
        if (kind == GG_TK_IOCTL && off < GG_TRACE_MAX_STATUS_OFF) {
            u32 st = 0;
            if (bpf_probe_read_user(&st, sizeof(st), (const void *)(c->block_ptr + off)) == 0) {
                r->status = st;
                r->flags |= GG_TF_STATUS;
            }
        }
        trace_events.ringbuf_submit(r, 0);
        /* mmap returns an address or -errno (-4095..-1): remember a mapping for its munmap. */
        if (kind == GG_TK_MMAP && !(ret < 0 && ret >= -4095L)) {
            struct gg_tmap_key mk = {.tgid = (u32)(id >> 32), .addr = (u64)ret};
            struct gg_tmap_val mv = {.len = c->a0, .dev_id = c->dev_id, .fd = c->fd};
            trace_maps.update(&mk, &mv);
        }
    }
    trace_inflight.delete(&tid);
    return 0;
}

/* task_newtask of a process (not a thread) whose parent is in scope: a pid scope takes in the
 * child (its tgid inherits the parent's slot mask), and every scope records the FORK. */
static __always_inline void gg_trace_fork(u32 tgid, u32 tid, u32 child)
{
    u32 slots = gg_trace_scope(tgid);
    if (!slots)
        return;
    u32 *mask = trace_tgids.lookup(&tgid);
    if (mask) {
        u32 inherited = gg_trace_pinned(*mask, bpf_get_current_cgroup_id());
        if (inherited)
            trace_tgids.update(&child, &inherited);
    }
    trace_forked.update(&child, &tgid);
    gg_trace_instant(GG_TK_FORK, tgid, tid, -1, 0, 0, 0, 0, child);
}

/* A traced fork child calls on its inherited fds before user space has read its fd table and
 * seeded fds (it cannot be done from here without reading kernel structs): until then its fd
 * is the parent's. Only for a holder (the fork hook made the child one) while a session runs. */
static __always_inline struct gg_fd_val *gg_trace_inherited_fd(u32 tgid, s32 fd)
{
    u32 zero = 0;
    u64 *on = trace_on.lookup(&zero);
    if (!on || *on == 0)
        return NULL;
    u32 *parent = trace_forked.lookup(&tgid);
    if (!parent)
        return NULL;
    struct gg_fd_key fk = {.tgid = *parent, .fd = fd};
    return fds.lookup(&fk);
}

/* The whole thread group is gone: record it, and drop the tgid from the pid scope (the number
 * will be reused by a process that is not in it). */
static __always_inline void gg_trace_gone(u32 tgid, u32 tid)
{
    if (!gg_trace_scope(tgid))
        return;
    gg_trace_instant(GG_TK_EXIT, tgid, tid, -1, 0, 0, 0, 0, 0);
    trace_tgids.delete(&tgid);
    trace_forked.delete(&tgid);
}

/* exec: record it, and stop resolving fds through the parent (the new image's fd numbers are its
 * own; a CLOEXEC GPU fd of the parent's may be reused for anything). */
static __always_inline void gg_trace_exec(u32 tgid, u32 tid)
{
    u32 zero = 0;
    u64 *on = trace_on.lookup(&zero);
    if (!on || *on == 0)
        return;
    u32 *mask = trace_tgids.lookup(&tgid);
    if (mask) {  /* exec'd outside its pin (another container's cgroup): it leaves those slots */
        u32 kept = gg_trace_pinned(*mask, bpf_get_current_cgroup_id());
        if (kept != *mask) {
            if (kept)
                trace_tgids.update(&tgid, &kept);
            else
                trace_tgids.delete(&tgid);
        }
    }
    if (!gg_trace_scope(tgid))
        return;
    gg_trace_instant(GG_TK_EXEC, tgid, tid, -1, 0, 0, 0, 0, 0);
    trace_forked.delete(&tgid);
}

TRACEPOINT_PROBE(syscalls, sys_exit_mmap)
{
    if (!gg_maybe_holder((u32)(bpf_get_current_pid_tgid() >> 32)))
        return 0;
    return gg_trace_exit(GG_TK_MMAP, args->ret);
}

TRACEPOINT_PROBE(syscalls, sys_enter_munmap)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = (u32)(id >> 32);
    if (!gg_maybe_holder(tgid))
        return 0;
    struct gg_tmap_key mk = {.tgid = tgid, .addr = (u64)args->addr};
    struct gg_tmap_val *mv = trace_maps.lookup(&mk);
    if (!mv)
        return 0;
    u32 dev_id = mv->dev_id;
    trace_maps.delete(&mk);
    gg_trace_instant(GG_TK_MUNMAP, tgid, (u32)id, -1, dev_id, 0, (u64)args->addr, (u64)args->len, 0);
    return 0;
}
