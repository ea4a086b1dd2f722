/* alloc.bpf.c: two always-on captures of the rare RM allocation calls of GPU fds.
 *
 * 1. Per tgid, what its allocation calls named (alloc_work): what tells a GPU job from a
 *    monitoring client (nvidia-smi, nvitop, dcgm-exporter), which only reads state (the `monitor`
 *    class). tracer/gpu_work.py reads and judges it. Taken at entry, like mmap: a refused
 *    allocation still counts, which errs towards "did work", the side that raises an alert.
 * 2. Memory calls the driver accepted, one record each (GG_EV_MEMCALL in the events ring buffer,
 *    decoded into tracer/memcalls.py MemCall; tracer/gpu_memory.py keeps the RM object tree):
 *    RM_ALLOC, RM_ALLOC_OBJECT, RM_ALLOC_MEMORY, RM_FREE, RM_DUP_OBJECT and RM_VID_HEAP_CONTROL's
 *    ALLOC_SIZE and FREE, directly or inside NV_ESC_IOCTL_XFER_CMD. The entry stashes the block's
 *    address per thread (mem_stash) and sets the thread's pending byte; the exit (ioctl.bpf.c)
 *    reads the block back and emits the call only when the ioctl returned 0 and the block's
 *    status is NV_OK (docs/reference/nvidia-ioctl-abi.md §1 steps 4-5: the driver copies the whole
 *    block back, RM's outcome is only in the status). A closed fd that owned an RM client emits
 *    CLOSE (fd.bpf.c calls gg_mem_fd_gone): RM frees the clients of a file when it is released.
 *
 * Only ioctl.bpf.c calls in, on an fd it already knows is a GPU fd: a non-GPU call never gets
 * here, and a GPU call that is none of these leaves after a compare of its request word (an XFER
 * pays a 16-byte user read to learn the escape it carries). An allocation pays one user read of
 * its block's first 16 bytes, an inlined array load (the class's byte) and one hash update; each
 * memory call one LRU update at entry, and at exit one lookup, one user read of its block (and of
 * pAllocParms for the classes that say so) and one ring-buffer record.
 *
 * The category and the read bits of each RM class id come from user space (tracer/gpu_work.py
 * category_table()), so the kernel holds no class list: every rule and source citation lives in
 * one place.
 */

/* Escape numbers (src/nvidia/arch/nvalloc/unix/include/nv_escape.h, docs/reference/
 * nvidia-ioctl-abi.md §2): the request word's low 16 bits are 'F' << 8 | nr. */
#define GG_NV_TYPE 0x46u
#define GG_ESC_RM_ALLOC_MEMORY 0x27u  /* nv_ioctl_nvos02_parameters_with_fd: hClass@12 */
#define GG_ESC_RM_ALLOC_OBJECT 0x28u  /* NVOS05_PARAMETERS: hClass@12 */
#define GG_ESC_RM_FREE 0x29u          /* NVOS00_PARAMETERS */
#define GG_ESC_RM_DUP_OBJECT 0x34u    /* NVOS55_PARAMETERS */
#define GG_ESC_RM_ALLOC 0x2Bu         /* NVOS21 / NVOS64: hClass@12 in every release (escape.c asserts it) */
#define GG_ESC_RM_VID_HEAP_CONTROL 0x4Au /* NVOS32_PARAMETERS: function@8 */
#define GG_ESC_IOCTL_XFER_CMD 0xD3u   /* nv_ioctl_xfer_t {cmd@0, size@4, ptr@8}: carries another escape */
#define GG_HEAP_ALLOC_SIZE 2u          /* NVOS32_FUNCTION_ALLOC_SIZE (nvos.h) */
#define GG_NVOS32_FUNCTION_FREE 3u      /* NVOS32_FUNCTION_FREE (nvos.h) */
#define GG_HEAP_ALLOC_OS_DESCRIPTOR 27u /* NVOS32_FUNCTION_ALLOC_OS_DESCRIPTOR (nvos.h) */
/* NVOS32_ALLOC_FLAGS_VIRTUAL (src/common/sdk/nvidia/inc/nvos.h) in AllocSize.flags: RM makes an
 * NV50_MEMORY_VIRTUAL object, a VA reservation with no memory behind it. */
#define GG_NVOS32_ALLOC_FLAGS_VIRTUAL 0x00080000u
#define GG_NV50_MEMORY_VIRTUAL 0x50A0u /* cl50a0.h */

/* Categories: tracer/gpu_work.py Category mirrors these numbers. From GG_AC_MEMORY up a call is
 * work: memory, a VA space, a channel, a compute/copy/3D engine. */
#define GG_AC_UNSET 0   /* the class table was never written: nothing can be judged */
#define GG_AC_QUERY 1   /* root client, device, subdevice, events, ...: what an NVML client allocates */
#define GG_AC_OTHER 2   /* a known class that is neither (profiler, debugger, MIG reference, ...) */
#define GG_AC_UNKNOWN 3 /* an id the tables do not name and no family rule covers */
#define GG_AC_MEMORY 4
#define GG_AC_CHANNEL 5
#define GG_AC_ENGINE 6
#define GG_AC_SLOTS 8
#define GG_CATEGORY_MASK 0x07u /* the category: the low bits of a class's byte */

/* The class byte's other bits: what the memory-call exit reads from pAllocParms after the call
 * (tracer/gpu_work.py ClassBit mirrors them; docs/reference/nvidia-ioctl-abi.md §4.1). */
#define GG_CB_MEM_PARAMS 0x08u /* NV_MEMORY_ALLOCATION_PARAMS (nvos.h): attr@24, size@64 (u64) */
#define GG_CB_INSTANCE 0x10u   /* u32 @0: NV0080_ALLOC_PARAMETERS.deviceId (cl0080.h),
                                * NV2080_ALLOC_PARAMETERS.subDeviceId (cl2080.h) */
#define GG_CB_CLIENT 0x20u     /* an RM client: the file it was allocated through owns it */

/* Block sizes and status offsets that every compared release shares (nvos.h,
 * nv-unix-nvos-params-wrappers.h; docs/reference/nvidia-ioctl-abi.md §3.3, §3.4, §5.2). RM_ALLOC's
 * depend on the release: GG_NVOS21_STATUS, GG_NVOS64_SIZE and GG_NVOS64_STATUS come in as -D
 * flags (tracer/bpf_build.py rm_alloc_layout). */
#define GG_NVOS00_SIZE 16  /* RM_FREE: hRoot@0 hObjectParent@4 hObjectOld@8 status@12 */
#define GG_NVOS00_STATUS 12
#define GG_NVOS05_SIZE 20  /* RM_ALLOC_OBJECT: hRoot@0 parent@4 new@8 hClass@12 status@16 */
#define GG_NVOS05_STATUS 16
#define GG_NVOS55_SIZE 28  /* RM_DUP_OBJECT: hClient@0 hParent@4 hObject@8 hClientSrc@12 hObjectSrc@16 */
#define GG_NVOS55_STATUS 24
#define GG_NVOS02FD_SIZE 56 /* RM_ALLOC_MEMORY: NVOS02 + fd; flags@16 limit@32 (u64) status@40 */
#define GG_NVOS02_STATUS 40
#define GG_NVOS32_SIZE 184 /* RM_VID_HEAP_CONTROL: function@8 status@20, data union @40 */
#define GG_NVOS32_STATUS 20
#define GG_NVOS21_SIZE 32
#ifndef GG_NVOS21_STATUS /* 595.45.04, the baseline */
#define GG_NVOS21_STATUS 28
#define GG_NVOS64_SIZE 48
#define GG_NVOS64_STATUS 40
#endif
#define GG_MEM_READ 96 /* bytes of a block read back: all of every block but NVOS32, whose fields
                        * end with size@88 (8): NVOS32 AllocSize at data@40, size@48 */

/* MemCall kinds: tracer/memcalls.py MemCallKind mirrors these numbers. */
#define GG_MC_ALLOC 1
#define GG_MC_ALLOC_MEMORY 2
#define GG_MC_HEAP_ALLOC 3
#define GG_MC_HEAP_FREE 4
#define GG_MC_FREE 5
#define GG_MC_DUP 6
#define GG_MC_CLOSE 7

#define GG_MCF_INSTANCE 1u /* gg_memcall.instance is set */

#ifndef GG_MAX_ALLOCS
#define GG_MAX_ALLOCS 8192
#endif
#ifndef GG_MAX_MEM_INFLIGHT
#define GG_MAX_MEM_INFLIGHT 4096 /* threads inside a memory call at once */
#endif
#ifndef GG_MAX_MEM_CLIENTS
#define GG_MAX_MEM_CLIENTS 2048 /* (tgid, fd) that own an accepted RM client */
#endif

struct gg_alloc_page {
    u8 cat[256]; /* category of class (page << 8 | i) */
};
/* 24 bytes: struct ALLOC in tracer/gpu_work.py. */
struct gg_alloc_val {
    u64 first;     /* the first work call: nr << 32 | hClass (VID_HEAP_CONTROL: | function); 0 = none */
    u32 calls;     /* allocation escapes seen, of every category */
    u32 from_tgid; /* != 0: the record was copied from this parent at fork, then grew on its own */
    u8 seen[GG_AC_SLOTS]; /* seen[c] = 1 once a call of category c came; bytes, so two CPUs never
                           * lose each other's store (a bit mask would need atomic OR, -mcpu=v3) */
};

/* A memory call between its entry and its exit, per thread. */
struct gg_mstash {
    u64 ts_ns;  /* entry, CLOCK_BOOTTIME */
    u64 block;  /* user address of the (inner) parameter block */
    u32 nr;     /* the escape (the inner one for an XFER) */
    u32 size;   /* the block's size: _IOC_SIZE, or the XFER's size */
    s32 fd;
    u32 dev_id;
};
/* 88 bytes, no implicit padding: struct MEMCALL in tracer/bpf_source.py. The first 36 bytes are
 * struct gg_event's (ts_ns .. dev_id), so one reader tells the kinds apart. */
struct gg_memcall {
    u64 ts_ns;     /* the call's entry */
    u64 cgroup_id;
    u32 kind;      /* GG_EV_MEMCALL */
    u32 tgid;
    u32 tid;
    s32 fd;
    u32 dev_id;
    u32 mkind;     /* GG_MC_* */
    u32 h_root;    /* DUP: hClient */
    u32 h_parent;
    u32 h_object;  /* ALLOC*: the new handle as RM wrote it back; FREE: hObjectOld; HEAP_*: hMemory */
    u32 h_class;   /* ALLOC, ALLOC_MEMORY: as RM wrote it back (a client comes back as 0x41) */
    u64 size;      /* bytes RM allocated: NV_MEMORY_ALLOCATION_PARAMS.size, NVOS32 size, limit + 1 */
    u32 attr;      /* NV_MEMORY_ALLOCATION_PARAMS.attr, NVOS32 attr; ALLOC_MEMORY: NVOS02 flags */
    u32 instance;  /* deviceId / subDeviceId when flags & GG_MCF_INSTANCE */
    u32 src_client;
    u32 src_object;
    u32 flags;
    u32 pad;
};

BPF_ARRAY(alloc_classes, struct gg_alloc_page, 256); /* 64 KiB, written once by user space at start */
/* tgid -> what it allocated. Kept after EXIT like the ioctl counters; BpfSource.forget drops it. */
BPF_HASH(alloc_work, u32, struct gg_alloc_val, GG_MAX_ALLOCS);
/* tid -> its memory call in flight. LRU: a thread that died inside the call (its exit never came)
 * is evicted, never leaked; an entry evicted while its call still runs is counted (MEM_LOST). */
BPF_TABLE("lru_hash", u32, struct gg_mstash, mem_stash, GG_MAX_MEM_INFLIGHT);
/* (tgid, fd) that allocated an RM client, for the CLOSE of that fd. Deleted at the close; a
 * process's leftovers (exit, exec of close-on-exec fds) by user space (BpfSource.forget, sweep). */
BPF_HASH(mem_clients, struct gg_fd_key, u32, GG_MAX_MEM_CLIENTS);
/* Threads with GG_PB_MEM set in their byte, node-wide: almost always 0, which lets every ioctl
 * exit (with no trace session either) return after two inlined array loads, before even the
 * helper call that names the thread. Bumped with XADD, a full barrier: a thread's exit sees its
 * own entry's increment wherever it runs. */
BPF_ARRAY(mem_inflight, u64, 1);

/* The byte of RM class id `cls` (a 32-bit NvV32; every class id fits 16 bits): its category in
 * the low bits, GG_CB_* above. GG_AC_UNSET when the table was never written. */
static __always_inline u32 gg_class_byte(u32 cls)
{
    if (cls >> 16)
        return GG_AC_UNKNOWN; /* no such class: RM answers NV_ERR_INVALID_CLASS */
    u32 page = cls >> 8;
    struct gg_alloc_page *p = alloc_classes.lookup(&page);
    return p ? p->cat[cls & 0xFF] : GG_AC_UNSET;
}

static __always_inline u32 gg_alloc_category(u32 cls)
{
    return gg_class_byte(cls) & GG_CATEGORY_MASK;
}

static __always_inline void gg_alloc_record(u32 tgid, u32 cat, u64 first)
{
    struct gg_alloc_val *v = alloc_work.lookup(&tgid);
    if (!v) {
        struct gg_alloc_val init = {};
        alloc_work.insert(&tgid, &init); /* fails when another thread inserted first, or when full */
        v = alloc_work.lookup(&tgid);
        if (!v) {
            gg_stat(GG_STAT_ALLOCS_FULL); /* user space then trusts no empty record (gpu_work.py) */
            return;
        }
    }
    __sync_fetch_and_add(&v->calls, 1);
    if (cat < GG_AC_SLOTS)
        v->seen[cat & (GG_AC_SLOTS - 1)] = 1;
    /* One aligned 8-byte store: two threads racing both write a whole (nr, class) pair. */
    if (cat >= GG_AC_MEMORY && v->first == 0)
        v->first = first;
}

/* Whether (escape, block size) is one the memory-call exit decodes: the size is the driver's
 * own check (nv_validate_ioctls, RmValidateIoctl), so a call of another size fails anyway. */
static __always_inline bool gg_mem_block_ok(u32 nr, u32 size)
{
    switch (nr) {
    case GG_ESC_RM_ALLOC:
        return size == GG_NVOS21_SIZE || size == GG_NVOS64_SIZE;
    case GG_ESC_RM_ALLOC_OBJECT:
        return size == GG_NVOS05_SIZE;
    case GG_ESC_RM_ALLOC_MEMORY:
        return size == GG_NVOS02FD_SIZE;
    case GG_ESC_RM_FREE:
        return size == GG_NVOS00_SIZE;
    case GG_ESC_RM_DUP_OBJECT:
        return size == GG_NVOS55_SIZE;
    case GG_ESC_RM_VID_HEAP_CONTROL:
        return size == GG_NVOS32_SIZE;
    }
    return false;
}

static __always_inline void gg_mem_inflight_add(s64 delta)
{
    u32 zero = 0;
    u64 *n = mem_inflight.lookup(&zero);
    if (n)
        __sync_fetch_and_add(n, (u64)delta);
}

/* Keep a memory call for the exit to read back (gg_mem_exit). Only a thread that has a byte: its
 * exit must be able to tell it stashed something. */
static __always_inline void gg_mem_stash(u32 tid, s32 fd, u32 dev_id, u32 nr, u32 size, u64 block)
{
    if (!gg_mem_block_ok(nr, size))
        return;
    u32 slot = tid >> 12;
    struct gg_byte_slot *s = pending_bytes.lookup(&slot);
    if (!s)
        return;
    struct gg_mstash st = {.ts_ns = bpf_ktime_get_boot_ns(), .block = block, .nr = nr, .size = size,
                           .fd = fd, .dev_id = dev_id};
    if (mem_stash.update(&tid, &st) != 0)
        return; /* an LRU map makes room: only a failed allocation lands here */
    u8 b = s->b[tid & 4095];
    if (b & GG_PB_MEM)
        return; /* left by a call whose exit was missed (attached after its entry): counted then */
    s->b[tid & 4095] = b | GG_PB_MEM;
    gg_mem_inflight_add(1);
}

/* A thread dies: a memory call it left in flight (its exit never came) is dropped. */
static __always_inline void gg_mem_thread_gone(u32 tid)
{
    u32 slot = tid >> 12;
    struct gg_byte_slot *s = pending_bytes.lookup(&slot);
    if (!s)
        return;
    u8 b = s->b[tid & 4095];
    if (!(b & (GG_PB_MEM | GG_PB_TRACE)))
        return;
    s->b[tid & 4095] = b & GG_PB_FD;
    if (b & GG_PB_MEM) {
        mem_stash.delete(&tid);
        gg_mem_inflight_add(-1);
    }
}

/* Whether some thread of the node has a memory call in flight (nearly never). */
static __always_inline bool gg_mem_any_inflight(void)
{
    u32 zero = 0;
    u64 *n = mem_inflight.lookup(&zero);
    return !n || *n != 0;
}

/* ioctl entry on a GPU fd (ioctl.bpf.c). */
static __always_inline void gg_alloc_ioctl(u32 tgid, u32 tid, s32 fd, u32 dev_id, u32 request, u64 arg)
{
    if (((request >> 8) & 0xFF) != GG_NV_TYPE) /* UVM numbers and other families */
        return;
    u32 nr = request & 0xFF;
    u32 size = (request >> 16) & 0x3FFF; /* _IOC_SIZE */
    u64 block = arg;
    if (nr == GG_ESC_IOCTL_XFER_CMD) {
        struct { u32 cmd; u32 size; u64 ptr; } x = {};
        if (bpf_probe_read_user(&x, sizeof(x), (const void *)arg) != 0)
            return;
        nr = x.cmd & 0xFF; /* a bare nr, not an _IOC word (nv.c) */
        size = x.size;
        block = x.ptr;
    }
    if (nr != GG_ESC_RM_ALLOC && nr != GG_ESC_RM_ALLOC_MEMORY && nr != GG_ESC_RM_ALLOC_OBJECT &&
        nr != GG_ESC_RM_VID_HEAP_CONTROL && nr != GG_ESC_RM_FREE && nr != GG_ESC_RM_DUP_OBJECT)
        return;
    /* The first 16 bytes: function@8 (NVOS32) and hClass@12 (every alloc block), at the same
     * offsets in every driver release compared (docs/reference/nvidia-ioctl-abi.md §3, §5.2).
     * RM_FREE and RM_DUP_OBJECT need none of it. */
    u32 head[4] = {};
    bool alloc = nr != GG_ESC_RM_FREE && nr != GG_ESC_RM_DUP_OBJECT;
    if (alloc && bpf_probe_read_user(head, sizeof(head), (const void *)block) != 0)
        return;
    /* VID_HEAP_CONTROL: only ALLOC_SIZE and FREE are memory calls (INFO, ... are not). */
    if (nr != GG_ESC_RM_VID_HEAP_CONTROL || head[2] == GG_HEAP_ALLOC_SIZE ||
        head[2] == GG_NVOS32_FUNCTION_FREE)
        gg_mem_stash(tid, fd, dev_id, nr, size, block); /* one call site: see ioctl.bpf.c */
    if (!alloc)
        return; /* no allocation: nothing for alloc_work */
    u32 cls = head[3], cat;
    if (nr == GG_ESC_RM_VID_HEAP_CONTROL) {
        if (head[2] != GG_HEAP_ALLOC_SIZE && head[2] != GG_HEAP_ALLOC_OS_DESCRIPTOR)
            return; /* INFO, FREE, ...: no allocation */
        cls = head[2];
        cat = GG_AC_MEMORY;
    } else if (nr == GG_ESC_RM_ALLOC_MEMORY) {
        cat = GG_AC_MEMORY; /* whatever the class: it allocates or describes memory for RM */
    } else {
        cat = gg_alloc_category(cls);
    }
    gg_alloc_record(tgid, cat, ((u64)nr << 32) | cls);
}

/* ioctl exit of a thread whose byte had GG_PB_MEM (`had_bit`: gg_take_call cleared it, so the
 * in-flight count drops), or that may have stashed (GG_PB_MAYBE). Emits the call only if the
 * driver accepted it. */
static __always_inline void gg_mem_exit(u32 tgid, u32 tid, s64 ret, bool had_bit)
{
    if (had_bit)
        gg_mem_inflight_add(-1);
    struct gg_mstash *p = mem_stash.lookup(&tid);
    if (!p) {
        if (had_bit)
            gg_stat(GG_STAT_MEM_LOST);
        return;
    }
    struct gg_mstash st = *p;
    mem_stash.delete(&tid);
    /* Only ret == 0 is an accepted call (§1 step 5): on -EINVAL, -EIO, -EFAULT the escape was
     * refused and the status field was not written. RM_ALLOC_MEMORY may return -EINVAL although RM
     * allocated (escape.c, when the mmap context cannot be attached to the block's fd): the memory
     * is then freed with the client, and counting it is left out rather than guessed. */
    if (ret != 0) {
        gg_stat(GG_STAT_MEM_FAILED);
        return;
    }
    u64 buf[GG_MEM_READ / 8 + 4] = {};
    u32 n = st.size < GG_MEM_READ ? st.size : GG_MEM_READ;
    /* clang may keep the clamp in another register than the one passed: bound it where used. */
    asm volatile("%[n] &= 0x7f" : [n] "+r"(n));
    if (bpf_probe_read_user(buf, n, (const void *)st.block) != 0) {
        gg_stat(GG_STAT_MEM_FAILED);
        return;
    }
    const u32 *w = (const u32 *)buf;
    struct gg_memcall r = {};
    u32 status = 0, bits = 0;
    switch (st.nr) {
    case GG_ESC_RM_ALLOC: /* hRoot@0 hObjectParent@4 hObjectNew@8 hClass@12 pAllocParms@16 */
        status = st.size == GG_NVOS21_SIZE ? w[GG_NVOS21_STATUS / 4] : w[GG_NVOS64_STATUS / 4];
        r.mkind = GG_MC_ALLOC;
        r.h_class = w[3];
        break;
    case GG_ESC_RM_ALLOC_OBJECT:
        status = w[GG_NVOS05_STATUS / 4];
        r.mkind = GG_MC_ALLOC;
        r.h_class = w[3];
        break;
    case GG_ESC_RM_ALLOC_MEMORY:
        status = w[GG_NVOS02_STATUS / 4];
        r.mkind = GG_MC_ALLOC_MEMORY;
        r.h_class = w[3];
        r.attr = w[4];           /* flags@16 */
        r.size = buf[4] + 1;     /* limit@32: the last byte's offset */
        break;
    case GG_ESC_RM_FREE:
        status = w[GG_NVOS00_STATUS / 4];
        r.mkind = GG_MC_FREE;
        break;
    case GG_ESC_RM_DUP_OBJECT:
        status = w[GG_NVOS55_STATUS / 4];
        r.mkind = GG_MC_DUP;
        r.src_client = w[3];     /* hClientSrc@12 */
        r.src_object = w[4];     /* hObjectSrc@16 */
        break;
    case GG_ESC_RM_VID_HEAP_CONTROL: /* function@8; the data union @40 */
        status = w[GG_NVOS32_STATUS / 4];
        r.mkind = w[2] == GG_HEAP_ALLOC_SIZE ? GG_MC_HEAP_ALLOC : GG_MC_HEAP_FREE;
        r.h_object = w[11];      /* AllocSize/Free.hMemory: data@40 + 4 */
        if (r.mkind == GG_MC_HEAP_ALLOC) {
            r.attr = w[14];      /* AllocSize.attr: data@40 + 16 */
            /* AllocSize.flags: data@40 + 12. The class RM chose; 0: the attr's location decides
             * (tracer/gpu_memory.py counts()). */
            if (w[13] & GG_NVOS32_ALLOC_FLAGS_VIRTUAL)
                r.h_class = GG_NV50_MEMORY_VIRTUAL;
            r.size = buf[11];    /* AllocSize.size: data@40 + 48, what RM really allocated */
        }
        break;
    default:
        return;
    }
    if (status != 0) { /* NV_OK is 0 (nvstatuscodes.h): RM refused the call */
        gg_stat(GG_STAT_MEM_REFUSED);
        return;
    }
    r.h_root = w[0];
    r.h_parent = w[1];
    if (st.nr != GG_ESC_RM_VID_HEAP_CONTROL)
        r.h_object = w[2]; /* written back: RM picks the handle when 0 was passed */
    if (st.nr == GG_ESC_RM_ALLOC) {
        bits = gg_class_byte(r.h_class);
        u64 parms = buf[2];
        if (bits & GG_CB_MEM_PARAMS) { /* what RM wrote back: the size it really allocated */
            bpf_probe_read_user(&r.size, sizeof(r.size), (const void *)(parms + 64));
            bpf_probe_read_user(&r.attr, sizeof(r.attr), (const void *)(parms + 24));
        }
        if ((bits & GG_CB_INSTANCE) &&
            bpf_probe_read_user(&r.instance, sizeof(r.instance), (const void *)parms) == 0)
            r.flags |= GG_MCF_INSTANCE;
    }
    if (bits & GG_CB_CLIENT) {
        struct gg_fd_key ck = {.tgid = tgid, .fd = st.fd};
        u32 one = 1;
        if (mem_clients.update(&ck, &one) != 0)
            gg_stat(GG_STAT_MEM_CLIENTS_FULL);
    }
    r.ts_ns = st.ts_ns;
    r.cgroup_id = bpf_get_current_cgroup_id();
    r.kind = GG_EV_MEMCALL;
    r.tgid = tgid;
    r.tid = tid;
    r.fd = st.fd;
    r.dev_id = st.dev_id;
    if (events.ringbuf_output(&r, sizeof(r), 0) != 0)
        gg_stat(GG_STAT_MEM_DROPS);
}

/* fd of tgid stops referring to its file (close, dup2/dup3 over it, an fd number reused after a
 * close nobody saw): if an RM client was allocated through it, say so. RM frees a file's clients
 * when the file is released (nvidia_close -> rm_cleanup_file_private, kernel-open/nvidia/nv.c); a
 * dup or a fork child may still hold the file: the accountant decides. */
static __always_inline void gg_mem_fd_gone(u32 tgid, u32 tid, s32 fd, u32 dev_id)
{
    struct gg_fd_key ck = {.tgid = tgid, .fd = fd};
    if (!mem_clients.lookup(&ck))
        return;
    if (mem_clients.delete(&ck) != 0)
        return; /* another thread's close won */
    struct gg_memcall r = {};
    r.ts_ns = bpf_ktime_get_boot_ns();
    r.cgroup_id = bpf_get_current_cgroup_id();
    r.kind = GG_EV_MEMCALL;
    r.tgid = tgid;
    r.tid = tid;
    r.fd = fd;
    r.dev_id = dev_id;
    r.mkind = GG_MC_CLOSE;
    if (events.ringbuf_output(&r, sizeof(r), 0) != 0)
        gg_stat(GG_STAT_MEM_DROPS);
}

/* sched_process_fork of a holder (sched.bpf.c): the child shares the parent's fds, and with them
 * the RM objects allocated through them, so it starts with the parent's record. Before the child
 * runs: nothing of its own can be lost to the copy. */
static __always_inline void gg_alloc_fork(u32 parent, u32 child)
{
    struct gg_alloc_val *v = alloc_work.lookup(&parent);
    if (!v) {
        alloc_work.delete(&child); /* a dead process's record under the reused pid, not yet forgotten */
        return;
    }
    struct gg_alloc_val copy = *v;
    copy.from_tgid = parent;
    if (alloc_work.update(&child, &copy) != 0)
        gg_stat(GG_STAT_ALLOCS_FULL);
}
