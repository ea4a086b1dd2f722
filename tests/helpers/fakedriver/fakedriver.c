/* fakedriver: a fake NVIDIA kernel driver as a FUSE file system, for ghostgpu's tests.
 *
 * Usage: fakedriver MOUNTDIR [--driver VERSION] [--gpu PCI_BUS_ID]... [--max-objects N]
 *   MOUNTDIR   an empty directory; served there (mode 0666):
 *                nvidiactl, nvidia0, nvidia1 (one per --gpu), nvidia-uvm: the device files
 *                ghostgpu-fake-ctl    write commands, one per line:
 *                                       fail-alloc N        the next N memory allocations fail
 *                                       fail-size-over B    allocations over B bytes fail (0: off)
 *                                       reset               both off
 *                ghostgpu-fake-state  read: the driver's own truth as one JSON object (below)
 *   --driver   the release whose RM_ALLOC layouts to answer (default 595.45.04; 515 and newer),
 *              also the version CHECK_VERSION_STR compares with
 *   --gpu      PCI bus id "DDDDDDDD:BB:SS.F" of the next GPU (default two GPUs, 00000000:17:00.0
 *              and 00000000:65:00.0); at most 8
 * Runs in the foreground, single-threaded (one request at a time: the object table needs no
 * lock). Prints "fakedriver-ready MOUNTDIR" on stdout once mounted and answering. SIGTERM
 * unmounts and exits 0. Setup failures: one line "fakedriver-error ..." on stderr, exit 3.
 *
 * What it answers, from docs/reference/nvidia-ioctl-abi.md (which cites
 * NVIDIA/open-gpu-kernel-modules 595.45.04; files named below are in that repository):
 * - Every NVIDIA request is _IOWR('F', nr, size) (sheet §1). FUSE's restricted ioctls on a
 *   regular file copy in and out exactly _IOC_SIZE bytes at the argument address, so the
 *   escape's block arrives here and what this program leaves in it is written back to the
 *   caller, as nvidia_ioctl (kernel-open/nvidia/nv.c) copies the whole block back. A wrong size
 *   or an unknown escape is -EINVAL with nothing written (nv.c nv_validate_ioctls, escape.c
 *   RmValidateIoctl, sheet §1 step 1 and 5).
 * - Blocks reached through pointers (NV_ESC_IOCTL_XFER_CMD's ptr, RM_ALLOC's pAllocParms, RM
 *   control params) and UVM blocks (UVM request words are plain integers with no size, sheet
 *   §9.1, so FUSE copies nothing) are read from and written to the caller's memory with
 *   process_vm_readv/writev, by the caller's PID as FUSE reports it in this daemon's PID
 *   namespace (run it in the host's).
 * - An RM object table like resserv's (src/nvidia/src/libraries/resserv/src/rs_server.c,
 *   src/nvidia/src/kernel/rmapi/alloc_free.c): clients, objects under parents, a free takes the
 *   subtree, freeing the client's own handle frees the client, and closing the file a client
 *   was allocated through frees it (nvidia_close -> rm_free_unused_clients).
 *
 * ghostgpu-fake-state:
 *   {"driver": "595.45.04", "gpus": [{"index", "minor", "pci_bus_id", "gpu_id",
 *    "allocated_bytes"}], "clients": [{"handle", "pid", "file", "node", "objects",
 *    "gpus": {"0": bytes}, "shared": {"0": bytes}, "system_bytes"}], "memory": [{"client",
 *    "handle", "parent", "class", "gpu", "size_bytes", "alloc_id", "dup", "call"}],
 *   "files": [{"id", "node", "pid"}], "fail_alloc", "fail_size_over", "counters": {...}}
 * A client's "gpus" are the bytes it allocated itself on each GPU (every memory class), "shared"
 * what it holds through RM_DUP_OBJECT; "system_bytes" memory under no GPU. A GPU's
 * "allocated_bytes" counts each allocation once, however many handles share it.
 */
#define FUSE_USE_VERSION 35
#define _GNU_SOURCE
#include <errno.h>
#include <fuse.h>
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

/* ---- the sheet's numbers ---------------------------------------------------------------- */

enum { /* escapes (sheet §2, nv_escape.h, nv-ioctl-numbers.h) */
    ESC_RM_ALLOC_MEMORY = 0x27, ESC_RM_ALLOC_OBJECT = 0x28, ESC_RM_FREE = 0x29,
    ESC_RM_CONTROL = 0x2A, ESC_RM_ALLOC = 0x2B, ESC_RM_DUP_OBJECT = 0x34,
    ESC_RM_VID_HEAP_CONTROL = 0x4A, ESC_CARD_INFO = 0xC8, ESC_REGISTER_FD = 0xC9,
    ESC_CHECK_VERSION_STR = 0xD2, ESC_IOCTL_XFER_CMD = 0xD3, ESC_ATTACH_GPUS_TO_FD = 0xD4,
    ESC_WAIT_OPEN_COMPLETE = 0xDA,
};
enum { /* NV_STATUS (sheet §6, nvstatuscodes.h) */
    NV_OK = 0, NV_ERR_INSUFFICIENT_RESOURCES = 0x1A, NV_ERR_INVALID_ARGUMENT = 0x1F,
    NV_ERR_INVALID_CLASS = 0x22, NV_ERR_INVALID_CLIENT = 0x23, NV_ERR_INVALID_OBJECT_HANDLE = 0x33,
    NV_ERR_INVALID_OBJECT_PARENT = 0x36, NV_ERR_NO_MEMORY = 0x51, NV_ERR_ILLEGAL_ACTION = 0x16,
    NV_ERR_INVALID_POINTER = 0x3D, NV_ERR_OBJECT_NOT_FOUND = 0x57,
};
enum { /* classes (sheet §8) */
    NV01_ROOT = 0x0, NV01_ROOT_NON_PRIV = 0x1, NV01_ROOT_CLIENT = 0x41, NV01_MEMORY_SYSTEM = 0x3E,
    NV01_MEMORY_LOCAL_PRIVILEGED = 0x3F, NV01_MEMORY_LOCAL_USER = 0x40, NV01_DEVICE_0 = 0x80,
    NV20_SUBDEVICE_0 = 0x2080, NV01_EVENT = 0x5, NV01_EVENT_KERNEL_CALLBACK = 0x78,
    NV01_EVENT_OS_EVENT = 0x79, NV01_EVENT_KERNEL_CALLBACK_EX = 0x7E,
};
enum { NVOS32_FUNCTION_ALLOC_SIZE = 2, NVOS32_FUNCTION_FREE = 3 }; /* nvos.h, sheet §3.5 */
enum { /* RM controls answered with data (sheet §7) */
    NV0000_CTRL_CMD_GPU_GET_ATTACHED_IDS = 0x201, NV0000_CTRL_CMD_GPU_GET_ID_INFO_V2 = 0x205,
};
#define NV_ABSOLUTE_MAX_IOCTL_SIZE 16384u /* kernel-open/common/inc/nv.h: the XFER inner limit */
#define RM_MEMORY_GRANULE (2u << 20)      /* video memory goes in 2 MiB pages: sizes round up */
#define NVOS02_GRANULE 4096u              /* NVOS02 memory: whole CPU pages */
#define CLIENT_HANDLE_BASE 0xc1d00000u    /* what RM's handle generator hands out for clients */
#define OBJECT_HANDLE_BASE 0xcaf00000u    /* ... and for objects whose caller passed 0 */

static uint32_t ioc_nr(unsigned cmd) { return cmd & 0xFF; }
static uint32_t ioc_size(unsigned cmd) { return (cmd >> 16) & 0x3FFF; }
static uint32_t ioc_type(unsigned cmd) { return (cmd >> 8) & 0xFF; }
static uint32_t ioc_dir(unsigned cmd) { return cmd >> 30; }

static uint32_t rd32(const uint8_t *b, size_t off) { uint32_t v; memcpy(&v, b + off, 4); return v; }
static uint64_t rd64(const uint8_t *b, size_t off) { uint64_t v; memcpy(&v, b + off, 8); return v; }
static void wr32(uint8_t *b, size_t off, uint32_t v) { memcpy(b + off, &v, 4); }
static void wr64(uint8_t *b, size_t off, uint64_t v) { memcpy(b + off, &v, 8); }
static uint64_t round_up(uint64_t v, uint64_t g) { return v == 0 ? 0 : (v + g - 1) / g * g; }

/* RM_ALLOC block layouts per release family (sheet §3.1, §5.2): the NVOS21 status moved from @24
 * to @28 when paramsSize was added in 535; NVOS64 grew from 40 to 48 bytes. */
struct layout {
    int first_major; /* this family from this driver branch on */
    uint32_t nvos21_status, nvos21_params_size; /* 0: no paramsSize field */
    uint32_t nvos64_bytes, nvos64_status, nvos64_params_size;
};
static const struct layout LAYOUTS[] = {
    {515, 24, 0, 40, 32, 0},
    {525, 24, 0, 40, 36, 0},
    {535, 28, 24, 48, 40, 32},
};
static const struct layout *g_layout = &LAYOUTS[2];
static char g_driver[64] = "595.45.04";

/* Other escapes answered with NV_OK in their status field (sheet §2, 595.45.04 sizes). */
enum node_rule { ON_CTL = 1, ON_GPU = 2, ON_EITHER = 3 };
struct escape { uint32_t nr, bytes; int status_at; int node; };
static const struct escape PLAIN_ESCAPES[] = {
    {0x35, 24, 20, ON_CTL},  /* RM_SHARE */
    {0x4E, 56, 40, ON_CTL},  /* RM_MAP_MEMORY */
    {0x4F, 32, 24, ON_CTL},  /* RM_UNMAP_MEMORY */
    {0x52, 16, 12, ON_EITHER}, /* RM_GET_EVENT_DATA */
    {0x54, 56, 48, ON_CTL},  /* RM_ALLOC_CONTEXT_DMA2 */
    {0x57, 64, 56, ON_CTL},  /* RM_MAP_MEMORY_DMA */
    {0x58, 48, 40, ON_CTL},  /* RM_UNMAP_MEMORY_DMA */
    {0x59, 16, 12, ON_CTL},  /* RM_BIND_CONTEXT_DMA */
    {0x5E, 40, 32, ON_CTL},  /* RM_UPDATE_DEVICE_MAPPING_INFO */
    {0xCE, 16, 12, ON_EITHER}, /* ALLOC_OS_EVENT */
    {0xCF, 16, 12, ON_EITHER}, /* FREE_OS_EVENT */
    {0xD1, 12, 8, ON_CTL},   /* STATUS_CODE */
    {0xD5, 8, 4, ON_GPU},    /* QUERY_DEVICE_INTR */
    {0xD6, 8, -1, ON_CTL},   /* SYS_PARAMS */
    {0xDA, 8, 4, ON_EITHER}, /* WAIT_OPEN_COMPLETE: rc@0 stays 0, adapterStatus@4 NV_OK */
};

/* UVM numbers served on /dev/nvidia-uvm at 595.45.04 with their params size and rmStatus
 * offset (sheet §9.2). */
struct uvm_call { uint32_t nr, bytes, status_at; };
static const struct uvm_call UVM_CALLS[] = {
    {0x30000001, 16, 8}, /* INITIALIZE */
    {23, 16, 8}, {24, 16, 8}, {25, 32, 28}, {26, 20, 16}, {27, 56, 48}, {28, 12, 8},
    {29, 36, 32}, {30, 36, 32}, {31, 32, 24}, {33, 9264, 9260}, {34, 16, 8}, {37, 40, 36},
    {38, 20, 16}, {39, 8, 4}, {40, 272, 264}, {41, 272, 264}, {42, 40, 36}, {43, 24, 16},
    {44, 24, 16}, {45, 24, 16}, {46, 40, 32}, {47, 40, 32}, {51, 80, 72}, {53, 32, 24},
    {62, 40, 32}, {63, 40, 32}, {64, 16, 8}, {65, 40, 32}, {66, 40, 32}, {67, 4, 0},
    {68, 9248, 9240}, {69, 4, 0}, {70, 24, 20}, {71, 24, 20}, {72, 24, 16}, {73, 24, 16},
    {74, 40, 32}, {75, 8, 4}, {77, 16, 8}, {78, 56, 52}, {79, 4, 0}, {80, 32, 24},
};
#define UVM_INITIALIZE 0x30000001u
#define UVM_DEINITIALIZE 0x30000002u
#define UVM_MM_INITIALIZE 75u

/* ---- state -------------------------------------------------------------------------------- */

#define MAX_GPUS 8
struct gpu { char pci[32]; uint32_t domain, bus, slot, function, gpu_id; };
static struct gpu g_gpus[MAX_GPUS];
static int g_ngpus;

enum node_kind { N_ROOT, N_CTL, N_GPU, N_UVM, N_CTLFILE, N_STATE };
struct open_file {
    uint64_t id;
    int kind, gpu, pid, live, uvm_initialized;
    char *text; size_t text_len; /* the state snapshot a reader of ghostgpu-fake-state sees */
};
static struct open_file *g_files;
static size_t g_nfiles, g_cap_files;
static uint64_t g_next_file_id = 1;

enum obj_kind { O_CLIENT, O_DEVICE, O_SUBDEVICE, O_MEMORY, O_OTHER };
struct obj {
    uint32_t client, handle, parent, cls;
    int kind, gpu, live, dup;
    uint64_t size_bytes, alloc_id;
    uint64_t file; int pid;  /* clients: the open file they were allocated through, the caller */
    const char *call;        /* memory: which call made it */
};
static struct obj *g_objs;
static size_t g_nobjs, g_cap_objs, g_max_objects = 1u << 20;
static uint32_t g_next_client = 1, g_next_object = 1;
static uint64_t g_next_alloc = 1;

static uint64_t g_fail_alloc, g_fail_size_over;
static struct {
    uint64_t ioctls, einval, efault, allocs_ok, allocs_failed, frees, dups, clients_closed;
} g_count;

static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("fakedriver-error ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(3);
}

static struct open_file *file_by_id(uint64_t id) {
    for (size_t i = 0; i < g_nfiles; i++)
        if (g_files[i].id == id && g_files[i].live) return &g_files[i];
    return NULL;
}

static struct obj *find_obj(uint32_t client, uint32_t handle) {
    for (size_t i = 0; i < g_nobjs; i++) {
        struct obj *o = &g_objs[i];
        if (o->live && o->client == client && o->handle == handle) return o;
    }
    return NULL;
}

static struct obj *find_client(uint32_t client) {
    struct obj *o = find_obj(client, client);
    return o && o->kind == O_CLIENT ? o : NULL;
}

static struct obj *new_obj(void) {
    for (size_t i = 0; i < g_nobjs; i++)
        if (!g_objs[i].live) { memset(&g_objs[i], 0, sizeof(g_objs[i])); return &g_objs[i]; }
    if (g_nobjs >= g_max_objects) return NULL;
    if (g_nobjs == g_cap_objs) {
        size_t cap = g_cap_objs ? g_cap_objs * 2 : 256;
        struct obj *p = realloc(g_objs, cap * sizeof(*p));
        if (p == NULL) return NULL;
        g_objs = p, g_cap_objs = cap;
    }
    memset(&g_objs[g_nobjs], 0, sizeof(g_objs[0]));
    return &g_objs[g_nobjs++];
}

/* The GPU an object hangs under: its own (device, subdevice) or its nearest ancestor's. */
static int gpu_of(uint32_t client, uint32_t handle) {
    for (int depth = 0; depth < 64; depth++) {
        struct obj *o = find_obj(client, handle);
        if (o == NULL || o->kind == O_CLIENT) return -1;
        if (o->gpu >= 0) return o->gpu;
        handle = o->parent;
    }
    return -1;
}

/* Frees one object and everything allocated under it (resserv frees children first). */
static void free_subtree(uint32_t client, uint32_t handle, int depth) {
    if (depth > 64) return;
    for (size_t i = 0; i < g_nobjs; i++) {
        struct obj *o = &g_objs[i];
        if (o->live && o->client == client && o->parent == handle && o->handle != handle)
            free_subtree(client, o->handle, depth + 1);
    }
    struct obj *o = find_obj(client, handle);
    if (o) o->live = 0;
}

static void free_client(uint32_t client) {
    for (size_t i = 0; i < g_nobjs; i++)
        if (g_objs[i].live && g_objs[i].client == client) g_objs[i].live = 0;
}

/* ---- caller memory ------------------------------------------------------------------------ */

static int caller_pid(void) { return (int)fuse_get_context()->pid; }

static int peek(uint64_t addr, void *buf, size_t len) {
    if (addr == 0) return -1;
    struct iovec local = {buf, len}, remote = {(void *)(uintptr_t)addr, len};
    ssize_t n = process_vm_readv(caller_pid(), &local, 1, &remote, 1, 0);
    return n == (ssize_t)len ? 0 : -1;
}

static int poke(uint64_t addr, const void *buf, size_t len) {
    if (addr == 0) return -1;
    struct iovec local = {(void *)buf, len}, remote = {(void *)(uintptr_t)addr, len};
    ssize_t n = process_vm_writev(caller_pid(), &local, 1, &remote, 1, 0);
    return n == (ssize_t)len ? 0 : -1;
}

/* ---- RM escapes: each edits its block in place, returns 0 or -errno ----------------------- */

/* Consumes one fault injection: the status a memory allocation of `bytes` gets. */
static uint32_t injected_failure(uint64_t bytes) {
    if (g_fail_alloc > 0) { g_fail_alloc--; return NV_ERR_NO_MEMORY; }
    if (g_fail_size_over > 0 && bytes > g_fail_size_over) return NV_ERR_NO_MEMORY;
    return NV_OK;
}

/* Picks hObjectNew: the caller's, or RM's own when it passed 0. */
static uint32_t pick_handle(uint32_t client, uint32_t wanted, uint32_t *status) {
    if (wanted != 0) {
        if (find_obj(client, wanted)) *status = NV_ERR_INSUFFICIENT_RESOURCES; /* in use */
        return wanted;
    }
    uint32_t h;
    do h = OBJECT_HANDLE_BASE + g_next_object++; while (find_obj(client, h));
    return h;
}

static int is_memory_class(uint32_t cls) {
    return cls == NV01_MEMORY_SYSTEM || cls == NV01_MEMORY_LOCAL_PRIVILEGED || cls == NV01_MEMORY_LOCAL_USER;
}

static int is_event_class(uint32_t cls) {
    return cls == NV01_EVENT || cls == NV01_EVENT_KERNEL_CALLBACK || cls == NV01_EVENT_OS_EVENT ||
           cls == NV01_EVENT_KERNEL_CALLBACK_EX;
}

/* Adds a memory object; returns its status. */
static uint32_t add_memory(uint32_t client, uint32_t handle, uint32_t parent, uint32_t cls,
                           uint64_t bytes, const char *call) {
    struct obj *o = new_obj();
    if (o == NULL) return NV_ERR_INSUFFICIENT_RESOURCES;
    *o = (struct obj){.client = client, .handle = handle, .parent = parent, .cls = cls,
                      .kind = O_MEMORY, .gpu = gpu_of(client, parent), .live = 1,
                      .size_bytes = bytes, .alloc_id = g_next_alloc++, .call = call};
    g_count.allocs_ok++;
    return NV_OK;
}

/* NV_ESC_RM_ALLOC (sheet §3.1, §4.1): NVOS21 or NVOS64 by size. */
static int rm_alloc(struct open_file *f, uint8_t *b, uint32_t size) {
    const struct layout *l = g_layout;
    uint32_t status_at, params_size_at;
    if (size == 32) status_at = l->nvos21_status, params_size_at = l->nvos21_params_size;
    else if (size == l->nvos64_bytes) status_at = l->nvos64_status, params_size_at = l->nvos64_params_size;
    else return -EINVAL;
    uint32_t h_root = rd32(b, 0), parent = rd32(b, 4), wanted = rd32(b, 8), cls = rd32(b, 12);
    uint64_t p_params = rd64(b, 16);
    uint32_t params_size = params_size_at ? rd32(b, params_size_at) : 0;
    if (f->kind != N_CTL && !is_event_class(cls)) return -EINVAL; /* NV_CTL_DEVICE_ONLY (escape.c) */
    uint32_t status = NV_OK;

    if (cls == NV01_ROOT || cls == NV01_ROOT_NON_PRIV || cls == NV01_ROOT_CLIENT) {
        uint32_t h = wanted;
        if (h != 0 && find_client(h)) status = NV_ERR_INSUFFICIENT_RESOURCES;
        if (h == 0) do h = CLIENT_HANDLE_BASE + g_next_client++; while (find_client(h));
        struct obj *o = status == NV_OK ? new_obj() : NULL;
        if (status == NV_OK && o == NULL) status = NV_ERR_INSUFFICIENT_RESOURCES;
        if (status == NV_OK) {
            *o = (struct obj){.client = h, .handle = h, .parent = 0, .cls = NV01_ROOT_CLIENT,
                              .kind = O_CLIENT, .gpu = -1, .live = 1, .file = f->id, .pid = caller_pid()};
            wr32(b, 8, h);
            wr32(b, 12, NV01_ROOT_CLIENT); /* escape.c: every root class comes back as 0x41 */
        }
        wr32(b, status_at, status);
        return 0;
    }
    if (!find_client(h_root)) { wr32(b, status_at, NV_ERR_INVALID_CLIENT); return 0; }
    struct obj *par = find_obj(h_root, parent);
    if (par == NULL) { wr32(b, status_at, NV_ERR_INVALID_OBJECT_PARENT); return 0; }
    uint32_t h = pick_handle(h_root, wanted, &status);
    if (status != NV_OK) { wr32(b, status_at, status); return 0; }

    uint8_t params[128] = {0};
    size_t want = params_size && params_size < sizeof(params) ? params_size : sizeof(params);
    int have_params = p_params != 0 && peek(p_params, params, want) == 0;

    if (cls == NV01_DEVICE_0) {
        /* NV0080_ALLOC_PARAMETERS.deviceId@0: the 0-based GPU instance (cl0080.h) */
        uint32_t device_id = have_params ? rd32(params, 0) : 0;
        if (par->kind != O_CLIENT || (int)device_id >= g_ngpus) status = NV_ERR_INVALID_ARGUMENT;
        else {
            struct obj *o = new_obj();
            if (o == NULL) status = NV_ERR_INSUFFICIENT_RESOURCES;
            else *o = (struct obj){.client = h_root, .handle = h, .parent = parent, .cls = cls,
                                   .kind = O_DEVICE, .gpu = (int)device_id, .live = 1};
        }
    } else if (cls == NV20_SUBDEVICE_0) {
        if (par->kind != O_DEVICE) status = NV_ERR_INVALID_OBJECT_PARENT;
        else {
            struct obj *o = new_obj();
            if (o == NULL) status = NV_ERR_INSUFFICIENT_RESOURCES;
            else *o = (struct obj){.client = h_root, .handle = h, .parent = parent, .cls = cls,
                                   .kind = O_SUBDEVICE, .gpu = par->gpu, .live = 1};
        }
    } else if (is_memory_class(cls)) {
        /* NV_MEMORY_ALLOCATION_PARAMS.size@64 (nvos.h): rounded up to the page size RM used and
         * written back, as RM does; so the size that counts is the one read after the call. */
        uint64_t bytes = have_params ? rd64(params, 64) : 0;
        if (!have_params) status = NV_ERR_INVALID_POINTER;
        else if (bytes == 0) status = NV_ERR_INVALID_ARGUMENT;
        else {
            bytes = round_up(bytes, RM_MEMORY_GRANULE);
            status = injected_failure(bytes);
            if (status == NV_OK) status = add_memory(h_root, h, parent, cls, bytes, "rm_alloc");
            if (status == NV_OK) {
                wr64(params, 64, bytes);
                if (poke(p_params + 64, params + 64, 8) != 0) return -EFAULT;
            } else {
                g_count.allocs_failed++;
            }
        }
    } else {
        struct obj *o = new_obj();
        if (o == NULL) status = NV_ERR_INSUFFICIENT_RESOURCES;
        else *o = (struct obj){.client = h_root, .handle = h, .parent = parent, .cls = cls,
                               .kind = O_OTHER, .gpu = -1, .live = 1};
    }
    if (status == NV_OK) wr32(b, 8, h);
    wr32(b, status_at, status);
    return 0;
}

/* NV_ESC_RM_ALLOC_OBJECT (NVOS05, sheet §3.3): an object with no parameters. */
static int rm_alloc_object(uint8_t *b) {
    uint32_t h_root = rd32(b, 0), parent = rd32(b, 4), wanted = rd32(b, 8), cls = rd32(b, 12);
    uint32_t status = NV_OK;
    if (!find_client(h_root)) status = NV_ERR_INVALID_CLIENT;
    else if (!find_obj(h_root, parent)) status = NV_ERR_INVALID_OBJECT_PARENT;
    uint32_t h = status == NV_OK ? pick_handle(h_root, wanted, &status) : 0;
    if (status == NV_OK) {
        struct obj *o = new_obj();
        if (o == NULL) status = NV_ERR_INSUFFICIENT_RESOURCES;
        else {
            *o = (struct obj){.client = h_root, .handle = h, .parent = parent, .cls = cls,
                              .kind = O_OTHER, .gpu = -1, .live = 1};
            wr32(b, 8, h);
        }
    }
    wr32(b, 16, status);
    return 0;
}

/* NV_ESC_RM_ALLOC_MEMORY (nvos02 + fd, sheet §3.4): size = limit + 1; issued on nvidiaN. */
static int rm_alloc_memory(uint8_t *b) {
    uint32_t h_root = rd32(b, 0), parent = rd32(b, 4), wanted = rd32(b, 8), cls = rd32(b, 12);
    uint64_t limit = rd64(b, 32);
    uint32_t status = NV_OK;
    if (!find_client(h_root)) status = NV_ERR_INVALID_CLIENT;
    else if (!find_obj(h_root, parent)) status = NV_ERR_INVALID_OBJECT_PARENT;
    uint32_t h = status == NV_OK ? pick_handle(h_root, wanted, &status) : 0;
    if (status == NV_OK) {
        uint64_t bytes = round_up(limit + 1, NVOS02_GRANULE);
        status = injected_failure(bytes);
        if (status == NV_OK) status = add_memory(h_root, h, parent, cls, bytes, "rm_alloc_memory");
        if (status == NV_OK) { wr32(b, 8, h); wr64(b, 32, bytes - 1); }
        else g_count.allocs_failed++;
    }
    wr32(b, 40, status);
    return 0;
}

/* NV_ESC_RM_FREE (NVOS00, sheet §3.3): the object and its subtree; hObjectOld == hRoot: the client. */
static int rm_free(uint8_t *b) {
    uint32_t h_root = rd32(b, 0), old = rd32(b, 8), status = NV_OK;
    if (!find_client(h_root)) status = NV_ERR_INVALID_CLIENT;
    else if (old == h_root) free_client(h_root);
    else if (!find_obj(h_root, old)) status = NV_ERR_INVALID_OBJECT_HANDLE;
    else free_subtree(h_root, old, 0);
    if (status == NV_OK) g_count.frees++;
    wr32(b, 12, status);
    return 0;
}

/* NV_ESC_RM_DUP_OBJECT (NVOS55, sheet §3.3): a new handle in hClient for hClientSrc's object;
 * memory is shared, not allocated again (same alloc_id). */
static int rm_dup(uint8_t *b) {
    uint32_t client = rd32(b, 0), parent = rd32(b, 4), wanted = rd32(b, 8);
    uint32_t src_client = rd32(b, 12), src_obj = rd32(b, 16), status = NV_OK;
    struct obj *src = NULL;
    if (!find_client(client) || !find_client(src_client)) status = NV_ERR_INVALID_CLIENT;
    else if (!find_obj(client, parent)) status = NV_ERR_INVALID_OBJECT_PARENT;
    else if ((src = find_obj(src_client, src_obj)) == NULL || src->kind == O_CLIENT)
        status = NV_ERR_INVALID_OBJECT_HANDLE;
    uint32_t h = status == NV_OK ? pick_handle(client, wanted, &status) : 0;
    if (status == NV_OK) {
        struct obj copy = *src; /* new_obj may move the table */
        struct obj *o = new_obj();
        if (o == NULL) status = NV_ERR_INSUFFICIENT_RESOURCES;
        else {
            *o = copy;
            o->client = client, o->handle = h, o->parent = parent, o->dup = 1, o->call = "rm_dup_object";
            if (copy.kind != O_MEMORY) o->gpu = copy.gpu;
            wr32(b, 8, h);
            g_count.dups++;
        }
    }
    wr32(b, 24, status);
    return 0;
}

/* NV_ESC_RM_VID_HEAP_CONTROL (NVOS32, sheet §3.5; data union in nvos.h): ALLOC_SIZE makes a
 * memory object (hMemory@44 in/out, size@88 rounded up and written back), FREE frees hMemory@44. */
static int rm_vid_heap(uint8_t *b) {
    uint32_t h_root = rd32(b, 0), parent = rd32(b, 4), function = rd32(b, 8), status = NV_OK;
    if (!find_client(h_root)) status = NV_ERR_INVALID_CLIENT;
    else if (function == NVOS32_FUNCTION_ALLOC_SIZE) {
        uint64_t bytes = round_up(rd64(b, 88), RM_MEMORY_GRANULE);
        if (!find_obj(h_root, parent)) status = NV_ERR_INVALID_OBJECT_PARENT;
        else if (bytes == 0) status = NV_ERR_INVALID_ARGUMENT;
        uint32_t h = status == NV_OK ? pick_handle(h_root, rd32(b, 44), &status) : 0;
        if (status == NV_OK) {
            status = injected_failure(bytes);
            if (status == NV_OK)
                status = add_memory(h_root, h, parent, NV01_MEMORY_LOCAL_USER, bytes, "rm_vid_heap_alloc");
            if (status == NV_OK) { wr32(b, 44, h); wr64(b, 88, bytes); }
            else g_count.allocs_failed++;
        }
    } else if (function == NVOS32_FUNCTION_FREE) {
        uint32_t h = rd32(b, 44);
        if (!find_obj(h_root, h)) status = NV_ERR_INVALID_OBJECT_HANDLE;
        else { free_subtree(h_root, h, 0); g_count.frees++; }
    }
    wr32(b, 20, status);
    return 0;
}

/* NV_ESC_RM_CONTROL (NVOS54, sheet §3.2): NV_OK; the two GPU-identity controls get answers. */
static int rm_control(uint8_t *b) {
    uint32_t cmd = rd32(b, 8), params_size = rd32(b, 24);
    uint64_t p = rd64(b, 16);
    if (cmd == NV0000_CTRL_CMD_GPU_GET_ATTACHED_IDS && params_size == 128) {
        uint32_t ids[32];
        for (int i = 0; i < 32; i++) ids[i] = i < g_ngpus ? g_gpus[i].gpu_id : 0xFFFFFFFFu;
        if (poke(p, ids, sizeof(ids)) != 0) { wr32(b, 28, NV_ERR_INVALID_POINTER); return 0; }
    } else if (cmd == NV0000_CTRL_CMD_GPU_GET_ID_INFO_V2 && params_size == 32) {
        uint8_t v[32];
        if (peek(p, v, sizeof(v)) != 0) { wr32(b, 28, NV_ERR_INVALID_POINTER); return 0; }
        int found = -1;
        for (int i = 0; i < g_ngpus; i++)
            if (g_gpus[i].gpu_id == rd32(v, 0)) found = i;
        if (found < 0) { wr32(b, 28, NV_ERR_INVALID_ARGUMENT); return 0; }
        wr32(v, 8, (uint32_t)found); /* deviceInstance: the NV0080 deviceId of this GPU */
        wr32(v, 12, 0);              /* subDeviceInstance */
        if (poke(p, v, sizeof(v)) != 0) { wr32(b, 28, NV_ERR_INVALID_POINTER); return 0; }
    }
    wr32(b, 28, NV_OK);
    return 0;
}

/* NV_ESC_CARD_INFO (nv_ioctl_card_info_t[n], sheet §4): every entry zeroed, one per GPU. */
static int card_info(uint8_t *b, uint32_t size) {
    if (size == 0 || size % 72 != 0) return -EINVAL;
    memset(b, 0, size);
    for (int i = 0; i < g_ngpus && (uint32_t)(i + 1) * 72 <= size; i++) {
        uint8_t *e = b + 72 * i;
        e[0] = 1;                      /* valid */
        wr32(e, 4, g_gpus[i].domain);  /* pci_info.domain */
        e[8] = (uint8_t)g_gpus[i].bus;
        e[9] = (uint8_t)g_gpus[i].slot;
        e[12] = 0xDE, e[13] = 0x10;    /* vendor_id 0x10DE */
        e[14] = 0x30, e[15] = 0x23;    /* device_id 0x2330 (H100 SXM) */
        wr32(e, 16, g_gpus[i].gpu_id);
        wr32(e, 56, (uint32_t)i);      /* minor_number */
        memcpy(e + 60, "nvidia", 6);
    }
    return 0;
}

/* NV_ESC_CHECK_VERSION_STR (sheet §4, osapi.c): reply 1; QUERY and a mismatch write the version,
 * a mismatch is also -EINVAL (so the string goes back through the caller's memory). */
static int check_version(uint8_t *b, uint64_t arg) {
    uint32_t cmd = rd32(b, 0);
    char theirs[65];
    memcpy(theirs, b + 8, 64);
    theirs[64] = '\0';
    wr32(b, 4, 1);
    int match;
    if (cmd == 0x32) match = 1;
    else if (cmd == 0x31) {
        size_t n = strcspn(g_driver, ".");
        match = strncmp(theirs, g_driver, n) == 0 && (theirs[n] == '.' || theirs[n] == '\0');
    } else match = strcmp(theirs, g_driver) == 0;
    if (cmd == 0x32 || !match) {
        memset(b + 8, 0, 64);
        snprintf((char *)b + 8, 64, "%s", g_driver);
    }
    if (!match) { (void)poke(arg, b, 72); return -EINVAL; }
    return 0;
}

static int node_ok(const struct open_file *f, int rule) {
    return (rule & ON_CTL && f->kind == N_CTL) || (rule & ON_GPU && f->kind == N_GPU);
}

/* One RM or frontend escape on block `b` of `size` bytes; `arg` is the block's user address. */
static int escape(struct open_file *f, uint32_t nr, uint8_t *b, uint32_t size, uint64_t arg, int depth) {
    switch (nr) {
    case ESC_RM_ALLOC:
        return rm_alloc(f, b, size);
    case ESC_RM_ALLOC_OBJECT:
        return size == 20 && f->kind == N_CTL ? rm_alloc_object(b) : -EINVAL;
    case ESC_RM_ALLOC_MEMORY:
        return size == 56 && f->kind == N_GPU ? rm_alloc_memory(b) : -EINVAL;
    case ESC_RM_FREE:
        return size == 16 && f->kind == N_CTL ? rm_free(b) : -EINVAL;
    case ESC_RM_CONTROL:
        return size == 32 && f->kind == N_CTL ? rm_control(b) : -EINVAL;
    case ESC_RM_DUP_OBJECT:
        return size == 28 && f->kind == N_CTL ? rm_dup(b) : -EINVAL;
    case ESC_RM_VID_HEAP_CONTROL:
        return size == 184 && f->kind == N_CTL ? rm_vid_heap(b) : -EINVAL;
    case ESC_CARD_INFO:
        return f->kind == N_CTL ? card_info(b, size) : -EINVAL;
    case ESC_CHECK_VERSION_STR:
        return size == 72 && f->kind == N_CTL ? check_version(b, arg) : -EINVAL;
    case ESC_REGISTER_FD:
        return size == 4 ? 0 : -EINVAL;
    case ESC_ATTACH_GPUS_TO_FD:
        return size >= 4 && size % 4 == 0 && f->kind == N_CTL ? 0 : -EINVAL;
    case ESC_IOCTL_XFER_CMD: {
        /* nv_ioctl_xfer_t {cmd@0, size@4, ptr@8}: the real escape's block lives at ptr (§1 step 3) */
        if (size != 16 || depth > 0) return -EINVAL;
        uint32_t inner_nr = rd32(b, 0), inner_size = rd32(b, 4);
        uint64_t ptr = rd64(b, 8);
        if (inner_size == 0 || inner_size > NV_ABSOLUTE_MAX_IOCTL_SIZE || inner_nr == ESC_IOCTL_XFER_CMD)
            return -EINVAL;
        uint8_t *inner = calloc(1, inner_size);
        if (inner == NULL) return -ENOMEM;
        int rc = peek(ptr, inner, inner_size) == 0 ? escape(f, inner_nr, inner, inner_size, ptr, 1) : -EFAULT;
        if (rc == 0 && poke(ptr, inner, inner_size) != 0) rc = -EFAULT;
        free(inner);
        return rc;
    }
    default:
        for (size_t i = 0; i < sizeof(PLAIN_ESCAPES) / sizeof(PLAIN_ESCAPES[0]); i++) {
            const struct escape *e = &PLAIN_ESCAPES[i];
            if (e->nr != nr) continue;
            if (e->bytes != size || !node_ok(f, e->node)) return -EINVAL;
            if (e->status_at >= 0) wr32(b, (size_t)e->status_at, NV_OK);
            return 0;
        }
        return -EINVAL;
    }
}

/* /dev/nvidia-uvm: the block is at arg in the caller's memory (no size in the request word). */
static int uvm_ioctl(struct open_file *f, unsigned cmd, uint64_t arg) {
    if (cmd == UVM_DEINITIALIZE) return 0;
    for (size_t i = 0; i < sizeof(UVM_CALLS) / sizeof(UVM_CALLS[0]); i++) {
        const struct uvm_call *c = &UVM_CALLS[i];
        if (c->nr != cmd) continue;
        uint8_t *b = calloc(1, c->bytes);
        if (b == NULL) return -ENOMEM;
        int rc = 0;
        if (peek(arg, b, c->bytes) != 0) rc = -EFAULT;
        else {
            /* uvm.c: until INITIALIZE succeeds every call but it and MM_INITIALIZE is refused */
            uint32_t status = NV_OK;
            if (cmd == UVM_INITIALIZE) f->uvm_initialized = 1;
            else if (!f->uvm_initialized && cmd != UVM_MM_INITIALIZE) status = NV_ERR_ILLEGAL_ACTION;
            wr32(b, c->status_at, status);
            if (poke(arg, b, c->bytes) != 0) rc = -EFAULT;
        }
        free(b);
        return rc;
    }
    return -ENOSYS; /* uvm.c: a number not routed on /dev/nvidia-uvm */
}

/* ---- the state file ------------------------------------------------------------------------ */

struct buf { char *p; size_t len, cap; };
static void bprintf(struct buf *b, const char *fmt, ...) {
    va_list ap;
    for (;;) {
        size_t room = b->cap - b->len;
        va_start(ap, fmt);
        int n = vsnprintf(b->p ? b->p + b->len : NULL, room, fmt, ap);
        va_end(ap);
        if (n < 0) return;
        if ((size_t)n < room) { b->len += (size_t)n; return; }
        size_t cap = (b->cap + (size_t)n + 1) * 2;
        char *p = realloc(b->p, cap);
        if (p == NULL) return;
        b->p = p, b->cap = cap;
    }
}

static const char *NODE_NAMES[] = {"root", "nvidiactl", "nvidia", "nvidia-uvm", "ctl", "state"};

static void node_name(const struct open_file *f, char *out, size_t n) {
    if (f->kind == N_GPU) snprintf(out, n, "nvidia%d", f->gpu);
    else snprintf(out, n, "%s", NODE_NAMES[f->kind]);
}

static char *render_state(size_t *len) {
    struct buf b = {0};
    bprintf(&b, "{\"driver\": \"%s\", \"gpus\": [", g_driver);
    for (int g = 0; g < g_ngpus; g++) {
        /* each allocation once, however many handles share it */
        uint64_t total = 0;
        for (size_t i = 0; i < g_nobjs; i++) {
            const struct obj *o = &g_objs[i];
            if (!o->live || o->kind != O_MEMORY || o->gpu != g) continue;
            int first = 1;
            for (size_t j = 0; j < i; j++)
                if (g_objs[j].live && g_objs[j].kind == O_MEMORY && g_objs[j].alloc_id == o->alloc_id) first = 0;
            if (first) total += o->size_bytes;
        }
        bprintf(&b, "%s{\"index\": %d, \"minor\": %d, \"pci_bus_id\": \"%s\", \"gpu_id\": %u, "
                "\"allocated_bytes\": %" PRIu64 "}", g ? ", " : "", g, g, g_gpus[g].pci,
                g_gpus[g].gpu_id, total);
    }
    bprintf(&b, "], \"clients\": [");
    int first_client = 1;
    for (size_t i = 0; i < g_nobjs; i++) {
        const struct obj *c = &g_objs[i];
        if (!c->live || c->kind != O_CLIENT) continue;
        uint64_t own[MAX_GPUS] = {0}, shared[MAX_GPUS] = {0}, system = 0;
        int objects = 0;
        for (size_t j = 0; j < g_nobjs; j++) {
            const struct obj *o = &g_objs[j];
            if (!o->live || o->client != c->handle) continue;
            objects++;
            if (o->kind != O_MEMORY) continue;
            if (o->gpu < 0) system += o->size_bytes;
            else if (o->dup) shared[o->gpu] += o->size_bytes;
            else own[o->gpu] += o->size_bytes;
        }
        const struct open_file *f = NULL;
        for (size_t k = 0; k < g_nfiles; k++)
            if (g_files[k].id == c->file) f = &g_files[k];
        char node[32] = "closed";
        if (f && f->live) node_name(f, node, sizeof(node));
        bprintf(&b, "%s{\"handle\": %u, \"pid\": %d, \"file\": %" PRIu64 ", \"node\": \"%s\", "
                "\"objects\": %d, \"gpus\": {", first_client ? "" : ", ", c->handle, c->pid, c->file,
                node, objects);
        for (int g = 0; g < g_ngpus; g++)
            bprintf(&b, "%s\"%d\": %" PRIu64, g ? ", " : "", g, own[g]);
        bprintf(&b, "}, \"shared\": {");
        for (int g = 0; g < g_ngpus; g++)
            bprintf(&b, "%s\"%d\": %" PRIu64, g ? ", " : "", g, shared[g]);
        bprintf(&b, "}, \"system_bytes\": %" PRIu64 "}", system);
        first_client = 0;
    }
    bprintf(&b, "], \"memory\": [");
    int first_mem = 1;
    for (size_t i = 0; i < g_nobjs; i++) {
        const struct obj *o = &g_objs[i];
        if (!o->live || o->kind != O_MEMORY) continue;
        char gpu[16] = "null";
        if (o->gpu >= 0) snprintf(gpu, sizeof(gpu), "%d", o->gpu);
        bprintf(&b, "%s{\"client\": %u, \"handle\": %u, \"parent\": %u, \"class\": %u, \"gpu\": %s, "
                "\"size_bytes\": %" PRIu64 ", \"alloc_id\": %" PRIu64 ", \"dup\": %s, \"call\": \"%s\"}",
                first_mem ? "" : ", ", o->client, o->handle, o->parent, o->cls, gpu,
                o->size_bytes, o->alloc_id, o->dup ? "true" : "false", o->call ? o->call : "");
        first_mem = 0;
    }
    bprintf(&b, "], \"files\": [");
    int first_file = 1;
    for (size_t i = 0; i < g_nfiles; i++) {
        const struct open_file *f = &g_files[i];
        if (!f->live || f->kind == N_STATE || f->kind == N_CTLFILE) continue;
        char node[32];
        node_name(f, node, sizeof(node));
        bprintf(&b, "%s{\"id\": %" PRIu64 ", \"node\": \"%s\", \"pid\": %d}", first_file ? "" : ", ",
                f->id, node, f->pid);
        first_file = 0;
    }
    size_t live_objects = 0;
    for (size_t i = 0; i < g_nobjs; i++) live_objects += g_objs[i].live != 0;
    bprintf(&b, "], \"fail_alloc\": %" PRIu64 ", \"fail_size_over\": %" PRIu64 ", \"objects\": %zu, "
            "\"counters\": {\"ioctls\": %" PRIu64 ", \"einval\": %" PRIu64 ", \"efault\": %" PRIu64
            ", \"allocs_ok\": %" PRIu64 ", \"allocs_failed\": %" PRIu64 ", \"frees\": %" PRIu64
            ", \"dups\": %" PRIu64 ", \"clients_closed\": %" PRIu64 "}}\n",
            g_fail_alloc, g_fail_size_over, live_objects, g_count.ioctls, g_count.einval, g_count.efault,
            g_count.allocs_ok, g_count.allocs_failed, g_count.frees, g_count.dups, g_count.clients_closed);
    *len = b.len;
    return b.p;
}

/* ---- FUSE operations ---------------------------------------------------------------------- */

#define CTL_FILE "ghostgpu-fake-ctl"
#define STATE_FILE "ghostgpu-fake-state"

/* The node a path names: kind, and the GPU index for nvidiaN; -1 when there is none. */
static int lookup(const char *path, int *gpu) {
    *gpu = -1;
    if (strcmp(path, "/") == 0) return N_ROOT;
    if (strcmp(path, "/nvidiactl") == 0) return N_CTL;
    if (strcmp(path, "/nvidia-uvm") == 0) return N_UVM;
    if (strcmp(path, "/" CTL_FILE) == 0) return N_CTLFILE;
    if (strcmp(path, "/" STATE_FILE) == 0) return N_STATE;
    if (strncmp(path, "/nvidia", 7) == 0 && path[7] >= '0' && path[7] <= '9' && path[8] == '\0') {
        *gpu = path[7] - '0';
        if (*gpu < g_ngpus) return N_GPU;
    }
    return -1;
}

static int op_getattr(const char *path, struct stat *st, struct fuse_file_info *fi) {
    (void)fi;
    int gpu;
    int kind = lookup(path, &gpu);
    if (kind < 0) return -ENOENT;
    memset(st, 0, sizeof(*st));
    st->st_uid = getuid(), st->st_gid = getgid();
    if (kind == N_ROOT) { st->st_mode = S_IFDIR | 0755; st->st_nlink = 2; return 0; }
    st->st_mode = S_IFREG | (kind == N_STATE ? 0444 : 0666);
    st->st_nlink = 1;
    return 0;
}

static int op_readdir(const char *path, void *buf, fuse_fill_dir_t fill, off_t off,
                      struct fuse_file_info *fi, enum fuse_readdir_flags flags) {
    (void)off, (void)fi, (void)flags;
    if (strcmp(path, "/") != 0) return -ENOTDIR;
    fill(buf, ".", NULL, 0, 0);
    fill(buf, "..", NULL, 0, 0);
    fill(buf, "nvidiactl", NULL, 0, 0);
    for (int g = 0; g < g_ngpus; g++) {
        char name[24];
        snprintf(name, sizeof(name), "nvidia%d", g);
        fill(buf, name, NULL, 0, 0);
    }
    fill(buf, "nvidia-uvm", NULL, 0, 0);
    fill(buf, CTL_FILE, NULL, 0, 0);
    fill(buf, STATE_FILE, NULL, 0, 0);
    return 0;
}

static int op_open(const char *path, struct fuse_file_info *fi) {
    int gpu;
    int kind = lookup(path, &gpu);
    if (kind < 0) return -ENOENT;
    if (kind == N_ROOT) return -EISDIR;
    if (g_nfiles == g_cap_files) {
        size_t cap = g_cap_files ? g_cap_files * 2 : 64;
        struct open_file *p = realloc(g_files, cap * sizeof(*p));
        if (p == NULL) return -ENOMEM;
        g_files = p, g_cap_files = cap;
    }
    struct open_file *f = &g_files[g_nfiles++];
    *f = (struct open_file){.id = g_next_file_id++, .kind = kind, .gpu = gpu, .pid = caller_pid(), .live = 1};
    if (kind == N_STATE) f->text = render_state(&f->text_len);
    fi->fh = f->id;
    /* The state and control files: every read and write comes here (the state has no fixed
     * size). The device files stay page-cached so that mmap works on them as on the real nodes
     * (FUSE refuses a shared mmap of a direct-I/O file). */
    fi->direct_io = kind == N_STATE || kind == N_CTLFILE;
    fi->nonseekable = kind != N_STATE;
    return 0;
}

static int op_truncate(const char *path, off_t size, struct fuse_file_info *fi) {
    (void)size, (void)fi;
    int gpu;
    return lookup(path, &gpu) == N_CTLFILE ? 0 : -EACCES;
}

static int op_read(const char *path, char *out, size_t size, off_t off, struct fuse_file_info *fi) {
    (void)path;
    struct open_file *f = file_by_id(fi->fh);
    if (f == NULL) return -EBADF;
    if (f->kind != N_STATE) return 0;
    if ((size_t)off >= f->text_len) return 0;
    size_t n = f->text_len - (size_t)off < size ? f->text_len - (size_t)off : size;
    memcpy(out, f->text + off, n);
    return (int)n;
}

static int op_write(const char *path, const char *in, size_t size, off_t off, struct fuse_file_info *fi) {
    (void)path, (void)off;
    struct open_file *f = file_by_id(fi->fh);
    if (f == NULL) return -EBADF;
    if (f->kind != N_CTLFILE) return -EINVAL;
    char line[256];
    size_t n = size < sizeof(line) - 1 ? size : sizeof(line) - 1;
    memcpy(line, in, n);
    line[n] = '\0';
    for (char *save = NULL, *cmd = strtok_r(line, "\n", &save); cmd; cmd = strtok_r(NULL, "\n", &save)) {
        char word[64];
        unsigned long long v = 0;
        int got = sscanf(cmd, "%63s %llu", word, &v);
        if (got == 2 && strcmp(word, "fail-alloc") == 0) g_fail_alloc = v;
        else if (got == 2 && strcmp(word, "fail-size-over") == 0) g_fail_size_over = v;
        else if (got == 1 && strcmp(word, "reset") == 0) g_fail_alloc = 0, g_fail_size_over = 0;
        else if (got >= 1) {
            fprintf(stderr, "fakedriver: unknown control %s (fail-alloc N, fail-size-over BYTES, reset)\n", cmd);
            return -EINVAL;
        }
    }
    return (int)size;
}

static int op_release(const char *path, struct fuse_file_info *fi) {
    (void)path;
    struct open_file *f = file_by_id(fi->fh);
    if (f == NULL) return 0;
    /* nvidia_close: the clients allocated through this file die with it */
    for (size_t i = 0; i < g_nobjs; i++) {
        struct obj *c = &g_objs[i];
        if (c->live && c->kind == O_CLIENT && c->file == f->id) {
            free_client(c->handle);
            g_count.clients_closed++;
        }
    }
    free(f->text);
    f->text = NULL;
    f->live = 0;
    return 0;
}

static int op_ioctl(const char *path, unsigned int cmd, void *arg, struct fuse_file_info *fi,
                    unsigned int flags, void *data) {
    (void)path, (void)flags;
    struct open_file *f = file_by_id(fi->fh);
    if (f == NULL) return -EBADF;
    g_count.ioctls++;
    int rc;
    if (f->kind == N_UVM) rc = uvm_ioctl(f, cmd, (uint64_t)(uintptr_t)arg);
    else if (f->kind != N_CTL && f->kind != N_GPU) rc = -ENOTTY;
    else if (ioc_type(cmd) != 'F' || ioc_dir(cmd) != 3 || ioc_size(cmd) == 0) rc = -EINVAL;
    else rc = escape(f, ioc_nr(cmd), data, ioc_size(cmd), (uint64_t)(uintptr_t)arg, 0);
    if (rc == -EINVAL) g_count.einval++;
    if (rc == -EFAULT) g_count.efault++;
    return rc;
}

static void *op_init(struct fuse_conn_info *conn, struct fuse_config *cfg) {
    (void)conn;
    cfg->attr_timeout = 0, cfg->entry_timeout = 0, cfg->negative_timeout = 0;
    return NULL;
}

static const struct fuse_operations OPS = {
    .getattr = op_getattr, .readdir = op_readdir, .open = op_open, .read = op_read,
    .write = op_write, .release = op_release, .ioctl = op_ioctl, .truncate = op_truncate,
    .init = op_init,
};

/* "DDDDDDDD:BB:SS.F" (NVML's busId form, as the fake NVML serves it) */
static void add_gpu(const char *pci) {
    if (g_ngpus >= MAX_GPUS) die("at most %d --gpu", MAX_GPUS);
    struct gpu *g = &g_gpus[g_ngpus];
    if (sscanf(pci, "%x:%x:%x.%x", &g->domain, &g->bus, &g->slot, &g->function) != 4 || g->bus > 0xFF)
        die("--gpu %s: want a PCI bus id like 00000000:17:00.0", pci);
    snprintf(g->pci, sizeof(g->pci), "%s", pci);
    g->gpu_id = (g->domain << 16) | (g->bus << 8) | (g->slot << 3) | g->function;
    g_ngpus++;
}

int main(int argc, char **argv) {
    const char *mountdir = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--driver") == 0 && i + 1 < argc) snprintf(g_driver, sizeof(g_driver), "%s", argv[++i]);
        else if (strcmp(argv[i], "--gpu") == 0 && i + 1 < argc) add_gpu(argv[++i]);
        else if (strcmp(argv[i], "--max-objects") == 0 && i + 1 < argc) g_max_objects = strtoul(argv[++i], NULL, 0);
        else if (argv[i][0] != '-' && mountdir == NULL) mountdir = argv[i];
        else die("usage: fakedriver MOUNTDIR [--driver VERSION] [--gpu PCI_BUS_ID]... [--max-objects N]");
    }
    if (mountdir == NULL) die("usage: fakedriver MOUNTDIR [--driver VERSION] [--gpu PCI_BUS_ID]...");
    if (g_ngpus == 0) add_gpu("00000000:17:00.0"), add_gpu("00000000:65:00.0");
    int major = atoi(g_driver);
    if (major < LAYOUTS[0].first_major) die("--driver %s: releases before 515 are not served", g_driver);
    for (size_t i = 0; i < sizeof(LAYOUTS) / sizeof(LAYOUTS[0]); i++)
        if (major >= LAYOUTS[i].first_major) g_layout = &LAYOUTS[i];
    if (access("/dev/fuse", R_OK | W_OK) != 0)
        die("/dev/fuse is missing or not writable (%s): load the fuse module and run as root", strerror(errno));
    struct stat st;
    if (stat(mountdir, &st) != 0 || !S_ISDIR(st.st_mode)) die("mount dir %s: not a directory", mountdir);
    setvbuf(stdout, NULL, _IOLBF, 0);
    /* allow_other: container processes of any uid; fuse_loop below serves one request at a time */
    char *fargv[] = {argv[0], "-o", "allow_other,fsname=ghostgpu-fakedriver,subtype=ghostgpu-fakedriver", NULL};
    struct fuse_args args = FUSE_ARGS_INIT(3, fargv);
    struct fuse *fuse = fuse_new(&args, &OPS, sizeof(OPS), NULL);
    if (fuse == NULL) die("fuse_new failed: install fuse3 and libfuse3-dev");
    if (fuse_mount(fuse, mountdir) != 0) die("cannot mount on %s: is fusermount3 (fuse3) installed and /dev/fuse usable?", mountdir);
    if (fuse_set_signal_handlers(fuse_get_session(fuse)) != 0) die("cannot set signal handlers");
    printf("fakedriver-ready %s\n", mountdir);
    int rc = fuse_loop(fuse);
    fuse_remove_signal_handlers(fuse_get_session(fuse));
    fuse_unmount(fuse);
    fuse_destroy(fuse);
    return rc == 0 ? 0 : 1;
}
