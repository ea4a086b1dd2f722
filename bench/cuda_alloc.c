/* cuda_alloc.c: allocates GPU memory with cuMemAlloc, frees some of it, and holds the rest, for
 * bench/gpu_real_check.sh. It loads the CUDA driver API with dlopen("libcuda.so.1"), which ships
 * with the NVIDIA driver, so no CUDA toolkit is needed: the few prototypes are declared here
 * (their signatures are those of cuda.h; the _v2 entry points take 64-bit device pointers).
 *
 *   cc -O2 -o cuda_alloc bench/cuda_alloc.c -ldl
 *   ./cuda_alloc [--device N] [--gib 1,4,16] [--free 4]
 *
 * Allocates each size in GiB in order (default 1, 4 and 16), then frees the allocation(s) of the
 * sizes given to --free (default the 4 GiB one), synchronizes, prints one JSON line per step and
 * then "holding <pid>", and waits for a line (or EOF) on stdin before freeing the rest.
 * Errors are one line on stderr and exit 2: no libcuda, a CUDA call that failed (with its name).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult; /* CUDA_SUCCESS = 0 */
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr; /* the _v2 API's 64-bit device pointer */

static CUresult (*cuInit)(unsigned int);
static CUresult (*cuDeviceGet)(CUdevice *, int);
static CUresult (*cuCtxCreate_v2)(CUcontext *, unsigned int, CUdevice);
static CUresult (*cuCtxDestroy_v2)(CUcontext);
static CUresult (*cuMemAlloc_v2)(CUdeviceptr *, size_t);
static CUresult (*cuMemFree_v2)(CUdeviceptr);
static CUresult (*cuCtxSynchronize)(void);
static CUresult (*cuGetErrorString)(CUresult, const char **);

#define MAX_ALLOCS 16

static void *sym(void *lib, const char *name)
{
    void *p = dlsym(lib, name);
    if (!p) {
        fprintf(stderr, "cuda_alloc: libcuda.so.1 has no %s: the driver is too old for this program\n", name);
        exit(2);
    }
    return p;
}

static void check(CUresult rc, const char *what)
{
    if (rc == 0)
        return;
    const char *text = "unknown error";
    if (cuGetErrorString)
        cuGetErrorString(rc, &text);
    fprintf(stderr, "cuda_alloc: %s failed: CUDA error %d (%s)\n", what, rc, text ? text : "?");
    exit(2);
}

/* "1,4,16" -> sizes in GiB; returns the count. */
static int parse_list(const char *s, double *out, int max)
{
    int n = 0;
    while (*s && n < max) {
        char *end;
        double v = strtod(s, &end);
        if (end == s || v <= 0) {
            fprintf(stderr, "cuda_alloc: bad size list %s: give GiB as 1,4,16\n", s);
            exit(2);
        }
        out[n++] = v;
        s = *end == ',' ? end + 1 : end;
    }
    return n;
}

int main(int argc, char **argv)
{
    int device = 0, n_alloc, n_free;
    double gib[MAX_ALLOCS] = {1, 4, 16}, free_gib[MAX_ALLOCS] = {4};
    n_alloc = 3;
    n_free = 1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--device") && i + 1 < argc)
            device = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--gib") && i + 1 < argc)
            n_alloc = parse_list(argv[++i], gib, MAX_ALLOCS);
        else if (!strcmp(argv[i], "--free") && i + 1 < argc) {
            const char *v = argv[++i];
            n_free = strcmp(v, "none") ? parse_list(v, free_gib, MAX_ALLOCS) : 0;
        } else {
            fprintf(stderr, "cuda_alloc: unknown argument %s: use --device N --gib 1,4,16 --free 4|none\n",
                    argv[i]);
            return 2;
        }
    }
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "cuda_alloc: cannot load libcuda.so.1 (%s): it ships with the NVIDIA driver; "
                "install the driver's CUDA library\n", dlerror());
        return 2;
    }
    cuInit = sym(lib, "cuInit");
    cuDeviceGet = sym(lib, "cuDeviceGet");
    cuCtxCreate_v2 = sym(lib, "cuCtxCreate_v2");
    cuCtxDestroy_v2 = sym(lib, "cuCtxDestroy_v2");
    cuMemAlloc_v2 = sym(lib, "cuMemAlloc_v2");
    cuMemFree_v2 = sym(lib, "cuMemFree_v2");
    cuCtxSynchronize = sym(lib, "cuCtxSynchronize");
    cuGetErrorString = dlsym(lib, "cuGetErrorString");

    CUdevice dev;
    CUcontext ctx;
    check(cuInit(0), "cuInit");
    check(cuDeviceGet(&dev, device), "cuDeviceGet");
    check(cuCtxCreate_v2(&ctx, 0, dev), "cuCtxCreate_v2");
    CUdeviceptr ptr[MAX_ALLOCS] = {0};
    for (int i = 0; i < n_alloc; i++) {
        size_t bytes = (size_t)(gib[i] * (double)(1ull << 30));
        check(cuMemAlloc_v2(&ptr[i], bytes), "cuMemAlloc_v2");
        printf("{\"step\":\"alloc\",\"bytes\":%zu}\n", bytes);
    }
    for (int f = 0; f < n_free; f++) {
        for (int i = 0; i < n_alloc; i++) {
            if (ptr[i] && gib[i] == free_gib[f]) {
                check(cuMemFree_v2(ptr[i]), "cuMemFree_v2");
                printf("{\"step\":\"free\",\"bytes\":%zu}\n", (size_t)(gib[i] * (double)(1ull << 30)));
                ptr[i] = 0;
                break;
            }
        }
    }
    check(cuCtxSynchronize(), "cuCtxSynchronize");
    printf("holding %d\n", (int)getpid());
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof(line), stdin)) {
        /* EOF: the caller let go */
    }
    for (int i = 0; i < n_alloc; i++)
        if (ptr[i])
            check(cuMemFree_v2(ptr[i]), "cuMemFree_v2");
    check(cuCtxDestroy_v2(ctx), "cuCtxDestroy_v2");
    printf("done\n");
    return 0;
}
