/*
 * The demo GPU of `ghostgpu up --demo`: a stand-in libnvidia-ml.so.1 for machines without an
 * NVIDIA driver, so that the demo can show what "hidden" means. It answers the NVML calls the
 * tracer makes through pynvml (nvidia-ml-py 12/13) for ONE GPU whose driver lists no process at
 * all: every holder the demo plants is then, truthfully, a process NVML does not show.
 *
 * It is loaded only by the tracer that `up --demo` starts (LD_LIBRARY_PATH names the temporary
 * directory it was compiled into) and reads its one GPU from the file named by
 * $GHOSTGPU_DEMO_NVML, written by cli/demo.py:
 *
 *   driver=<version>  uuid=<GPU-...>  name=<text, '_' for spaces>  minor=<N>  memory=<bytes>
 *
 * one key=value per line. Build: gcc -shared -fPIC -O2 -Wall -o libnvidia-ml.so.1 demo_nvml.c
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvmlReturn_t;

/* nvmlReturn_t values from nvml.h. */
#define OK 0
#define ERR_UNINITIALIZED 1
#define ERR_INVALID_ARGUMENT 2
#define ERR_NOT_SUPPORTED 3
#define ERR_INSUFFICIENT_SIZE 7
#define ERR_DRIVER_NOT_LOADED 9
#define ERR_ARGUMENT_VERSION_MISMATCH 25
#define MEMORY_V2 0x02000028U /* sizeof(nvmlMemory_v2_t) | 2 << 24, the version pynvml passes */

typedef struct demo_device { int slot; } *nvmlDevice_t;
typedef struct { unsigned long long total, free, used; } memory_v1;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } memory_v2;

static struct demo_device the_gpu;
static int initialized;
static struct {
    char driver[64], uuid[96], name[96];
    unsigned int minor;
    unsigned long long memory;
} demo;

/* Read the demo GPU; 0 when the file is missing (then this "driver" is not loaded). */
static int load(void) {
    const char *path = getenv("GHOSTGPU_DEMO_NVML");
    FILE *f = path ? fopen(path, "r") : NULL;
    char line[256];
    if (!f) return 0;
    snprintf(demo.driver, sizeof demo.driver, "demo");
    snprintf(demo.uuid, sizeof demo.uuid, "GPU-00000000-0000-0000-0000-000000000000");
    snprintf(demo.name, sizeof demo.name, "ghostgpu demo GPU");
    demo.minor = 0;
    demo.memory = 0;
    while (fgets(line, sizeof line, f)) {
        char *value = strchr(line, '=');
        if (!value) continue;
        *value++ = '\0';
        value[strcspn(value, "\r\n")] = '\0';
        if (strcmp(line, "driver") == 0) snprintf(demo.driver, sizeof demo.driver, "%s", value);
        else if (strcmp(line, "uuid") == 0) snprintf(demo.uuid, sizeof demo.uuid, "%s", value);
        else if (strcmp(line, "name") == 0) {
            snprintf(demo.name, sizeof demo.name, "%s", value);
            for (char *p = demo.name; *p; p++) if (*p == '_') *p = ' ';
        } else if (strcmp(line, "minor") == 0) demo.minor = (unsigned int)strtoul(value, NULL, 10);
        else if (strcmp(line, "memory") == 0) demo.memory = strtoull(value, NULL, 10);
    }
    fclose(f);
    return 1;
}

static nvmlReturn_t copy_out(char *dst, unsigned int size, const char *src) {
    if (!dst) return ERR_INVALID_ARGUMENT;
    if (strlen(src) >= size) return ERR_INSUFFICIENT_SIZE;
    strcpy(dst, src);
    return OK;
}

static nvmlReturn_t check(nvmlDevice_t dev) {
    if (!initialized) return ERR_UNINITIALIZED;
    return dev == &the_gpu ? OK : ERR_INVALID_ARGUMENT;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    if (!load()) return ERR_DRIVER_NOT_LOADED;
    initialized++;
    return OK;
}
nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    if (!initialized) return ERR_UNINITIALIZED;
    initialized--;
    return OK;
}

const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case OK: return "Success";
    case ERR_UNINITIALIZED: return "Uninitialized";
    case ERR_INVALID_ARGUMENT: return "Invalid Argument";
    case ERR_NOT_SUPPORTED: return "Not Supported";
    case ERR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case ERR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case ERR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int size) {
    return initialized ? copy_out(version, size, demo.driver) : ERR_UNINITIALIZED;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!initialized) return ERR_UNINITIALIZED;
    if (!count) return ERR_INVALID_ARGUMENT;
    *count = 1;
    return OK;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!initialized) return ERR_UNINITIALIZED;
    if (index != 0 || !device) return ERR_INVALID_ARGUMENT;
    *device = &the_gpu;
    return OK;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t dev, char *uuid, unsigned int size) {
    nvmlReturn_t r = check(dev);
    return r ? r : copy_out(uuid, size, demo.uuid);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t dev, char *name, unsigned int size) {
    nvmlReturn_t r = check(dev);
    return r ? r : copy_out(name, size, demo.name);
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t dev, unsigned int *minor) {
    nvmlReturn_t r = check(dev);
    if (r == OK) *minor = demo.minor;
    return r;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, memory_v1 *mem) {
    nvmlReturn_t r = check(dev);
    if (r) return r;
    mem->total = mem->free = demo.memory;
    mem->used = 0;
    return OK;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, memory_v2 *mem) {
    nvmlReturn_t r = check(dev);
    if (r) return r;
    if (mem->version != MEMORY_V2) return ERR_ARGUMENT_VERSION_MISMATCH;
    mem->total = mem->free = demo.memory;
    mem->reserved = mem->used = 0;
    return OK;
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t dev, unsigned int *current, unsigned int *pending) {
    nvmlReturn_t r = check(dev);
    (void)current;
    (void)pending;
    return r ? r : ERR_NOT_SUPPORTED; /* a GPU without MIG */
}

/* The driver lists no process: a zero count with SUCCESS is NVML's "none running". */
static nvmlReturn_t no_processes(nvmlDevice_t dev, unsigned int *count, void *infos) {
    nvmlReturn_t r = check(dev);
    (void)infos;
    if (r) return r;
    if (!count) return ERR_INVALID_ARGUMENT;
    *count = 0;
    return OK;
}
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *n, void *p) {
    return no_processes(d, n, p);
}
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t d, unsigned int *n, void *p) {
    return no_processes(d, n, p);
}
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t d, unsigned int *n, void *p) {
    return no_processes(d, n, p);
}
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t d, unsigned int *n, void *p) {
    return no_processes(d, n, p);
}
