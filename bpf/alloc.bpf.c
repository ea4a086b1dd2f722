/* alloc.bpf.c: always-on capture of the rare allocation calls, per tgid: what tells a GPU job from
 * a monitoring client (nvidia-smi, nvitop, dcgm-exporter), which only reads state (the `monitor`
 * class). tracer/gpu_work.py reads and judges what is kept here.
 *
 * Only ioctl.bpf.c calls in, on an fd it already knows is a GPU fd: a non-GPU call never gets
 * here, and a GPU call that is no allocation leaves after a compare of its request word (an XFER
 * pays a 16-byte user read to learn the escape it carries). An allocation pays one user read of
 * its block's first 16 bytes, an inlined array load (the class's category) and one hash update.
 * Calls are taken at entry, like mmap: a refused allocation still counts, which errs towards
 * "did work", the side that raises an alert.
 *
 * The category of each RM class id comes from user space (tracer/gpu_work.py category_table()),
 * so the kernel holds no class list: every rule and source citation lives in one place.
 */

/* Escape numbers (src/nvidia/arch/nvalloc/unix/include/nv_escape.h, docs/reference/
 * nvidia-ioctl-abi.md §2): the request word's low 16 bits are 'F' << 8 | nr. */
#define GG_NV_TYPE 0x46u
#define GG_ESC_RM_ALLOC_MEMORY 0x27u  /* nv_ioctl_nvos02_parameters_with_fd: hClass@12 */
#define GG_ESC_RM_ALLOC_OBJECT 0x28u  /* NVOS05_PARAMETERS: hClass@12 */
#define GG_ESC_RM_ALLOC 0x2Bu         /* NVOS21 / NVOS64: hClass@12 in every release (escape.c asserts it) */
#define GG_ESC_RM_VID_HEAP_CONTROL 0x4Au /* NVOS32_PARAMETERS: function@8 */
#define GG_ESC_IOCTL_XFER_CMD 0xD3u   /* nv_ioctl_xfer_t {cmd@0, size@4, ptr@8}: carries another escape */
#define GG_HEAP_ALLOC_SIZE 2u          /* NVOS32_FUNCTION_ALLOC_SIZE (nvos.h) */
#define GG_HEAP_ALLOC_OS_DESCRIPTOR 27u /* NVOS32_FUNCTION_ALLOC_OS_DESCRIPTOR (nvos.h) */

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

#ifndef GG_MAX_ALLOCS
#define GG_MAX_ALLOCS 8192
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

BPF_ARRAY(alloc_classes, struct gg_alloc_page, 256); /* 64 KiB, written once by user space at start */
/* tgid -> what it allocated. Kept after EXIT like the ioctl counters; BpfSource.forget drops it. */
BPF_HASH(alloc_work, u32, struct gg_alloc_val, GG_MAX_ALLOCS);

/* The category of RM class id `cls` (a 32-bit NvV32; every class id fits 16 bits). */
static __always_inline u32 gg_alloc_category(u32 cls)
{
    if (cls >> 16)
        return GG_AC_UNKNOWN; /* no such class: RM answers NV_ERR_INVALID_CLASS */
    u32 page = cls >> 8;
    struct gg_alloc_page *p = alloc_classes.lookup(&page);
    return p ? p->cat[cls & 0xFF] : GG_AC_UNSET;
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

/* ioctl entry on a GPU fd of tgid (ioctl.bpf.c). */
static __always_inline void gg_alloc_ioctl(u32 tgid, u32 request, u64 arg)
{
    if (((request >> 8) & 0xFF) != GG_NV_TYPE) /* UVM numbers and other families */
        return;
    u32 nr = request & 0xFF;
    u64 block = arg;
    if (nr == GG_ESC_IOCTL_XFER_CMD) {
        struct { u32 cmd; u32 size; u64 ptr; } x = {};
        if (bpf_probe_read_user(&x, sizeof(x), (const void *)arg) != 0)
            return;
        nr = x.cmd & 0xFF; /* a bare nr, not an _IOC word (nv.c) */
        block = x.ptr;
    }
    if (nr != GG_ESC_RM_ALLOC && nr != GG_ESC_RM_ALLOC_MEMORY && nr != GG_ESC_RM_ALLOC_OBJECT &&
        nr != GG_ESC_RM_VID_HEAP_CONTROL)
        return;
    /* The first 16 bytes: function@8 (NVOS32) and hClass@12 (every alloc block), at the same
     * offsets in every driver release compared (docs/reference/nvidia-ioctl-abi.md §3, §5.2). */
    u32 head[4] = {};
    if (bpf_probe_read_user(head, sizeof(head), (const void *)block) != 0)
        return;
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
