/* rmplan: issues an exact sequence of NVIDIA RM calls, one step per line, and prints what the
 * driver answered: for tests that plant GPU memory through the fake driver (tests/helpers/
 * fakedriver/) and check what the tracer made of it.
 *
 * Every escape number, block layout, status offset, class and UVM number here is copied from
 * docs/reference/nvidia-ioctl-abi.md (§1-§4, §8, §9), which cites NVIDIA/open-gpu-kernel-modules
 * (kernel-open/common/inc/nv-ioctl.h, nv-ioctl-numbers.h, src/common/sdk/nvidia/inc/nvos.h,
 * class/cl0080.h, class/cl2080.h, kernel-open/nvidia-uvm/uvm_ioctl.h). It is written from the
 * sheet, independently of tracer/nvabi.py and tracer/memcall_decode.py.
 *
 * Usage: rmplan [--dev-dir DIR] [--driver VERSION] [--private-dev NAME=PATH]... [STEP]...
 *   --dev-dir      where nvidiactl, nvidiaN and nvidia-uvm are (default /dev)
 *   --driver       the release whose RM_ALLOC layouts to use (default 595.45.04; 515 and newer)
 *   --private-dev  first: own mount namespace, a tmpfs on /dev, and PATH bind-mounted on
 *                  /dev/NAME (root), so the calls go through /dev/NAME as on a GPU node
 *   STEP           one step per argument (an argument may also hold several lines); with no
 *                  STEP, steps are read from stdin one line at a time and each is run as it comes
 *
 * Steps (REF: a handle: `last`, `client`, a $NAME given by `as NAME`, or a number; GPU: 0, 1, ...):
 *   open ctl|uvm|gpu N           open DEV_DIR/nvidiactl, nvidia-uvm, nvidiaN (the latest one of
 *                                each is used by later steps)
 *   close ctl|uvm|gpu N          close it
 *   card-info                    NV_ESC_CARD_INFO: prints the GPUs (minor, gpu_id, PCI)
 *   version                      NV_ESC_CHECK_VERSION_STR (query): prints the driver's version
 *   attach                       NV_ESC_ATTACH_GPUS_TO_FD with card-info's GPU ids
 *   register-fd N                NV_ESC_REGISTER_FD on nvidiaN with the ctl fd
 *   client                       RM_ALLOC of NV01_ROOT_CLIENT (hObjectNew 0: RM picks it); the
 *                                new client is the current one
 *   use REF                      make REF the current client
 *   device N                     RM_ALLOC NV01_DEVICE_0 under the client, deviceId N
 *   subdevice [N]                RM_ALLOC NV20_SUBDEVICE_0 under device N (default: the last)
 *   alloc-mem GPU|none BYTES [xfer] [nvos64] [class=C] [attr=A] [handle=H]
 *                                RM_ALLOC of a memory class (default NV01_MEMORY_LOCAL_USER)
 *                                with NV_MEMORY_ALLOCATION_PARAMS.size = BYTES, under GPU's
 *                                device (none: under the client); xfer: inside
 *                                NV_ESC_IOCTL_XFER_CMD; nvos64: the NVOS64 block
 *   heap-alloc GPU BYTES [xfer] [handle=H] [flags=F]
 *                                RM_VID_HEAP_CONTROL ALLOC_SIZE under GPU's device; F:
 *                                AllocSize.flags (0x80000: NVOS32_ALLOC_FLAGS_VIRTUAL)
 *   heap-free REF                RM_VID_HEAP_CONTROL FREE of hMemory REF
 *   alloc-memory GPU BYTES [class=C]
 *                                RM_ALLOC_MEMORY (NVOS02 + fd, on nvidiaGPU): limit BYTES-1
 *   alloc CLASS [parent=REF] [nvos64] [xfer]
 *                                RM_ALLOC of any class, no allocation parameters
 *   alloc-object CLASS [parent=REF]
 *                                RM_ALLOC_OBJECT (NVOS05)
 *   free REF [parent=REF]        RM_FREE of REF (`free client`: the whole client)
 *   dup REF [from REF] [gpu G]   RM_DUP_OBJECT of REF (in client `from`, default the current)
 *                                into the current client, under its device of GPU G (default 0)
 *   control [CMD]                RM_CONTROL on the current client (no params)
 *   uvm-init                     UVM_INITIALIZE on the uvm fd
 *   ready                        print "ready <pid>"; with steps on argv, then wait for a stdin line
 *   hold                         wait for a stdin line (or EOF)
 *   sleep MS
 *   exit [CODE]                  _exit now: the fds close with the process
 * Any step that makes a handle takes a trailing `as NAME`.
 * Each step prints one JSON line: {"i", "op", "ret" (the ioctl's return, -errno on failure),
 * "status" (NV_STATUS, null when there is none or the ioctl failed), "status_name", and per op
 * "fd", "client", "parent", "handle", "class", "gpu", "requested_bytes", "size_bytes" (what the
 * driver wrote back), "gpus" (card-info), "version"}. A bad step prints {"i", "op", "error"} and
 * exits 2; a setup failure prints "rmplan-error <what> <errno>" on stderr and exits 3.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <sched.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define NV_IOWR(nr, size) ((3u << 30) | ((uint32_t)(size) << 16) | (0x46u << 8) | (uint32_t)(nr))

enum { /* escapes (sheet §2) */
    ESC_RM_ALLOC_MEMORY = 0x27, ESC_RM_ALLOC_OBJECT = 0x28, ESC_RM_FREE = 0x29,
    ESC_RM_CONTROL = 0x2A, ESC_RM_ALLOC = 0x2B, ESC_RM_DUP_OBJECT = 0x34,
    ESC_RM_VID_HEAP_CONTROL = 0x4A, ESC_CARD_INFO = 0xC8, ESC_REGISTER_FD = 0xC9,
    ESC_CHECK_VERSION_STR = 0xD2, ESC_IOCTL_XFER_CMD = 0xD3, ESC_ATTACH_GPUS_TO_FD = 0xD4,
};
enum { /* classes (sheet §8) */
    NV01_ROOT_CLIENT = 0x41, NV01_MEMORY_LOCAL_USER = 0x40, NV01_MEMORY_SYSTEM = 0x3E,
    NV01_DEVICE_0 = 0x80, NV20_SUBDEVICE_0 = 0x2080,
};
#define UVM_INITIALIZE 0x30000001u /* sheet §9.1: a plain number, UVM_INITIALIZE_PARAMS 16 bytes */
#define CARD_INFO_ENTRIES 8

/* NV_STATUS names for the ones a fake or real driver gives these calls (sheet §6) */
static const struct { uint32_t v; const char *s; } STATUS_NAMES[] = {
    {0x0, "NV_OK"}, {0x16, "NV_ERR_ILLEGAL_ACTION"}, {0x1A, "NV_ERR_INSUFFICIENT_RESOURCES"},
    {0x1F, "NV_ERR_INVALID_ARGUMENT"}, {0x22, "NV_ERR_INVALID_CLASS"}, {0x23, "NV_ERR_INVALID_CLIENT"},
    {0x31, "NV_ERR_INVALID_OBJECT"}, {0x33, "NV_ERR_INVALID_OBJECT_HANDLE"},
    {0x34, "NV_ERR_INVALID_OBJECT_NEW"}, {0x36, "NV_ERR_INVALID_OBJECT_PARENT"},
    {0x3D, "NV_ERR_INVALID_POINTER"}, {0x51, "NV_ERR_NO_MEMORY"}, {0x57, "NV_ERR_OBJECT_NOT_FOUND"},
};

/* RM_ALLOC layouts per release family (sheet §3.1, §5.2) */
struct layout { int first_major; uint32_t nvos21_status, nvos21_params_size, nvos64_bytes, nvos64_status, nvos64_params_size; };
static const struct layout LAYOUTS[] = {
    {515, 24, 0, 40, 32, 0},
    {525, 24, 0, 40, 36, 0},
    {535, 28, 24, 48, 40, 32},
};
static const struct layout *L = &LAYOUTS[2];

static const char *dev_dir = "/dev";
static int ctl_fd = -1, uvm_fd = -1, gpu_fd[8] = {-1, -1, -1, -1, -1, -1, -1, -1};
static uint32_t gpu_ids[CARD_INFO_ENTRIES];
static int n_gpu_ids;
static int from_stdin;

#define MAX_CLIENTS 64
static struct { uint32_t handle, device[8], subdevice[8]; int last_device; } clients[MAX_CLIENTS];
static int nclients, cur = -1;
static uint32_t last_handle;

#define MAX_NAMES 256
static struct { char name[64]; uint32_t handle; } names[MAX_NAMES];
static int nnames;

static int step_no;
static const char *step_op = "";

static void die_setup(const char *what) {
    fprintf(stderr, "rmplan-error %s %d\n", what, errno);
    exit(3);
}

static void bad_step(const char *fmt, ...) {
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    printf("{\"i\": %d, \"op\": \"%s\", \"error\": \"%s\"}\n", step_no, step_op, msg);
    fflush(stdout);
    exit(2);
}

static uint32_t rd32(const uint8_t *b, size_t off) { uint32_t v; memcpy(&v, b + off, 4); return v; }
static uint64_t rd64(const uint8_t *b, size_t off) { uint64_t v; memcpy(&v, b + off, 8); return v; }
static void wr32(uint8_t *b, size_t off, uint32_t v) { memcpy(b + off, &v, 4); }
static void wr64(uint8_t *b, size_t off, uint64_t v) { memcpy(b + off, &v, 8); }

static const char *status_name(uint32_t s) {
    for (size_t i = 0; i < sizeof(STATUS_NAMES) / sizeof(STATUS_NAMES[0]); i++)
        if (STATUS_NAMES[i].v == s) return STATUS_NAMES[i].s;
    return "";
}

/* ---- output: one JSON object per step, built field by field ------------------------------- */

static char out[8192];
static size_t outlen;

static void field(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    outlen += (size_t)vsnprintf(out + outlen, sizeof(out) - outlen, fmt, ap);
    va_end(ap);
    if (outlen >= sizeof(out)) outlen = sizeof(out) - 1;
}

static void begin(void) {
    outlen = 0;
    field("{\"i\": %d, \"op\": \"%s\"", step_no, step_op);
}

/* ret/status of one ioctl: status is read only when the ioctl returned 0 (sheet §1 step 5) */
static void result(int ret, const uint8_t *b, int status_at) {
    field(", \"ret\": %d", ret);
    if (ret == 0 && status_at >= 0) {
        uint32_t s = rd32(b, (size_t)status_at);
        field(", \"status\": %u, \"status_name\": \"%s\"", s, status_name(s));
    } else {
        field(", \"status\": null");
    }
}

static void end(void) {
    field("}\n");
    fputs(out, stdout);
    fflush(stdout);
}

static int ok(int ret, const uint8_t *b, int status_at) {
    return ret == 0 && (status_at < 0 || rd32(b, (size_t)status_at) == 0);
}

/* ---- references --------------------------------------------------------------------------- */

static uint32_t resolve(const char *ref) {
    if (strcmp(ref, "last") == 0) return last_handle;
    if (strcmp(ref, "client") == 0) {
        if (cur < 0) bad_step("no client yet");
        return clients[cur].handle;
    }
    char *end = NULL;
    unsigned long v = strtoul(ref, &end, 0);
    if (end != ref && *end == '\0') return (uint32_t)v;
    const char *name = ref[0] == '$' ? ref + 1 : ref;
    for (int i = nnames - 1; i >= 0; i--)
        if (strcmp(names[i].name, name) == 0) return names[i].handle;
    bad_step("unknown handle %s", ref);
    return 0;
}

static void name_it(const char *name, uint32_t h) {
    if (name == NULL) return;
    if (nnames >= MAX_NAMES) bad_step("too many names");
    snprintf(names[nnames].name, sizeof(names[0].name), "%s", name[0] == '$' ? name + 1 : name);
    names[nnames++].handle = h;
}

static int need_client(void) {
    if (cur < 0) bad_step("no client yet: run `client` first");
    return cur;
}

static uint32_t device_of(int gpu) {
    int c = need_client();
    if (gpu < 0 || gpu >= 8 || clients[c].device[gpu] == 0) bad_step("no device %d in this client: run `device %d`", gpu, gpu);
    return clients[c].device[gpu];
}

static int need_fd(int fd, const char *what) {
    if (fd < 0) bad_step("%s is not open", what);
    return fd;
}

static int do_ioctl(int fd, unsigned long req, void *arg) {
    int r = ioctl(fd, req, arg);
    return r < 0 ? -errno : r;
}

/* One RM escape, plain or inside NV_ESC_IOCTL_XFER_CMD (nv_ioctl_xfer_t {cmd@0, size@4, ptr@8}). */
static int rm_call(int fd, uint32_t nr, void *blk, uint32_t size, int xfer) {
    if (!xfer) return do_ioctl(fd, NV_IOWR(nr, size), blk);
    uint8_t x[16];
    wr32(x, 0, nr);
    wr32(x, 4, size);
    wr64(x, 8, (uint64_t)(uintptr_t)blk);
    return do_ioctl(fd, NV_IOWR(ESC_IOCTL_XFER_CMD, sizeof(x)), x);
}

/* RM_ALLOC through NVOS21 (32 bytes) or NVOS64 (sheet §3.1); returns the ret, fills b. */
static int rm_alloc(uint8_t *b, int nvos64, int xfer, uint32_t root, uint32_t parent, uint32_t h,
                    uint32_t cls, void *params, uint32_t params_size, int *status_at) {
    uint32_t size = nvos64 ? L->nvos64_bytes : 32;
    memset(b, 0, 48);
    wr32(b, 0, root);
    wr32(b, 4, parent);
    wr32(b, 8, h);
    wr32(b, 12, cls);
    wr64(b, 16, (uint64_t)(uintptr_t)params);
    uint32_t ps_at = nvos64 ? L->nvos64_params_size : L->nvos21_params_size;
    if (ps_at) wr32(b, ps_at, params_size);
    *status_at = (int)(nvos64 ? L->nvos64_status : L->nvos21_status);
    wr32(b, (size_t)*status_at, 0xFFFFFFFFu); /* so an unwritten status shows */
    return rm_call(need_fd(ctl_fd, "ctl"), ESC_RM_ALLOC, b, size, xfer);
}

/* ---- steps ---------------------------------------------------------------------------------- */

#define MAX_WORDS 16

static int has_word(char **w, int n, const char *word) {
    for (int i = 0; i < n; i++)
        if (strcmp(w[i], word) == 0) return 1;
    return 0;
}

static const char *opt_value(char **w, int n, const char *key) {
    size_t k = strlen(key);
    for (int i = 0; i < n; i++)
        if (strncmp(w[i], key, k) == 0 && w[i][k] == '=') return w[i] + k + 1;
    return NULL;
}

static uint64_t num(const char *s, const char *what) {
    char *end = NULL;
    unsigned long long v = strtoull(s, &end, 0);
    if (s[0] == '\0' || *end != '\0') bad_step("%s: %s is not a number", what, s);
    return v;
}

static void wait_line(void) {
    char buf[256];
    if (fgets(buf, sizeof(buf), stdin) == NULL) return;
}

static int *fd_slot(char **w, int n, const char **what) {
    if (n >= 2 && strcmp(w[1], "ctl") == 0) { *what = "nvidiactl"; return &ctl_fd; }
    if (n >= 2 && strcmp(w[1], "uvm") == 0) { *what = "nvidia-uvm"; return &uvm_fd; }
    if (n >= 3 && strcmp(w[1], "gpu") == 0) {
        uint64_t g = num(w[2], "gpu");
        if (g >= 8) bad_step("gpu %s out of range", w[2]);
        *what = NULL;
        return &gpu_fd[g];
    }
    bad_step("want ctl, uvm or gpu N");
    return NULL;
}

static void step_open(char **w, int n) {
    const char *what;
    int *slot = fd_slot(w, n, &what);
    char path[512], name[32];
    if (what == NULL) { snprintf(name, sizeof(name), "nvidia%s", w[2]); what = name; }
    snprintf(path, sizeof(path), "%s/%s", dev_dir, what);
    int fd = open(path, O_RDWR);
    begin();
    field(", \"path\": \"%s\", \"ret\": %d, \"fd\": %d", path, fd < 0 ? -errno : 0, fd);
    end();
    if (fd >= 0) *slot = fd;
}

static void step_close(char **w, int n) {
    const char *what;
    int *slot = fd_slot(w, n, &what);
    int fd = *slot;
    int r = fd >= 0 ? close(fd) : -1;
    begin();
    field(", \"fd\": %d, \"ret\": %d", fd, r < 0 ? -errno : 0);
    end();
    *slot = -1;
}

static void step_card_info(void) {
    uint8_t b[72 * CARD_INFO_ENTRIES] = {0};
    int r = do_ioctl(need_fd(ctl_fd, "ctl"), NV_IOWR(ESC_CARD_INFO, sizeof(b)), b);
    begin();
    result(r, b, -1);
    field(", \"gpus\": [");
    n_gpu_ids = 0;
    for (int i = 0; r == 0 && i < CARD_INFO_ENTRIES; i++) {
        const uint8_t *e = b + 72 * i; /* nv_ioctl_card_info_t (sheet §4) */
        if (!e[0]) continue;
        gpu_ids[n_gpu_ids] = rd32(e, 16);
        field("%s{\"minor\": %u, \"gpu_id\": %u, \"pci_bus_id\": \"%08x:%02x:%02x.0\"}", n_gpu_ids ? ", " : "",
              rd32(e, 56), rd32(e, 16), rd32(e, 4), e[8], e[9]);
        n_gpu_ids++;
    }
    field("]");
    end();
}

static void step_version(void) {
    uint8_t b[72] = {0};
    wr32(b, 0, 0x32); /* NV_RM_API_VERSION_CMD_QUERY (osapi.c, sheet §4) */
    int r = do_ioctl(need_fd(ctl_fd, "ctl"), NV_IOWR(ESC_CHECK_VERSION_STR, sizeof(b)), b);
    b[71] = 0;
    begin();
    result(r, b, -1);
    field(", \"reply\": %u, \"version\": \"%s\"", rd32(b, 4), (char *)b + 8);
    end();
}

static void step_attach(void) {
    uint32_t ids[CARD_INFO_ENTRIES];
    int n = n_gpu_ids;
    if (n == 0) bad_step("no GPU ids: run card-info first");
    memcpy(ids, gpu_ids, sizeof(ids));
    int r = do_ioctl(need_fd(ctl_fd, "ctl"), NV_IOWR(ESC_ATTACH_GPUS_TO_FD, 4 * (uint32_t)n), ids);
    begin();
    result(r, NULL, -1);
    end();
}

static void step_register_fd(char **w, int n) {
    if (n < 2) bad_step("want register-fd N");
    uint64_t g = num(w[1], "gpu");
    if (g >= 8) bad_step("gpu out of range");
    int32_t ctl = need_fd(ctl_fd, "ctl");
    int r = do_ioctl(need_fd(gpu_fd[g], "gpu"), NV_IOWR(ESC_REGISTER_FD, 4), &ctl);
    begin();
    result(r, NULL, -1);
    end();
}

static void step_client(const char *as) {
    uint8_t b[48];
    int status_at;
    int r = rm_alloc(b, 0, 0, 0, 0, 0, NV01_ROOT_CLIENT, NULL, 0, &status_at);
    begin();
    result(r, b, status_at);
    uint32_t h = rd32(b, 8);
    field(", \"fd\": %d, \"handle\": %u, \"class\": %u", ctl_fd, h, rd32(b, 12));
    end();
    if (!ok(r, b, status_at)) return;
    if (nclients >= MAX_CLIENTS) bad_step("too many clients");
    memset(&clients[nclients], 0, sizeof(clients[0]));
    clients[nclients].handle = h;
    clients[nclients].last_device = -1;
    cur = nclients++;
    last_handle = h;
    name_it(as, h);
}

static void step_use(char **w, int n) {
    if (n < 2) bad_step("want use REF");
    uint32_t h = resolve(w[1]);
    for (int i = 0; i < nclients; i++)
        if (clients[i].handle == h) {
            cur = i;
            begin();
            field(", \"client\": %u", h);
            end();
            return;
        }
    bad_step("%s is not a client of this plan", w[1]);
}

static void step_device(char **w, int n, const char *as) {
    if (n < 2) bad_step("want device N");
    uint64_t g = num(w[1], "device");
    if (g >= 8) bad_step("device out of range");
    int c = need_client();
    uint8_t params[56] = {0}; /* NV0080_ALLOC_PARAMETERS: deviceId@0 (sheet §4.1) */
    wr32(params, 0, (uint32_t)g);
    uint8_t b[48];
    int status_at;
    int r = rm_alloc(b, 0, 0, clients[c].handle, clients[c].handle, 0, NV01_DEVICE_0, params, sizeof(params), &status_at);
    uint32_t h = rd32(b, 8);
    begin();
    result(r, b, status_at);
    field(", \"client\": %u, \"parent\": %u, \"handle\": %u, \"class\": %u, \"gpu\": %u",
          clients[c].handle, clients[c].handle, h, NV01_DEVICE_0, (unsigned)g);
    end();
    if (!ok(r, b, status_at)) return;
    clients[c].device[g] = h;
    clients[c].last_device = (int)g;
    last_handle = h;
    name_it(as, h);
}

static void step_subdevice(char **w, int n, const char *as) {
    int c = need_client();
    int g = n >= 2 ? (int)num(w[1], "device") : clients[c].last_device;
    uint32_t dev = device_of(g);
    uint8_t params[4] = {0}; /* NV2080_ALLOC_PARAMETERS: subDeviceId@0 */
    uint8_t b[48];
    int status_at;
    int r = rm_alloc(b, 0, 0, clients[c].handle, dev, 0, NV20_SUBDEVICE_0, params, sizeof(params), &status_at);
    uint32_t h = rd32(b, 8);
    begin();
    result(r, b, status_at);
    field(", \"client\": %u, \"parent\": %u, \"handle\": %u, \"class\": %u, \"gpu\": %d",
          clients[c].handle, dev, h, NV20_SUBDEVICE_0, g);
    end();
    if (!ok(r, b, status_at)) return;
    clients[c].subdevice[g] = h;
    last_handle = h;
    name_it(as, h);
}

/* GPU argument: a GPU index (its device is the parent) or `none` (the client is). */
static uint32_t parent_for_gpu(const char *arg, int *gpu) {
    int c = need_client();
    if (strcmp(arg, "none") == 0) { *gpu = -1; return clients[c].handle; }
    *gpu = (int)num(arg, "gpu");
    return device_of(*gpu);
}

static void step_alloc_mem(char **w, int n, const char *as) {
    if (n < 3) bad_step("want alloc-mem GPU BYTES [xfer] [nvos64] [class=C] [attr=A] [handle=H]");
    int gpu;
    uint32_t parent = parent_for_gpu(w[1], &gpu);
    uint64_t bytes = num(w[2], "bytes");
    const char *cls_s = opt_value(w, n, "class"), *attr_s = opt_value(w, n, "attr"), *h_s = opt_value(w, n, "handle");
    uint32_t cls = cls_s ? (uint32_t)num(cls_s, "class") : NV01_MEMORY_LOCAL_USER;
    /* NV_MEMORY_ALLOCATION_PARAMS (nvos.h, sheet §4.1): attr@24, size@64; 128 bytes */
    static uint8_t params[128];
    memset(params, 0, sizeof(params));
    if (attr_s) wr32(params, 24, (uint32_t)num(attr_s, "attr"));
    wr64(params, 64, bytes);
    int c = cur;
    uint8_t b[48];
    int status_at;
    int r = rm_alloc(b, has_word(w, n, "nvos64"), has_word(w, n, "xfer"), clients[c].handle, parent,
                     h_s ? resolve(h_s) : 0, cls, params, sizeof(params), &status_at);
    uint32_t h = rd32(b, 8);
    begin();
    result(r, b, status_at);
    field(", \"client\": %u, \"parent\": %u, \"handle\": %u, \"class\": %u, \"gpu\": ", clients[c].handle, parent, h, cls);
    field(gpu < 0 ? "null" : "%d", gpu);
    field(", \"requested_bytes\": %" PRIu64 ", \"size_bytes\": %" PRIu64, bytes, rd64(params, 64));
    end();
    if (!ok(r, b, status_at)) return;
    last_handle = h;
    name_it(as, h);
}

/* NVOS32_PARAMETERS (sheet §3.5): hRoot@0, hObjectParent@4, function@8, status@20, data@40; the
 * ALLOC_SIZE member (nvos.h) has hMemory at data+4 (@44) and size at data+48 (@88). */
static void step_heap(char **w, int n, int is_free, const char *as) {
    uint8_t b[184] = {0};
    int c = need_client();
    int gpu = -1;
    uint32_t parent, h_in = 0;
    uint64_t bytes = 0;
    if (is_free) {
        if (n < 2) bad_step("want heap-free REF");
        h_in = resolve(w[1]);
        parent = clients[c].handle;
        wr32(b, 8, 3); /* NVOS32_FUNCTION_FREE */
    } else {
        if (n < 3) bad_step("want heap-alloc GPU BYTES [xfer] [handle=H] [flags=F]");
        parent = parent_for_gpu(w[1], &gpu);
        bytes = num(w[2], "bytes");
        const char *h_s = opt_value(w, n, "handle");
        h_in = h_s ? resolve(h_s) : 0;
        wr32(b, 8, 2); /* NVOS32_FUNCTION_ALLOC_SIZE */
        wr64(b, 88, bytes);
        const char *flags_s = opt_value(w, n, "flags");
        wr32(b, 52, flags_s ? (uint32_t)num(flags_s, "flags") : 0); /* AllocSize.flags: data+12 */
    }
    wr32(b, 0, clients[c].handle);
    wr32(b, 4, parent);
    wr32(b, 44, h_in);
    wr32(b, 20, 0xFFFFFFFFu);
    int r = rm_call(need_fd(ctl_fd, "ctl"), ESC_RM_VID_HEAP_CONTROL, b, sizeof(b), has_word(w, n, "xfer"));
    uint32_t h = rd32(b, 44);
    begin();
    result(r, b, 20);
    field(", \"client\": %u, \"parent\": %u, \"handle\": %u", clients[c].handle, parent, h);
    if (!is_free) {
        field(", \"gpu\": ");
        field(gpu < 0 ? "null" : "%d", gpu);
        field(", \"requested_bytes\": %" PRIu64 ", \"size_bytes\": %" PRIu64 ", \"flags\": %u", bytes,
              rd64(b, 88), rd32(b, 52));
    }
    end();
    if (!is_free && ok(r, b, 20)) {
        last_handle = h;
        name_it(as, h);
    }
}

/* nv_ioctl_nvos02_parameters_with_fd (sheet §3.4): limit@32, status@40, fd@48; on nvidiaN. */
static void step_alloc_memory(char **w, int n, const char *as) {
    if (n < 3) bad_step("want alloc-memory GPU BYTES [class=C]");
    int gpu;
    uint32_t parent = parent_for_gpu(w[1], &gpu);
    if (gpu < 0) bad_step("alloc-memory needs a GPU (it is issued on nvidiaN)");
    uint64_t bytes = num(w[2], "bytes");
    if (bytes == 0) bad_step("alloc-memory: BYTES must be > 0");
    const char *cls_s = opt_value(w, n, "class");
    uint32_t cls = cls_s ? (uint32_t)num(cls_s, "class") : NV01_MEMORY_SYSTEM;
    int fd = need_fd(gpu_fd[gpu], "gpu");
    uint8_t b[56] = {0};
    int c = cur;
    wr32(b, 0, clients[c].handle);
    wr32(b, 4, parent);
    wr32(b, 12, cls);
    wr64(b, 32, bytes - 1);
    wr32(b, 40, 0xFFFFFFFFu);
    wr32(b, 48, (uint32_t)fd);
    int r = rm_call(fd, ESC_RM_ALLOC_MEMORY, b, sizeof(b), 0);
    uint32_t h = rd32(b, 8);
    begin();
    result(r, b, 40);
    field(", \"fd\": %d, \"client\": %u, \"parent\": %u, \"handle\": %u, \"class\": %u, \"gpu\": %d, "
          "\"requested_bytes\": %" PRIu64 ", \"size_bytes\": %" PRIu64,
          fd, clients[c].handle, parent, h, cls, gpu, bytes, rd64(b, 32) + 1);
    end();
    if (!ok(r, b, 40)) return;
    last_handle = h;
    name_it(as, h);
}

static void step_alloc(char **w, int n, int object, const char *as) {
    if (n < 2) bad_step("want %s CLASS [parent=REF]", object ? "alloc-object" : "alloc");
    int c = need_client();
    uint32_t cls = (uint32_t)num(w[1], "class");
    const char *p_s = opt_value(w, n, "parent");
    uint32_t parent = p_s ? resolve(p_s) : clients[c].handle;
    uint8_t b[48] = {0};
    int status_at, r;
    if (object) { /* NVOS05 (sheet §3.3): status@16 */
        wr32(b, 0, clients[c].handle);
        wr32(b, 4, parent);
        wr32(b, 12, cls);
        status_at = 16;
        wr32(b, 16, 0xFFFFFFFFu);
        r = rm_call(need_fd(ctl_fd, "ctl"), ESC_RM_ALLOC_OBJECT, b, 20, 0);
    } else {
        r = rm_alloc(b, has_word(w, n, "nvos64"), has_word(w, n, "xfer"), clients[c].handle, parent, 0, cls,
                     NULL, 0, &status_at);
    }
    uint32_t h = rd32(b, 8);
    begin();
    result(r, b, status_at);
    field(", \"client\": %u, \"parent\": %u, \"handle\": %u, \"class\": %u", clients[c].handle, parent, h, cls);
    end();
    if (!ok(r, b, status_at)) return;
    last_handle = h;
    name_it(as, h);
}

/* NVOS00 (sheet §3.3): hRoot@0, hObjectParent@4, hObjectOld@8, status@12. */
static void step_free(char **w, int n) {
    if (n < 2) bad_step("want free REF [parent=REF]");
    int c = need_client();
    uint32_t root = clients[c].handle, old = resolve(w[1]);
    const char *p_s = opt_value(w, n, "parent");
    uint32_t parent = p_s ? resolve(p_s) : (old == root ? 0 : root);
    uint8_t b[16] = {0};
    wr32(b, 0, root);
    wr32(b, 4, parent);
    wr32(b, 8, old);
    wr32(b, 12, 0xFFFFFFFFu);
    int r = rm_call(need_fd(ctl_fd, "ctl"), ESC_RM_FREE, b, sizeof(b), has_word(w, n, "xfer"));
    begin();
    result(r, b, 12);
    field(", \"client\": %u, \"parent\": %u, \"handle\": %u", root, parent, old);
    end();
}

/* NVOS55 (sheet §3.3): hClient@0, hParent@4, hObject@8 (in/out), hClientSrc@12, hObjectSrc@16,
 * flags@20, status@24. */
static void step_dup(char **w, int n, const char *as) {
    if (n < 2) bad_step("want dup REF [from REF] [gpu G]");
    int c = need_client();
    uint32_t src = resolve(w[1]), src_client = clients[c].handle;
    int gpu = 0;
    for (int i = 2; i + 1 < n; i++) {
        if (strcmp(w[i], "from") == 0) src_client = resolve(w[i + 1]);
        if (strcmp(w[i], "gpu") == 0) gpu = (int)num(w[i + 1], "gpu");
    }
    uint32_t parent = clients[c].device[gpu < 8 ? gpu : 0] ? device_of(gpu) : clients[c].handle;
    uint8_t b[28] = {0};
    wr32(b, 0, clients[c].handle);
    wr32(b, 4, parent);
    wr32(b, 12, src_client);
    wr32(b, 16, src);
    wr32(b, 24, 0xFFFFFFFFu);
    int r = rm_call(need_fd(ctl_fd, "ctl"), ESC_RM_DUP_OBJECT, b, sizeof(b), has_word(w, n, "xfer"));
    uint32_t h = rd32(b, 8);
    begin();
    result(r, b, 24);
    field(", \"client\": %u, \"parent\": %u, \"handle\": %u, \"src_client\": %u, \"src_object\": %u",
          clients[c].handle, parent, h, src_client, src);
    end();
    if (!ok(r, b, 24)) return;
    last_handle = h;
    name_it(as, h);
}

/* NVOS54 (sheet §3.2): hClient@0, hObject@4, cmd@8, params@16, paramsSize@24, status@28. */
static void step_control(char **w, int n) {
    int c = need_client();
    uint8_t b[32] = {0};
    uint32_t cmd = n >= 2 ? (uint32_t)num(w[1], "cmd") : 0;
    wr32(b, 0, clients[c].handle);
    wr32(b, 4, clients[c].handle);
    wr32(b, 8, cmd);
    wr32(b, 28, 0xFFFFFFFFu);
    int r = rm_call(need_fd(ctl_fd, "ctl"), ESC_RM_CONTROL, b, sizeof(b), has_word(w, n, "xfer"));
    begin();
    result(r, b, 28);
    field(", \"client\": %u, \"cmd\": %u", clients[c].handle, cmd);
    end();
}

static void step_uvm_init(void) {
    uint8_t b[16] = {0}; /* UVM_INITIALIZE_PARAMS: flags@0 (8), rmStatus@8 */
    wr32(b, 8, 0xFFFFFFFFu);
    int r = do_ioctl(need_fd(uvm_fd, "uvm"), UVM_INITIALIZE, b);
    begin();
    result(r, b, 8);
    end();
}

static void run_step(char *line) {
    char *w[MAX_WORDS];
    int n = 0;
    for (char *save = NULL, *t = strtok_r(line, " \t\r\n", &save); t && n < MAX_WORDS; t = strtok_r(NULL, " \t\r\n", &save))
        w[n++] = t;
    if (n == 0 || w[0][0] == '#') return;
    step_no++;
    step_op = w[0];
    const char *as = NULL;
    if (n >= 3 && strcmp(w[n - 2], "as") == 0) { as = w[n - 1]; n -= 2; }
    const char *op = w[0];
    if (strcmp(op, "open") == 0) step_open(w, n);
    else if (strcmp(op, "close") == 0) step_close(w, n);
    else if (strcmp(op, "card-info") == 0) step_card_info();
    else if (strcmp(op, "version") == 0) step_version();
    else if (strcmp(op, "attach") == 0) step_attach();
    else if (strcmp(op, "register-fd") == 0) step_register_fd(w, n);
    else if (strcmp(op, "client") == 0) step_client(as);
    else if (strcmp(op, "use") == 0) step_use(w, n);
    else if (strcmp(op, "device") == 0) step_device(w, n, as);
    else if (strcmp(op, "subdevice") == 0) step_subdevice(w, n, as);
    else if (strcmp(op, "alloc-mem") == 0) step_alloc_mem(w, n, as);
    else if (strcmp(op, "heap-alloc") == 0) step_heap(w, n, 0, as);
    else if (strcmp(op, "heap-free") == 0) step_heap(w, n, 1, NULL);
    else if (strcmp(op, "alloc-memory") == 0) step_alloc_memory(w, n, as);
    else if (strcmp(op, "alloc") == 0) step_alloc(w, n, 0, as);
    else if (strcmp(op, "alloc-object") == 0) step_alloc(w, n, 1, as);
    else if (strcmp(op, "free") == 0) step_free(w, n);
    else if (strcmp(op, "dup") == 0) step_dup(w, n, as);
    else if (strcmp(op, "control") == 0) step_control(w, n);
    else if (strcmp(op, "uvm-init") == 0) step_uvm_init();
    else if (strcmp(op, "ready") == 0) {
        printf("ready %d\n", (int)getpid());
        fflush(stdout);
        if (!from_stdin) wait_line();
    } else if (strcmp(op, "hold") == 0) {
        printf("holding %d\n", (int)getpid());
        fflush(stdout);
        wait_line();
    } else if (strcmp(op, "sleep") == 0 && n >= 2) {
        uint64_t ms = num(w[1], "ms");
        struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
        while (nanosleep(&ts, &ts) < 0 && errno == EINTR) {}
    } else if (strcmp(op, "exit") == 0) {
        fflush(stdout);
        _exit(n >= 2 ? (int)num(w[1], "code") : 0);
    } else bad_step("unknown step %s", op);
}

/* --private-dev NAME=PATH...: own mount namespace, tmpfs on /dev, each PATH bound on /dev/NAME. */
static void private_dev(char **binds, int nbinds) {
    if (unshare(CLONE_NEWNS) < 0) die_setup("unshare-mnt");
    /* Without this a shared / (systemd hosts) would propagate the tmpfs to the host. */
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) die_setup("make-private");
    /* The FUSE files are reached by their host path before /dev is covered: open them first. */
    int fds[64];
    for (int k = 0; k < nbinds; k++) {
        char *eq = strchr(binds[k], '=');
        if (eq == NULL) { errno = EINVAL; die_setup(binds[k]); }
        fds[k] = open(eq + 1, O_PATH | O_CLOEXEC);
        if (fds[k] < 0) die_setup(eq + 1);
    }
    if (mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=64k") < 0) die_setup("mount-dev");
    for (int k = 0; k < nbinds; k++) {
        char *eq = strchr(binds[k], '=');
        *eq = '\0';
        char path[512], src[64];
        snprintf(path, sizeof(path), "/dev/%s", binds[k]);
        int fd = open(path, O_CREAT | O_WRONLY | O_CLOEXEC, 0666);
        if (fd < 0) die_setup(path);
        close(fd);
        snprintf(src, sizeof(src), "/proc/self/fd/%d", fds[k]);
        if (mount(src, path, NULL, MS_BIND, NULL) < 0) die_setup(path);
        close(fds[k]);
    }
}

int main(int argc, char **argv) {
    char *binds[64];
    int nbinds = 0, i = 1;
    for (; i < argc && strncmp(argv[i], "--", 2) == 0; i += 2) {
        if (i + 1 >= argc) { errno = EINVAL; die_setup(argv[i]); }
        if (strcmp(argv[i], "--dev-dir") == 0) dev_dir = argv[i + 1];
        else if (strcmp(argv[i], "--driver") == 0) {
            int major = atoi(argv[i + 1]);
            if (major < LAYOUTS[0].first_major) { errno = EINVAL; die_setup("--driver before 515"); }
            for (size_t k = 0; k < sizeof(LAYOUTS) / sizeof(LAYOUTS[0]); k++)
                if (major >= LAYOUTS[k].first_major) L = &LAYOUTS[k];
        } else if (strcmp(argv[i], "--private-dev") == 0 && nbinds < 64) binds[nbinds++] = argv[i + 1];
        else { errno = EINVAL; die_setup(argv[i]); }
    }
    if (nbinds > 0) private_dev(binds, nbinds);
    setvbuf(stdout, NULL, _IOFBF, 1 << 16);
    if (i >= argc) {
        from_stdin = 1;
        char line[1024];
        while (fgets(line, sizeof(line), stdin) != NULL) run_step(line);
        return 0;
    }
    for (; i < argc; i++) {
        /* an argument may hold several lines */
        char *copy = strdup(argv[i]);
        if (copy == NULL) die_setup("strdup");
        for (char *save = NULL, *l = strtok_r(copy, "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
            char one[1024];
            snprintf(one, sizeof(one), "%s", l);
            run_step(one);
        }
        free(copy);
    }
    fflush(stdout);
    return 0;
}
