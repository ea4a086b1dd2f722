/*
 * A fake libnvidia-ml.so.1 for tests: just the NVML entry points that tracer/nvml.py reaches
 * through pynvml (nvidia-ml-py 13.x), with the real signatures, struct layouts and return codes.
 *
 * The state is read again on EVERY call from the text file named by $FAKE_NVML_CONFIG, so a test
 * can change the world while the tracer keeps the library loaded. Lines (# starts a comment):
 *
 *   driver 550.54.15
 *   nvml_version 12.550.54.15
 *   fail_init NVML_ERROR_DRIVER_NOT_LOADED       (a name, with or without NVML_ERROR_, or a number)
 *   no_v3                                         (the *_v3 process queries are absent, as before R510)
 *   gpu 0 uuid=GPU-... minor=0 name=NVIDIA_H100 mem_total=N mem_used=N mem_reserved=N mig=0|1|-
 *         pci=00000000:17:00.0 fail=memory,compute|all fail_code=GPU_IS_LOST
 *   proc 0 12345 536870912 compute [gi=N ci=N]    (GPU index, PID, used bytes or -, compute|graphics)
 *
 * '_' in a name stands for a space. No config (unset or unreadable) means no driver: init fails
 * with NVML_ERROR_DRIVER_NOT_LOADED, like a node whose nvidia.ko is not loaded.
 * Build: gcc -shared -fPIC -O2 -Wall -Werror -o libnvidia-ml.so.1 fake_nvml.c
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvmlReturn_t;

enum {
    NVML_SUCCESS = 0, NVML_ERROR_UNINITIALIZED = 1, NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3, NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9, NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_GPU_IS_LOST = 15, NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25, NVML_ERROR_UNKNOWN = 999,
};

#define NOT_AVAILABLE_U64 0xFFFFFFFFFFFFFFFFULL
#define NOT_AVAILABLE_U32 0xFFFFFFFFU
#define MEMORY_V2_VERSION 0x02000028U /* sizeof(nvmlMemory_v2_t) | 2 << 24, as in nvml.h */
#define MAX_GPUS 16
#define MAX_PROCS 256

static const struct { const char *name; int code; const char *text; } ERRORS[] = {
    {"SUCCESS", 0, "Success"}, {"UNINITIALIZED", 1, "Uninitialized"},
    {"INVALID_ARGUMENT", 2, "Invalid Argument"}, {"NOT_SUPPORTED", 3, "Not Supported"},
    {"NO_PERMISSION", 4, "Insufficient Permissions"}, {"ALREADY_INITIALIZED", 5, "Already Initialized"},
    {"NOT_FOUND", 6, "Not Found"}, {"INSUFFICIENT_SIZE", 7, "Insufficient Size"},
    {"DRIVER_NOT_LOADED", 9, "Driver Not Loaded"}, {"TIMEOUT", 10, "Timeout"},
    {"LIBRARY_NOT_FOUND", 12, "NVML Shared Library Not Found"},
    {"FUNCTION_NOT_FOUND", 13, "Function Not Found"}, {"GPU_IS_LOST", 15, "GPU is lost"},
    {"RESET_REQUIRED", 16, "GPU requires restart"},
    {"LIB_RM_VERSION_MISMATCH", 18, "RM has detected an NVML/RM version mismatch."},
    {"ARGUMENT_VERSION_MISMATCH", 25, "Argument version mismatch"}, {"UNKNOWN", 999, "Unknown Error"},
};

/* The layouts pynvml declares: v1 process info is {pid, usedGpuMemory}; v2 and v3 add the MIG ids. */
typedef struct { unsigned int pid; unsigned long long usedGpuMemory; } proc_v1_t;
typedef struct {
    unsigned int pid; unsigned long long usedGpuMemory; unsigned int gpuInstanceId, computeInstanceId;
} proc_v2_t;
typedef struct { unsigned long long total, free, used; } memory_t;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } memory_v2_t;
typedef struct {
    char busIdLegacy[16]; unsigned int domain, bus, device, pciDeviceId, pciSubSystemId; char busId[32];
} pci_info_t;

struct fake_gpu {
    int present, mig, fail_code; /* mig: 0, 1, or -1 for "not supported" */
    unsigned int minor;
    unsigned long long mem_total, mem_used, mem_reserved;
    char uuid[96], name[96], pci[32], fail[128];
};
struct fake_proc { unsigned int gpu, pid, gi, ci; int graphics; unsigned long long mem; };
struct fake_state {
    int fail_init, no_v3;
    unsigned int ngpus, nprocs;
    char driver[80], nvml_version[80];
    struct fake_gpu gpus[MAX_GPUS];
    struct fake_proc procs[MAX_PROCS];
};

/* A handle is the address of a slot; its offset is the GPU index, like NVML's opaque pointer. */
typedef struct fake_handle { int unused; } *nvmlDevice_t;
static struct fake_handle handles[MAX_GPUS];
static int init_count;

static int parse_code(const char *s) {
    if (strncmp(s, "NVML_ERROR_", 11) == 0) s += 11;
    for (size_t i = 0; i < sizeof(ERRORS) / sizeof(ERRORS[0]); i++)
        if (strcmp(s, ERRORS[i].name) == 0) return ERRORS[i].code;
    return (int)strtol(s, NULL, 0);
}

static void copy_str(char *dst, size_t size, const char *src, int underscores_to_spaces) {
    snprintf(dst, size, "%s", src);
    for (char *p = dst; underscores_to_spaces && *p; p++)
        if (*p == '_') *p = ' ';
}

static void parse_gpu(struct fake_state *st, char *rest) {
    char *save = NULL, *tok = strtok_r(rest, " \t\n", &save);
    if (!tok) return;
    unsigned int idx = (unsigned int)strtoul(tok, NULL, 0);
    if (idx >= MAX_GPUS) return;
    struct fake_gpu *g = &st->gpus[idx];
    memset(g, 0, sizeof(*g));
    g->present = 1;
    g->mig = -1;
    g->minor = idx;
    g->fail_code = NVML_ERROR_GPU_IS_LOST;
    st->ngpus++;
    while ((tok = strtok_r(NULL, " \t\n", &save)) != NULL) {
        char *val = strchr(tok, '=');
        if (!val) continue;
        *val++ = '\0';
        if (strcmp(tok, "uuid") == 0) copy_str(g->uuid, sizeof(g->uuid), val, 0);
        else if (strcmp(tok, "name") == 0) copy_str(g->name, sizeof(g->name), val, 1);
        else if (strcmp(tok, "pci") == 0) copy_str(g->pci, sizeof(g->pci), val, 0);
        else if (strcmp(tok, "fail") == 0) copy_str(g->fail, sizeof(g->fail), val, 0);
        else if (strcmp(tok, "fail_code") == 0) g->fail_code = parse_code(val);
        else if (strcmp(tok, "minor") == 0) g->minor = (unsigned int)strtoul(val, NULL, 0);
        else if (strcmp(tok, "mem_total") == 0) g->mem_total = strtoull(val, NULL, 0);
        else if (strcmp(tok, "mem_used") == 0) g->mem_used = strtoull(val, NULL, 0);
        else if (strcmp(tok, "mem_reserved") == 0) g->mem_reserved = strtoull(val, NULL, 0);
        else if (strcmp(tok, "mig") == 0) g->mig = strcmp(val, "-") == 0 ? -1 : atoi(val);
    }
}

static void parse_proc(struct fake_state *st, char *rest) {
    char *save = NULL, *gpu = strtok_r(rest, " \t\n", &save), *pid = strtok_r(NULL, " \t\n", &save);
    char *mem = strtok_r(NULL, " \t\n", &save), *kind = strtok_r(NULL, " \t\n", &save);
    if (!gpu || !pid || !mem || !kind || st->nprocs >= MAX_PROCS) return;
    struct fake_proc *p = &st->procs[st->nprocs++];
    p->gpu = (unsigned int)strtoul(gpu, NULL, 0);
    p->pid = (unsigned int)strtoul(pid, NULL, 0);
    p->mem = strcmp(mem, "-") == 0 ? NOT_AVAILABLE_U64 : strtoull(mem, NULL, 0);
    p->graphics = strcmp(kind, "graphics") == 0;
    p->gi = p->ci = NOT_AVAILABLE_U32; /* what NVML reports outside MIG mode */
    char *tok;
    while ((tok = strtok_r(NULL, " \t\n", &save)) != NULL) {
        if (strncmp(tok, "gi=", 3) == 0) p->gi = (unsigned int)strtoul(tok + 3, NULL, 0);
        else if (strncmp(tok, "ci=", 3) == 0) p->ci = (unsigned int)strtoul(tok + 3, NULL, 0);
    }
}

/* Returns 0 when the config file cannot be read. */
static int load(struct fake_state *st) {
    memset(st, 0, sizeof(*st));
    snprintf(st->driver, sizeof(st->driver), "550.54.15");
    snprintf(st->nvml_version, sizeof(st->nvml_version), "12.550.54.15");
    const char *path = getenv("FAKE_NVML_CONFIG");
    FILE *f = path ? fopen(path, "r") : NULL;
    if (!f) return 0;
    char line[512], arg[80];
    while (fgets(line, sizeof(line), f)) {
        char *save = NULL, *key = strtok_r(line, " \t\n", &save), *rest = strtok_r(NULL, "\n", &save);
        if (!key || key[0] == '#') continue;
        int has_arg = rest && sscanf(rest, "%79s", arg) == 1;
        if (strcmp(key, "driver") == 0 && has_arg) copy_str(st->driver, sizeof(st->driver), arg, 0);
        else if (strcmp(key, "nvml_version") == 0 && has_arg)
            copy_str(st->nvml_version, sizeof(st->nvml_version), arg, 0);
        else if (strcmp(key, "fail_init") == 0 && has_arg) st->fail_init = parse_code(arg);
        else if (strcmp(key, "no_v3") == 0) st->no_v3 = 1;
        else if (strcmp(key, "gpu") == 0 && rest) parse_gpu(st, rest);
        else if (strcmp(key, "proc") == 0 && rest) parse_proc(st, rest);
    }
    fclose(f);
    return 1;
}

static int query_fails(const struct fake_gpu *g, const char *what) {
    char list[128];
    snprintf(list, sizeof(list), "%s", g->fail);
    for (char *save = NULL, *tok = strtok_r(list, ",", &save); tok; tok = strtok_r(NULL, ",", &save))
        if (strcmp(tok, what) == 0 || strcmp(tok, "all") == 0) return 1;
    return 0;
}

/* The common prologue: state, initialisation, a valid handle, and injected failures. */
static nvmlReturn_t begin(struct fake_state *st, nvmlDevice_t dev, const char *what,
                          const struct fake_gpu **gpu) {
    if (!load(st)) return __atomic_load_n(&init_count, __ATOMIC_SEQ_CST) ? NVML_ERROR_UNKNOWN
                                                                         : NVML_ERROR_UNINITIALIZED;
    if (__atomic_load_n(&init_count, __ATOMIC_SEQ_CST) == 0) return NVML_ERROR_UNINITIALIZED;
    if (!gpu) return NVML_SUCCESS;
    if (dev < handles || dev >= handles + MAX_GPUS || !st->gpus[dev - handles].present)
        return NVML_ERROR_INVALID_ARGUMENT;
    *gpu = &st->gpus[dev - handles];
    return query_fails(*gpu, what) ? (*gpu)->fail_code : NVML_SUCCESS;
}

static nvmlReturn_t put_str(char *dst, unsigned int length, const char *src) {
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    struct fake_state st;
    (void)flags;
    if (!load(&st)) return NVML_ERROR_DRIVER_NOT_LOADED;
    if (st.fail_init) return st.fail_init;
    __atomic_add_fetch(&init_count, 1, __ATOMIC_SEQ_CST);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    int n = __atomic_load_n(&init_count, __ATOMIC_SEQ_CST);
    if (n == 0) return NVML_ERROR_UNINITIALIZED;
    __atomic_sub_fetch(&init_count, 1, __ATOMIC_SEQ_CST);
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    for (size_t i = 0; i < sizeof(ERRORS) / sizeof(ERRORS[0]); i++)
        if (ERRORS[i].code == result) return ERRORS[i].text;
    return "Unknown Error";
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    struct fake_state st;
    nvmlReturn_t ret = begin(&st, NULL, NULL, NULL);
    return ret ? ret : put_str(version, length, st.driver);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    struct fake_state st;
    nvmlReturn_t ret = begin(&st, NULL, NULL, NULL);
    return ret ? ret : put_str(version, length, st.nvml_version);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    struct fake_state st;
    nvmlReturn_t ret = begin(&st, NULL, NULL, NULL);
    if (ret) return ret;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = st.ngpus;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    struct fake_state st;
    const struct fake_gpu *g;
    if (index >= MAX_GPUS || !device) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t ret = begin(&st, &handles[index], "handle", &g);
    if (ret == NVML_SUCCESS) *device = &handles[index];
    return ret;
}
nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t dev, char *uuid, unsigned int length) {
    struct fake_state st;
    const struct fake_gpu *g;
    nvmlReturn_t ret = begin(&st, dev, "uuid", &g);
    return ret ? ret : put_str(uuid, length, g->uuid);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t dev, char *name, unsigned int length) {
    struct fake_state st;
    const struct fake_gpu *g;
    nvmlReturn_t ret = begin(&st, dev, "name", &g);
    return ret ? ret : put_str(name, length, g->name);
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t dev, unsigned int *minor) {
    struct fake_state st;
    const struct fake_gpu *g;
    nvmlReturn_t ret = begin(&st, dev, "minor", &g);
    if (ret == NVML_SUCCESS) *minor = g->minor;
    return ret;
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t dev, unsigned int *index) {
    struct fake_state st;
    const struct fake_gpu *g;
    nvmlReturn_t ret = begin(&st, dev, "index", &g);
    if (ret == NVML_SUCCESS) *index = (unsigned int)(dev - handles);
    return ret;
}

/* v1 "used" counts the driver's reserved memory; v2 reports it apart (R510 and later). */
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, memory_t *mem) {
    struct fake_state st;
    const struct fake_gpu *g;
    nvmlReturn_t ret = begin(&st, dev, "memory", &g);
    if (ret) return ret;
    mem->total = g->mem_total;
    mem->used = g->mem_used + g->mem_reserved;
    mem->free = mem->total > mem->used ? mem->total - mem->used : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, memory_v2_t *mem) {
    struct fake_state st;
    const struct fake_gpu *g;
    nvmlReturn_t ret = begin(&st, dev, "memory", &g);
    if (ret) return ret;
    if (mem->version != MEMORY_V2_VERSION) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    mem->total = g->mem_total;
    mem->reserved = g->mem_reserved;
    mem->used = g->mem_used;
    unsigned long long taken = g->mem_used + g->mem_reserved;
    mem->free = mem->total > taken ? mem->total - taken : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t dev, unsigned int *current, unsigned int *pending) {
    struct fake_state st;
    const struct fake_gpu *g;
    nvmlReturn_t ret = begin(&st, dev, "mig", &g);
    if (ret) return ret;
    if (g->mig < 0) return NVML_ERROR_NOT_SUPPORTED; /* a GPU without MIG (anything before A100) */
    *current = *pending = (unsigned int)g->mig;
    return NVML_SUCCESS;
}

/* nvmlPciInfo_t (nvml.h) is busIdLegacy[16], domain, bus, device, pciDeviceId, pciSubSystemId,
 * busId[32]: what _v3 fills (pynvml 13 calls _v3). The plain and _v2 names are older, and their
 * callers' struct is the one before NVML 9.0: busId[16] first (where busIdLegacy now is, in the same
 * 4-digit-domain form), the same five numbers, then reserved fields where busId[32] now is
 * (pynvml's nvmlPciInfo_t: "New busId replaced the long deprecated and reserved fields ... in 9.0").
 * So they get the legacy id and the numbers only: nothing is written past pciSubSystemId. A GPU
 * without pci= answers empty bus ids (a real one always has one: tests that join by bus id
 * configure it). */
static nvmlReturn_t pci_info(nvmlDevice_t dev, pci_info_t *pci, int legacy) {
    struct fake_state st;
    const struct fake_gpu *g;
    nvmlReturn_t ret = begin(&st, dev, "pci", &g);
    if (ret) return ret;
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    pci_info_t out;
    memset(&out, 0, sizeof(out));
    if (g->pci[0]) {
        snprintf(out.busId, sizeof(out.busId), "%s", g->pci);
        sscanf(g->pci, "%x:%x:%x", &out.domain, &out.bus, &out.device);
        /* The legacy field keeps the old 4-digit domain format. */
        snprintf(out.busIdLegacy, sizeof(out.busIdLegacy), "%04X:%02X:%02X.0", out.domain & 0xFFFFU,
                 out.bus & 0xFFU, out.device & 0xFFU);
    }
    memcpy(pci, &out, legacy ? offsetof(pci_info_t, busId) : sizeof(out));
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t dev, pci_info_t *pci) { return pci_info(dev, pci, 0); }
nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t dev, pci_info_t *pci) { return pci_info(dev, pci, 1); }
nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t dev, pci_info_t *pci) { return pci_info(dev, pci, 1); }

/* NVML's two-call protocol: too small a count gets INSUFFICIENT_SIZE and the count needed. */
static nvmlReturn_t list_procs(nvmlDevice_t dev, unsigned int *count, void *infos, int graphics,
                               int version) {
    struct fake_state st;
    const struct fake_gpu *g;
    nvmlReturn_t ret = begin(&st, dev, graphics ? "graphics" : "compute", &g);
    if (ret) return ret;
    if (version == 3 && st.no_v3) return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int index = (unsigned int)(dev - handles), needed = 0;
    for (unsigned int i = 0; i < st.nprocs; i++)
        needed += st.procs[i].gpu == index && st.procs[i].graphics == graphics;
    if (*count < needed || (needed && !infos)) {
        *count = needed;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    unsigned int n = 0;
    for (unsigned int i = 0; i < st.nprocs; i++) {
        const struct fake_proc *p = &st.procs[i];
        if (p->gpu != index || p->graphics != graphics) continue;
        if (version == 1) {
            proc_v1_t *out = (proc_v1_t *)infos + n;
            out->pid = p->pid;
            out->usedGpuMemory = p->mem;
        } else {
            proc_v2_t *out = (proc_v2_t *)infos + n;
            out->pid = p->pid;
            out->usedGpuMemory = p->mem;
            out->gpuInstanceId = p->gi;
            out->computeInstanceId = p->ci;
        }
        n++;
    }
    *count = n;
    return NVML_SUCCESS;
}

#define PROC_QUERY(fn, graphics, version) \
    nvmlReturn_t fn(nvmlDevice_t dev, unsigned int *count, void *infos) { \
        return list_procs(dev, count, infos, graphics, version); \
    }
PROC_QUERY(nvmlDeviceGetComputeRunningProcesses, 0, 1)
PROC_QUERY(nvmlDeviceGetComputeRunningProcesses_v2, 0, 2)
PROC_QUERY(nvmlDeviceGetComputeRunningProcesses_v3, 0, 3)
PROC_QUERY(nvmlDeviceGetGraphicsRunningProcesses, 1, 1)
PROC_QUERY(nvmlDeviceGetGraphicsRunningProcesses_v2, 1, 2)
PROC_QUERY(nvmlDeviceGetGraphicsRunningProcesses_v3, 1, 3)
