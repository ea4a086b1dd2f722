/* gpucalls: the ioctl sequence of a CUDA process start-up, issued on (fake) NVIDIA device nodes,
 * for the trace-session tests and benchmarks (docs/TRACE.md).
 *
 * Every value here (escape numbers, block layouts, status offsets per driver release, class,
 * control and NV_STATUS numbers and names, UVM numbers and layouts) is copied from
 * docs/reference/nvidia-ioctl-abi.md, which cites NVIDIA/open-gpu-kernel-modules:
 * kernel-open/common/inc/nv-ioctl.h, nv-ioctl-numbers.h, src/common/sdk/nvidia/inc/nvos.h,
 * nvstatuscodes.h, ctrl/... and class/... headers, kernel-open/nvidia-uvm/uvm_ioctl.h. It is
 * written from the sheet independently of tracer/nvabi.py: its JSON is the expectation the
 * tracer's decoder is checked against.
 *
 * In tests the nodes are `c 1 3` (/dev/null): every ioctl fails with ENOTTY, but each parameter
 * block is really in user memory at the argument address, with its status field pre-set to a
 * chosen NV_STATUS at the offset of the --driver release (sheet §5.2, §9.4). A tracer reads the
 * block at syscall entry and the status at exit exactly as on a real driver.
 *
 * Usage: gpucalls [--dev-dir DIR] [--driver VERSION] [--out FILE] [--ready] [--hold] [--loop N]
 *                 [--fork] [--dump-blocks] [--spin M] [--private-dev NAME:MAJ:MIN]...
 *                 [--cgroup PROCS_FILE]...
 *   --dev-dir      where nvidiactl, nvidia0 and nvidia-uvm are (default /dev)
 *   --driver       driver release whose layouts to use (default 595.45.04; 515 and newer)
 *   --out          JSON lines, one per call in issue order (default stdout)
 *   --ready        print "ready <pid>" and wait for a line on stdin before the first call
 *   --hold         after "done", wait for another stdin line before exiting
 *   --loop N       issue the ioctl part N times (opens, mmap and closes once)
 *   --fork         after the ioctl part, fork a child that issues 3 RM_CONTROLs and exits
 *   --dump-blocks  add "block_hex" (and "xfer_hex") to each ioctl line: the bytes at entry
 *   --spin M       instead: M RM_CONTROLs on one thread as fast as possible; prints
 *                  {"calls": M, "ns_per_call": X} on stdout
 *   --private-dev  first: own mount namespace, tmpfs on the dev dir, mknod these nodes there
 *   --cgroup       first: move this process into these cgroups (write 0 to each procs file)
 * Two threads, A (RM on nvidiactl/nvidia0) and B (UVM and RM controls on its own nvidiactl fd),
 * take turns from a fixed global plan (mutex + condvar turn counter), so the order is fixed.
 * Setup failures print "gpucalls-error <what> <errno>" on stderr and exit 3; bad usage exits 2.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ---- the sheet's numbers ---------------------------------------------------------------- */

#define NV_IOWR(nr, size) ((3u << 30) | ((uint32_t)(size) << 16) | (0x46u << 8) | (uint32_t)(nr))

enum { /* escapes (sheet §2) */
    ESC_RM_FREE = 41, ESC_RM_CONTROL = 42, ESC_RM_ALLOC = 43, ESC_RM_MAP_MEMORY = 78,
    ESC_CARD_INFO = 200, ESC_CHECK_VERSION_STR = 210, ESC_IOCTL_XFER_CMD = 211,
};
enum { /* UVM request numbers (sheet §9.1, §9.2): plain integers, not _IOC words */
    UVM_INITIALIZE = 0x30000001, UVM_CREATE_RANGE_GROUP = 23, UVM_REGISTER_GPU_VASPACE = 25,
    UVM_FREE = 34, UVM_REGISTER_GPU = 37,
};
enum { /* classes (sheet §8) */
    NV01_ROOT_CLIENT = 0x41, NV01_MEMORY_SYSTEM = 0x3E, NV01_DEVICE_0 = 0x80,
    NV20_SUBDEVICE_0 = 0x2080, FERMI_VASPACE_A = 0x90F1, KEPLER_CHANNEL_GROUP_A = 0xA06C,
    HOPPER_CHANNEL_GPFIFO_A = 0xC86F, HOPPER_COMPUTE_A = 0xCBC0,
};

struct name { uint32_t v; const char *s; };

static const struct name CLASS_NAMES[] = { /* §8 */
    {0x41, "NV01_ROOT_CLIENT"}, {0x3E, "NV01_MEMORY_SYSTEM"}, {0x80, "NV01_DEVICE_0"},
    {0x2080, "NV20_SUBDEVICE_0"}, {0x90F1, "FERMI_VASPACE_A"}, {0xA06C, "KEPLER_CHANNEL_GROUP_A"},
    {0xC86F, "HOPPER_CHANNEL_GPFIFO_A"}, {0xCBC0, "HOPPER_COMPUTE_A"},
};
static const struct name CTRL_NAMES[] = { /* §7 */
    {0x00000136, "NV0000_CTRL_CMD_SYSTEM_GET_FABRIC_STATUS"},
    {0x000001F0, "NV0000_CTRL_CMD_SYSTEM_GET_FEATURES"},
    {0x00000201, "NV0000_CTRL_CMD_GPU_GET_ATTACHED_IDS"},
    {0x00000205, "NV0000_CTRL_CMD_GPU_GET_ID_INFO_V2"},
    {0x00800292, "NV0080_CTRL_CMD_GPU_GET_CLASSLIST_V2"},
    {0x20800110, "NV2080_CTRL_CMD_GPU_GET_NAME_STRING"},
    {0x2080014A, "NV2080_CTRL_CMD_GPU_GET_GID_INFO"},
    {0x20800403, "NV2080_CTRL_CMD_TIMER_GET_TIME"},
    {0x20801303, "NV2080_CTRL_CMD_FB_GET_INFO_V2"},
    {0x20801801, "NV2080_CTRL_CMD_BUS_GET_PCI_INFO"},
    {0xA06C0101, "NVA06C_CTRL_CMD_GPFIFO_SCHEDULE"},
};
static const struct name STATUS_NAMES[] = { /* §6 */
    {0x0, "NV_OK"}, {0xF, "NV_ERR_GPU_IS_LOST"}, {0x1B, "NV_ERR_INSUFFICIENT_PERMISSIONS"},
    {0x1E, "NV_ERR_INVALID_ADDRESS"}, {0x1F, "NV_ERR_INVALID_ARGUMENT"},
    {0x22, "NV_ERR_INVALID_CLASS"}, {0x33, "NV_ERR_INVALID_OBJECT_HANDLE"},
    {0x56, "NV_ERR_NOT_SUPPORTED"}, {0x10006, "NV_WARN_NOTHING_TO_DO"},
};
#define NV_OK 0x0u
#define UNKNOWN_CTRL 0x20809999u   /* no such command: a decoder must show it raw */
#define UNKNOWN_STATUS 0x00007777u /* no such NV_STATUS: likewise */

static const char *lookup(const struct name *t, size_t n, uint32_t v) {
    for (size_t k = 0; k < n; k++)
        if (t[k].v == v) return t[k].s;
    return "";
}
#define NAME_OF(table, v) lookup(table, sizeof(table) / sizeof(table[0]), v)

/* RM handles, fixed so that the expectation can name them */
enum {
    H_CLIENT = 0xc1d00001, H_DEVICE = 0xc1d00002, H_SUBDEV = 0xc1d00003, H_VASPACE = 0xc1d00004,
    H_MEMORY = 0xc1d00005, H_CHANGRP = 0xc1d00006, H_CHANNEL = 0xc1d00007, H_COMPUTE = 0xc1d00008,
};
/* GPU-0a1b2c3d-0000-4000-8000-000000000000 as 16 raw bytes (UVM's NvProcessorUuid) */
static const unsigned char GPU_UUID[16] = {0x0a, 0x1b, 0x2c, 0x3d, 0, 0, 0x40, 0, 0x80, 0};
static const char GPU_UUID_STR[] = "GPU-0a1b2c3d-0000-4000-8000-000000000000";

/* ---- layouts that depend on the driver release (sheet §5.2, §9.4) ------------------------- */

static struct layout {
    int major;
    int nvos21_status, nvos21_params_size;              /* -1: no such field */
    int nvos64_size, nvos64_params_size, nvos64_flags, nvos64_status;
    int uvm_free_size, uvm_free_status;
} L;

static int set_layout(const char *version) {
    char *end;
    long major = strtol(version, &end, 10);
    if (end == version || (*end != '\0' && *end != '.') || major < 515) return -1;
    L.major = (int)major;
    if (major >= 535) { /* 535.43.02 on: NVOS21 32/@28 with paramsSize@24; NVOS64 48/@40 */
        L.nvos21_status = 28, L.nvos21_params_size = 24;
        L.nvos64_size = 48, L.nvos64_params_size = 32, L.nvos64_flags = 36, L.nvos64_status = 40;
    } else if (major >= 525) { /* 525, 530: NVOS21 32/@24; NVOS64 40/@36, flags@32 */
        L.nvos21_status = 24, L.nvos21_params_size = -1;
        L.nvos64_size = 40, L.nvos64_params_size = -1, L.nvos64_flags = 32, L.nvos64_status = 36;
    } else { /* 515, 520: NVOS21 32/@24; NVOS64 40/@32, no flags */
        L.nvos21_status = 24, L.nvos21_params_size = -1;
        L.nvos64_size = 40, L.nvos64_params_size = -1, L.nvos64_flags = -1, L.nvos64_status = 32;
    }
    /* UVM_FREE_PARAMS: 24/@16 up to 580, 16/@8 from 590.44.01 */
    L.uvm_free_size = major >= 590 ? 16 : 24;
    L.uvm_free_status = major >= 590 ? 8 : 16;
    return 0;
}

/* ---- the plan ---------------------------------------------------------------------------- */

enum slot { CTL_A, GPU_A, UVM_B, CTL_B, NSLOTS };
static const char *const SLOT_NAMES[NSLOTS] = {"nvidiactl", "nvidia0", "nvidia-uvm", "nvidiactl"};
static const char SLOT_THREAD[NSLOTS] = {'A', 'A', 'B', 'B'};

enum kind {
    K_VERSION, K_CARD_INFO, K_ALLOC21, K_ALLOC64, K_CONTROL, K_MAP, K_FREE,
    K_UVM_INIT, K_UVM_REG_GPU, K_UVM_REG_VAS, K_UVM_RANGE_GROUP, K_UVM_FREE,
};

struct call {
    char thread;
    enum kind kind;
    enum slot slot;
    int xfer;              /* sent through NV_ESC_IOCTL_XFER_CMD */
    uint32_t h0, h1, h2;   /* ALLOC: hRoot, hObjectParent, hObjectNew; CONTROL: hClient, hObject;
                              FREE: hRoot, hObjectParent, hObjectOld; MAP: hClient, hDevice, hMemory */
    uint32_t cls_or_cmd;   /* ALLOC: hClass; CONTROL: cmd */
    uint32_t params_size;  /* ALLOC: allocation params bytes; CONTROL: paramsSize */
    uint32_t status;       /* pre-set NV_STATUS */
};

/* The ioctl part, in global issue order. */
static const struct call SEQ[] = {
    {'A', K_VERSION, CTL_A, 0, 0, 0, 0, 0, 0, 0},
    {'A', K_CARD_INFO, CTL_A, 0, 0, 0, 0, 0, 0, 0},
    {'A', K_ALLOC21, CTL_A, 0, H_CLIENT, H_CLIENT, H_CLIENT, NV01_ROOT_CLIENT, 0, NV_OK},
    {'B', K_UVM_INIT, UVM_B, 0, 0, 0, 0, 0, 0, NV_OK},
    {'A', K_CONTROL, CTL_A, 0, H_CLIENT, H_CLIENT, 0, 0x00000201, 128, NV_OK},
    {'A', K_CONTROL, CTL_A, 0, H_CLIENT, H_CLIENT, 0, 0x00000205, 32, NV_OK},
    {'A', K_ALLOC64, CTL_A, 0, H_CLIENT, H_CLIENT, H_DEVICE, NV01_DEVICE_0, 56, NV_OK},
    {'B', K_CONTROL, CTL_B, 0, H_CLIENT, H_DEVICE, 0, 0x00800292, 804, NV_OK},
    {'A', K_ALLOC21, CTL_A, 0, H_CLIENT, H_DEVICE, H_SUBDEV, NV20_SUBDEVICE_0, 4, NV_OK},
    {'B', K_CONTROL, CTL_B, 1, H_CLIENT, H_SUBDEV, 0, 0x2080014A, 268, NV_OK},
    {'B', K_UVM_REG_GPU, UVM_B, 0, H_CLIENT, 0, 0, 0, 0, NV_OK},
    {'A', K_CONTROL, CTL_A, 0, H_CLIENT, H_SUBDEV, 0, 0x20801303, 1028, 0x56},
    {'A', K_ALLOC64, CTL_A, 0, H_CLIENT, H_DEVICE, H_VASPACE, FERMI_VASPACE_A, 56, NV_OK},
    {'B', K_UVM_REG_VAS, UVM_B, 0, H_CLIENT, H_VASPACE, 0, 0, 0, NV_OK},
    {'A', K_ALLOC21, CTL_A, 0, H_CLIENT, H_DEVICE, H_MEMORY, NV01_MEMORY_SYSTEM, 128, NV_OK},
    {'A', K_MAP, CTL_A, 0, H_CLIENT, H_DEVICE, H_MEMORY, 0, 0, NV_OK},
    {'B', K_UVM_RANGE_GROUP, UVM_B, 0, 0, 0, 0, 0, 0, NV_OK},
    {'A', K_ALLOC64, CTL_A, 1, H_CLIENT, H_DEVICE, H_CHANGRP, KEPLER_CHANNEL_GROUP_A, 20, NV_OK},
    {'B', K_CONTROL, CTL_B, 0, H_CLIENT, H_SUBDEV, 0, UNKNOWN_CTRL, 8, UNKNOWN_STATUS},
    {'A', K_ALLOC21, CTL_A, 0, H_CLIENT, H_CHANGRP, H_CHANNEL, HOPPER_CHANNEL_GPFIFO_A, 368, NV_OK},
    {'B', K_CONTROL, CTL_B, 0, H_CLIENT, H_CHANGRP, 0, 0xA06C0101, 3, 0x10006},
    {'A', K_ALLOC64, CTL_A, 0, H_CLIENT, H_CHANNEL, H_COMPUTE, HOPPER_COMPUTE_A, 16, 0x22},
    {'A', K_CONTROL, CTL_A, 0, H_CLIENT, H_SUBDEV, 0, 0x20801801, 16, 0x1F},
    {'B', K_UVM_FREE, UVM_B, 0, 0, 0, 0, 0, 0, 0x1E},
    {'A', K_FREE, CTL_A, 0, H_CLIENT, H_CHANNEL, H_COMPUTE, 0, 0, 0x33},
    {'B', K_CONTROL, CTL_B, 0, H_CLIENT, H_CLIENT, 0, 0x00000136, 4, 0x1B},
    {'A', K_FREE, CTL_A, 0, H_CLIENT, H_CLIENT, H_CLIENT, 0, 0, NV_OK},
};
#define NSEQ ((int)(sizeof(SEQ) / sizeof(SEQ[0])))

/* What the --fork child issues on the nvidiactl fd it inherits from thread A. */
static const struct call CHILD_SEQ[] = {
    {'C', K_CONTROL, CTL_A, 0, H_CLIENT, H_SUBDEV, 0, 0x20800403, 8, NV_OK},
    {'C', K_CONTROL, CTL_A, 0, H_CLIENT, H_CLIENT, 0, 0x000001F0, 4, NV_OK},
    {'C', K_CONTROL, CTL_A, 0, H_CLIENT, H_SUBDEV, 0, 0x20800110, 68, 0xF},
};
#define NCHILD ((int)(sizeof(CHILD_SEQ) / sizeof(CHILD_SEQ[0])))
/* --spin's call */
static const struct call SPIN_CALL = {'A', K_CONTROL, CTL_A, 0, H_CLIENT, H_SUBDEV, 0, 0x20800403, 8, NV_OK};

enum step_op { S_OPEN, S_IOCTL, S_FORK, S_MMAP, S_MUNMAP, S_CLOSE };
struct step { char thread; enum step_op op; int arg; }; /* arg: slot, or index into SEQ */

/* ---- state ------------------------------------------------------------------------------- */

static struct step *plan;
static int nplan;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int turn;

static const char *dev_dir = "/dev";
static const char *driver = "595.45.04";
static int out_fd = 1, dump_blocks;
static int fds[NSLOTS] = {-1, -1, -1, -1};
static int next_i;                     /* "i" of the next record: only the turn's owner writes */
static void *map_addr = MAP_FAILED;
static const size_t MAP_LEN = 4096;
static const char *thread_name = "main";
static __thread char my_thread[8];

static void die(const char *what) {
    fprintf(stderr, "gpucalls-error %s %d\n", what, errno);
    exit(3);
}

static void write_all(int fd, const char *buf, size_t len) {
    while (len > 0) {
        ssize_t n = write(fd, buf, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) die("write");
        buf += n, len -= (size_t)n;
    }
}

static void say(const char *line) { write_all(1, line, strlen(line)); }

/* Blocks until a full line or EOF on stdin; byte by byte so a later wait gets the next line. */
static void wait_line(void) {
    char c;
    while (read(0, &c, 1) == 1 && c != '\n') {}
}

/* ---- JSON -------------------------------------------------------------------------------- */

struct jbuf { char s[8192]; size_t n; };

static void jadd(struct jbuf *j, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(j->s + j->n, sizeof(j->s) - j->n, fmt, ap);
    va_end(ap);
    if (n > 0) j->n += (size_t)n < sizeof(j->s) - j->n ? (size_t)n : sizeof(j->s) - j->n - 1;
}

static void jhex(struct jbuf *j, const char *key, const void *p, size_t len) {
    jadd(j, ", \"%s\": \"", key);
    for (size_t k = 0; k < len; k++) jadd(j, "%02x", ((const unsigned char *)p)[k]);
    jadd(j, "\"");
}

static void jbegin(struct jbuf *j, const char *kind) {
    j->n = 0;
    jadd(j, "{\"i\": %d, \"pid\": %d, \"tid\": %d, \"thread\": \"%s\", \"kind\": \"%s\"", next_i++,
         (int)getpid(), (int)syscall(SYS_gettid), my_thread[0] ? my_thread : thread_name, kind);
}

static void jend(struct jbuf *j, long ret) {
    jadd(j, ", \"ret\": %ld}\n", ret);
    write_all(out_fd, j->s, j->n);
}

static void dev_path(char *buf, size_t len, enum slot s) {
    snprintf(buf, len, "%s/%s", dev_dir, SLOT_NAMES[s]);
}

/* ---- the calls --------------------------------------------------------------------------- */

static void put32(unsigned char *b, int off, uint32_t v) { if (off >= 0) memcpy(b + off, &v, 4); }
static void put64(unsigned char *b, int off, uint64_t v) { memcpy(b + off, &v, 8); }

/* Builds the block of `c` in blk; returns its size; sets nr (escape or UVM number), the status
 * offset (-1: none) and the call's name. `params` is the buffer the block points to. */
static int build_block(const struct call *c, unsigned char *blk, unsigned char *params, uint32_t *nr,
                       int *status_at, const char **name, const char **escape) {
    uint64_t pp = (uint64_t)(uintptr_t)params;
    int size = 0;
    *status_at = -1;
    *escape = "";
    switch (c->kind) {
    case K_VERSION: /* nv_ioctl_rm_api_version_t: cmd@0 (0 = STRICT), reply@4, versionString@8 */
        size = 72, *nr = ESC_CHECK_VERSION_STR, *name = "CHECK_VERSION_STR";
        snprintf((char *)blk + 8, 64, "%s", driver);
        break;
    case K_CARD_INFO: /* nv_ioctl_card_info_t[1], filled at exit */
        size = 72, *nr = ESC_CARD_INFO, *name = "CARD_INFO";
        break;
    case K_ALLOC21: /* NVOS21: hRoot@0 hObjectParent@4 hObjectNew@8 hClass@12 pAllocParms@16 */
    case K_ALLOC64: /* NVOS64: the same five fields, then pRightsRequested@24 (NULL) */
        *nr = ESC_RM_ALLOC, *name = "RM_ALLOC";
        put32(blk, 0, c->h0), put32(blk, 4, c->h1), put32(blk, 8, c->h2), put32(blk, 12, c->cls_or_cmd);
        put64(blk, 16, c->params_size ? pp : 0);
        if (c->kind == K_ALLOC21) {
            size = 32, *status_at = L.nvos21_status;
            put32(blk, L.nvos21_params_size, c->params_size);
        } else {
            size = L.nvos64_size, *status_at = L.nvos64_status;
            put32(blk, L.nvos64_params_size, c->params_size);
            put32(blk, L.nvos64_flags, 0);
        }
        break;
    case K_CONTROL: /* NVOS54: hClient@0 hObject@4 cmd@8 flags@12 params@16 paramsSize@24 status@28 */
        size = 32, *nr = ESC_RM_CONTROL, *name = "RM_CONTROL", *status_at = 28;
        put32(blk, 0, c->h0), put32(blk, 4, c->h1), put32(blk, 8, c->cls_or_cmd);
        put64(blk, 16, pp), put32(blk, 24, c->params_size);
        break;
    case K_MAP: /* NVOS33 + fd: hClient@0 hDevice@4 hMemory@8 offset@16 length@24 status@40 fd@48 */
        size = 56, *nr = ESC_RM_MAP_MEMORY, *name = "RM_MAP_MEMORY", *status_at = 40;
        put32(blk, 0, c->h0), put32(blk, 4, c->h1), put32(blk, 8, c->h2);
        put64(blk, 24, MAP_LEN), put32(blk, 48, (uint32_t)fds[GPU_A]);
        break;
    case K_FREE: /* NVOS00: hRoot@0 hObjectParent@4 hObjectOld@8 status@12 */
        size = 16, *nr = ESC_RM_FREE, *name = "RM_FREE", *status_at = 12;
        put32(blk, 0, c->h0), put32(blk, 4, c->h1), put32(blk, 8, c->h2);
        break;
    case K_UVM_INIT: /* flags@0 (8), rmStatus@8 */
        size = 16, *nr = UVM_INITIALIZE, *name = "UVM_INITIALIZE", *status_at = 8;
        break;
    case K_UVM_REG_GPU: /* gpu_uuid@0 numaEnabled@16 numaNodeId@20 rmCtrlFd@24 hClient@28
                           hSmcPartRef@32 rmStatus@36 */
        size = 40, *nr = UVM_REGISTER_GPU, *name = "UVM_REGISTER_GPU", *status_at = 36;
        memcpy(blk, GPU_UUID, 16), put32(blk, 24, (uint32_t)fds[CTL_B]), put32(blk, 28, c->h0);
        break;
    case K_UVM_REG_VAS: /* gpuUuid@0 rmCtrlFd@16 hClient@20 hVaSpace@24 rmStatus@28 */
        size = 32, *nr = UVM_REGISTER_GPU_VASPACE, *name = "UVM_REGISTER_GPU_VASPACE", *status_at = 28;
        memcpy(blk, GPU_UUID, 16), put32(blk, 16, (uint32_t)fds[CTL_B]);
        put32(blk, 20, c->h0), put32(blk, 24, c->h1);
        break;
    case K_UVM_RANGE_GROUP: /* rangeGroupId@0 (8, out), rmStatus@8 */
        size = 16, *nr = UVM_CREATE_RANGE_GROUP, *name = "UVM_CREATE_RANGE_GROUP", *status_at = 8;
        break;
    case K_UVM_FREE: /* base@0 (8), rmStatus at the release's offset */
        size = L.uvm_free_size, *nr = UVM_FREE, *name = "UVM_FREE", *status_at = L.uvm_free_status;
        put64(blk, 0, 0x7f0000000000ull);
        break;
    }
    if (c->kind < K_UVM_INIT) {
        static const struct name ESC[] = {
            {ESC_RM_FREE, "NV_ESC_RM_FREE"}, {ESC_RM_CONTROL, "NV_ESC_RM_CONTROL"},
            {ESC_RM_ALLOC, "NV_ESC_RM_ALLOC"}, {ESC_RM_MAP_MEMORY, "NV_ESC_RM_MAP_MEMORY"},
            {ESC_CARD_INFO, "NV_ESC_CARD_INFO"}, {ESC_CHECK_VERSION_STR, "NV_ESC_CHECK_VERSION_STR"},
        };
        *escape = NAME_OF(ESC, *nr);
    }
    if (*status_at >= 0) put32(blk, *status_at, c->status);
    return size;
}

static void json_handles(struct jbuf *j, const struct call *c) {
    const char *k0 = "", *k1 = "", *k2 = "";
    switch (c->kind) {
    case K_ALLOC21: case K_ALLOC64: k0 = "hRoot", k1 = "hObjectParent", k2 = "hObjectNew"; break;
    case K_CONTROL: k0 = "hClient", k1 = "hObject"; break;
    case K_FREE: k0 = "hRoot", k1 = "hObjectParent", k2 = "hObjectOld"; break;
    case K_MAP: k0 = "hClient", k1 = "hDevice", k2 = "hMemory"; break;
    case K_UVM_REG_GPU: k0 = "hClient"; break;
    case K_UVM_REG_VAS: k0 = "hClient", k1 = "hVaSpace"; break;
    default: break;
    }
    jadd(j, ", \"handles\": {");
    const char *keys[3] = {k0, k1, k2};
    uint32_t vals[3] = {c->h0, c->h1, c->h2};
    for (int k = 0, first = 1; k < 3; k++) {
        if (!keys[k][0]) continue;
        jadd(j, "%s\"%s\": \"0x%08x\"", first ? "" : ", ", keys[k], vals[k]);
        first = 0;
    }
    jadd(j, "}");
}

static void json_args(struct jbuf *j, const struct call *c) {
    jadd(j, ", \"args\": {");
    switch (c->kind) {
    case K_VERSION: jadd(j, "\"cmd\": 0, \"versionString\": \"%s\"", driver); break;
    case K_CARD_INFO: jadd(j, "\"count\": 1"); break;
    case K_MAP: jadd(j, "\"fd\": %d, \"offset\": 0, \"length\": %zu", fds[GPU_A], MAP_LEN); break;
    case K_UVM_REG_GPU: case K_UVM_REG_VAS:
        jadd(j, "\"gpu_uuid\": \"%s\", \"rmCtrlFd\": %d", GPU_UUID_STR, fds[CTL_B]);
        break;
    case K_UVM_FREE: jadd(j, "\"base\": %llu", 0x7f0000000000ull); break;
    default: break;
    }
    jadd(j, "}");
}

/* Issues one call of the plan and writes its line. */
static void issue(const struct call *c) {
    _Alignas(8) unsigned char blk[80] = {0};
    _Alignas(8) unsigned char xfer[16] = {0};
    static __thread _Alignas(8) unsigned char params[2048];
    uint32_t nr;
    int status_at;
    const char *name, *escape;
    int size = build_block(c, blk, params, &nr, &status_at, &name, &escape);
    int uvm = c->kind >= K_UVM_INIT;
    unsigned long request = uvm ? nr : NV_IOWR(nr, size);
    void *arg = blk;
    if (c->xfer) { /* nv_ioctl_xfer_t: cmd@0 (the bare escape nr), size@4, ptr@8 */
        put32(xfer, 0, nr), put32(xfer, 4, (uint32_t)size), put64(xfer, 8, (uint64_t)(uintptr_t)blk);
        request = NV_IOWR(ESC_IOCTL_XFER_CMD, sizeof(xfer));
        arg = xfer;
    }
    struct jbuf j;
    char path[512];
    dev_path(path, sizeof(path), c->slot);
    jbegin(&j, "ioctl");
    jadd(&j, ", \"device\": \"%s\", \"fd\": %d, \"request\": %lu, \"arg\": %lu, \"call\": \"%s\"",
         path, fds[c->slot], request, (unsigned long)(uintptr_t)arg, name);
    jadd(&j, ", \"escape\": \"%s\", \"nr\": %u, \"xfer\": %s, \"size\": %d", escape, nr,
         c->xfer ? "true" : "false", size);
    int alloc = c->kind == K_ALLOC21 || c->kind == K_ALLOC64;
    if (alloc) jadd(&j, ", \"h_class\": %u, \"class_name\": \"%s\"", c->cls_or_cmd, NAME_OF(CLASS_NAMES, c->cls_or_cmd));
    else jadd(&j, ", \"h_class\": null, \"class_name\": \"\"");
    if (c->kind == K_CONTROL) jadd(&j, ", \"cmd\": %u, \"cmd_name\": \"%s\"", c->cls_or_cmd, NAME_OF(CTRL_NAMES, c->cls_or_cmd));
    else jadd(&j, ", \"cmd\": null, \"cmd_name\": \"\"");
    if (c->kind == K_CONTROL || alloc) jadd(&j, ", \"params_size\": %u", c->params_size);
    else jadd(&j, ", \"params_size\": null");
    json_handles(&j, c);
    json_args(&j, c);
    if (status_at >= 0)
        jadd(&j, ", \"status_offset\": %d, \"nv_status\": %u, \"nv_status_name\": \"%s\"", status_at,
             c->status, NAME_OF(STATUS_NAMES, c->status));
    else
        jadd(&j, ", \"status_offset\": null, \"nv_status\": null, \"nv_status_name\": \"\"");
    if (dump_blocks) { /* the bytes at entry: with ENOTTY nothing is ever written back */
        jhex(&j, "block_hex", blk, (size_t)size);
        if (c->xfer) jhex(&j, "xfer_hex", xfer, sizeof(xfer));
    }
    long ret = ioctl(fds[c->slot], request, arg);
    jend(&j, ret < 0 ? -errno : ret);
}

static void do_open(enum slot s) {
    char path[512];
    dev_path(path, sizeof(path), s);
    int flags = O_RDWR | O_CLOEXEC;
    int fd = open(path, flags);
    int err = errno;
    fds[s] = fd;
    struct jbuf j;
    jbegin(&j, "open");
    jadd(&j, ", \"device\": \"%s\", \"path\": \"%s\", \"flags\": %d, \"fd\": %d", path, path, flags, fd);
    jend(&j, fd < 0 ? -err : fd);
}

static void do_close(enum slot s) {
    char path[512];
    dev_path(path, sizeof(path), s);
    int fd = fds[s];
    int ret = close(fd);
    int err = errno;
    fds[s] = -1;
    struct jbuf j;
    jbegin(&j, "close");
    jadd(&j, ", \"device\": \"%s\", \"fd\": %d", path, fd);
    jend(&j, ret < 0 ? -err : ret);
}

static void do_mmap(void) {
    char path[512];
    dev_path(path, sizeof(path), GPU_A);
    int prot = PROT_READ | PROT_WRITE, flags = MAP_SHARED;
    map_addr = mmap(NULL, MAP_LEN, prot, flags, fds[GPU_A], 0);
    int err = errno;
    struct jbuf j;
    jbegin(&j, "mmap");
    jadd(&j, ", \"device\": \"%s\", \"fd\": %d, \"length\": %zu, \"prot\": %d, \"flags\": %d, \"offset\": 0",
         path, fds[GPU_A], MAP_LEN, prot, flags);
    jend(&j, map_addr == MAP_FAILED ? -err : (long)(uintptr_t)map_addr);
}

static void do_munmap(void) {
    if (map_addr == MAP_FAILED) return; /* nothing mapped (a `c 1 3` node): no call, no line */
    char path[512];
    dev_path(path, sizeof(path), GPU_A);
    int ret = munmap(map_addr, MAP_LEN);
    int err = errno;
    struct jbuf j;
    jbegin(&j, "munmap");
    jadd(&j, ", \"device\": \"%s\", \"addr\": %lu, \"length\": %zu", path, (unsigned long)(uintptr_t)map_addr, MAP_LEN);
    jend(&j, ret < 0 ? -err : ret);
    map_addr = MAP_FAILED;
}

/* Thread A forks; the child issues CHILD_SEQ and exits with the number of lines it wrote. The
 * child starts only once the parent has written the fork line, so the file stays in issue order. */
static void do_fork(void) {
    int go[2];
    if (pipe2(go, O_CLOEXEC) < 0) die("pipe");
    struct jbuf j;
    jbegin(&j, "fork");
    pid_t child = fork();
    if (child < 0) die("fork");
    if (child == 0) {
        char b;
        close(go[1]);
        if (read(go[0], &b, 1) != 1) _exit(100);
        snprintf(my_thread, sizeof(my_thread), "child");
        for (int k = 0; k < NCHILD; k++) issue(&CHILD_SEQ[k]);
        _exit(NCHILD);
    }
    close(go[0]);
    jadd(&j, ", \"child_pid\": %d", (int)child);
    jend(&j, child);
    if (write(go[1], "g", 1) != 1) die("fork-go");
    close(go[1]);
    int status = 0;
    while (waitpid(child, &status, 0) < 0 && errno == EINTR) {}
    if (!WIFEXITED(status) || WEXITSTATUS(status) != NCHILD) { errno = ECHILD; die("fork-child"); }
    next_i += NCHILD;
}

static void run_step(const struct step *s) {
    switch (s->op) {
    case S_OPEN: do_open((enum slot)s->arg); break;
    case S_IOCTL: issue(&SEQ[s->arg]); break;
    case S_FORK: do_fork(); break;
    case S_MMAP: do_mmap(); break;
    case S_MUNMAP: do_munmap(); break;
    case S_CLOSE: do_close((enum slot)s->arg); break;
    }
}

static void *thread_main(void *arg) {
    char me = *(const char *)arg;
    snprintf(my_thread, sizeof(my_thread), "%c", me);
    for (int k = 0; k < nplan; k++) {
        if (plan[k].thread != me) continue;
        pthread_mutex_lock(&mu);
        while (turn != k) pthread_cond_wait(&cv, &mu);
        pthread_mutex_unlock(&mu);
        run_step(&plan[k]);
        pthread_mutex_lock(&mu);
        turn++;
        pthread_cond_broadcast(&cv);
        pthread_mutex_unlock(&mu);
    }
    return NULL;
}

static void add_step(char thread, enum step_op op, int arg) {
    plan[nplan++] = (struct step){thread, op, arg};
}

/* opens (A: nvidiactl, nvidia0; B: nvidia-uvm, its own nvidiactl), the ioctl part `loops` times,
 * the fork (A), mmap + munmap of nvidia0 (A), closes (B first, then A). */
static void build_plan(int loops, int with_fork) {
    plan = calloc((size_t)(NSLOTS * 2 + 3 + loops * NSEQ), sizeof(*plan));
    if (plan == NULL) die("calloc");
    for (int s = 0; s < NSLOTS; s++) add_step(SLOT_THREAD[s], S_OPEN, s);
    for (int l = 0; l < loops; l++)
        for (int k = 0; k < NSEQ; k++) add_step(SEQ[k].thread, S_IOCTL, k);
    if (with_fork) add_step('A', S_FORK, 0);
    add_step('A', S_MMAP, 0);
    add_step('A', S_MUNMAP, 0);
    for (int s = NSLOTS - 1; s >= 0; s--) add_step(SLOT_THREAD[s], S_CLOSE, s);
}

static void spin(long calls) {
    do_open(CTL_A);
    _Alignas(8) unsigned char blk[80] = {0}, params[64] = {0};
    uint32_t nr;
    int status_at;
    const char *name, *escape;
    int size = build_block(&SPIN_CALL, blk, params, &nr, &status_at, &name, &escape);
    unsigned long request = NV_IOWR(nr, size);
    int fd = fds[CTL_A];
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long k = 0; k < calls; k++) (void)ioctl(fd, request, blk);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double ns = (double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec);
    struct jbuf j;
    jbegin(&j, "spin");
    jadd(&j, ", \"device\": \"%s/%s\", \"fd\": %d, \"request\": %lu, \"call\": \"%s\", \"cmd\": %u"
         ", \"calls\": %ld", dev_dir, SLOT_NAMES[CTL_A], fd, request, name, SPIN_CALL.cls_or_cmd, calls);
    jend(&j, 0);
    do_close(CTL_A);
    char line[128];
    snprintf(line, sizeof(line), "{\"calls\": %ld, \"ns_per_call\": %.1f}\n", calls, calls ? ns / (double)calls : 0.0);
    say(line);
}

static void private_dev(char **devs, int ndev) {
    if (unshare(CLONE_NEWNS) < 0) die("unshare-mnt");
    /* Without this a shared / (systemd hosts) would propagate our tmpfs to the host. */
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) die("make-private");
    if (mount("tmpfs", dev_dir, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=64k") < 0) die("mount-dev");
    for (int k = 0; k < ndev; k++) {
        char path[512], name[128];
        unsigned maj, min;
        if (sscanf(devs[k], "%127[^:]:%u:%u", name, &maj, &min) != 3) { errno = EINVAL; die(devs[k]); }
        snprintf(path, sizeof(path), "%s/%s", dev_dir, name);
        if (mknod(path, S_IFCHR | 0666, makedev(maj, min)) < 0) die(path);
        chmod(path, 0666); /* mknod's mode is masked by umask */
    }
}

static void usage(const char *why) {
    fprintf(stderr, "gpucalls: %s (see the header of tests/helpers/gpucalls.c)\n", why);
    exit(2);
}

static long count_arg(const char *s, const char *opt) {
    char *end;
    long v = strtol(s, &end, 10);
    if (*s == '\0' || *end != '\0' || v < 0) usage(opt);
    return v;
}

int main(int argc, char **argv) {
    const char *out = NULL;
    int ready = 0, hold = 0, with_fork = 0, ndev = 0, ncg = 0;
    long loops = 1, spin_calls = -1;
    char *devs[16], *cgroups[16];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int has = i + 1 < argc;
        if (strcmp(a, "--ready") == 0) ready = 1;
        else if (strcmp(a, "--hold") == 0) hold = 1;
        else if (strcmp(a, "--fork") == 0) with_fork = 1;
        else if (strcmp(a, "--dump-blocks") == 0) dump_blocks = 1;
        else if (!has) usage(a);
        else if (strcmp(a, "--dev-dir") == 0) dev_dir = argv[++i];
        else if (strcmp(a, "--driver") == 0) driver = argv[++i];
        else if (strcmp(a, "--out") == 0) out = argv[++i];
        else if (strcmp(a, "--loop") == 0) loops = count_arg(argv[++i], a);
        else if (strcmp(a, "--spin") == 0) spin_calls = count_arg(argv[++i], a);
        else if (strcmp(a, "--private-dev") == 0 && ndev < 16) devs[ndev++] = argv[++i];
        else if (strcmp(a, "--cgroup") == 0 && ncg < 16) cgroups[ncg++] = argv[++i];
        else usage(a);
    }
    if (set_layout(driver) < 0) usage("--driver: a release 515 or newer, such as 535.43.02");
    for (int k = 0; k < ncg; k++) {
        int fd = open(cgroups[k], O_WRONLY | O_CLOEXEC);
        if (fd < 0 || write(fd, "0", 1) != 1) die(cgroups[k]);
        close(fd);
    }
    /* before the private /dev: an --out under it (/dev/stdout) still names the caller's file */
    if (out != NULL && (out_fd = open(out, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)) < 0) die(out);
    if (ndev > 0) private_dev(devs, ndev);
    if (ready) {
        char line[64];
        snprintf(line, sizeof(line), "ready %d\n", (int)getpid());
        say(line);
        wait_line();
    }
    if (spin_calls >= 0) {
        spin(spin_calls);
    } else {
        build_plan((int)loops, with_fork);
        pthread_t a, b;
        static const char A = 'A', B = 'B';
        if (pthread_create(&a, NULL, thread_main, (void *)&A) != 0) die("thread-a");
        if (pthread_create(&b, NULL, thread_main, (void *)&B) != 0) die("thread-b");
        pthread_join(a, NULL);
        pthread_join(b, NULL);
    }
    say("done\n");
    if (hold) wait_line();
    return 0;
}
