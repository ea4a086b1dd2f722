/* nvrecord.c: an LD_PRELOAD library that records every ioctl on an NVIDIA device file, with its
 * parameter blocks before and after the call, as JSON lines. bench/gpu_real_check.sh runs a CUDA
 * program under it and decodes the recording with tracer/memcall_decode.py, the same rules the
 * tracer's kernel side applies, so that a real driver checks them without BPF.
 *
 *   cc -O2 -shared -fPIC -o nvrecord.so bench/nvrecord.c -ldl -lpthread
 *   NVRECORD_OUT=rec.jsonl LD_PRELOAD=$PWD/nvrecord.so ./program
 *
 * Environment: NVRECORD_OUT (the file, appended to; unset: record nothing), NVRECORD_MATCH (path
 * prefixes of the device files, ':'-separated; default /dev/nvidia, which also takes nvidiactl,
 * nvidia-uvm and nvidia-modeset).
 *
 * Which fds: an fd is a device fd when readlink(/proc/self/fd/N) starts with a prefix, looked up
 * when an intercepted open, openat or dup returns it, and at the first ioctl or close on an fd not
 * known yet (one opened through a path not intercepted, such as fopen's internal open). Closes
 * (close, and dup2/dup3 over a device fd) are recorded, since RM frees the clients of a file when
 * it is released (nvidia_close, kernel-open/nvidia/nv.c, then rm_cleanup_file_private ->
 * RmFreeUnusedClients, src/nvidia/arch/nvalloc/unix/src/osapi.c). close_range() is not intercepted.
 *
 * Lines (keys read by tracer/memcall_decode.py parse_record):
 *   {"ev":"start","pid","ppid","exe","driver"}        at load; driver from /sys/module/nvidia/version
 *   {"ev":"open","ts_ns","pid","fd","dev"}
 *   {"ev":"ioctl","ts_ns","pid","tid","fd","dev","req","ret","errno","before","after",
 *    "xfer_before","xfer_after","ptr_at","ptr_before","ptr_after"}
 *   {"ev":"close","ts_ns","pid","fd","dev"}
 * ts_ns is CLOCK_BOOTTIME (the tracer's clock): at an ioctl's entry, as the kernel side stamps a
 * memory call; at the open's return and at the close. Blocks are hex, at most
 * 16384 bytes each (NV_ABSOLUTE_MAX_IOCTL_SIZE, kernel-open/common/inc/nv.h):
 *   before/after: the _IOC_SIZE bytes at the argument, for a request of type 'F' (every RM and
 *     frontend escape is _IOWR('F', nr, size), §1). UVM numbers carry no size in the word (§9.1):
 *     they are recorded without blocks.
 *   xfer_*: for NV_ESC_IOCTL_XFER_CMD (nr 0xD3), the block its nv_ioctl_xfer_t {cmd@0, size@4,
 *     ptr@8} carries (§1 step 3).
 *   ptr_*: the block a pointer in the (carried) block names: RM_ALLOC's pAllocParms@16 (NVOS21 and
 *     NVOS64, §3.1) with paramsSize (NVOS21@24, NVOS64@32, from 535.43.02 on) or, where the block has
 *     none (515-530) or it is out of range, the class's known size (§4.1); RM_CONTROL's params@16
 *     with paramsSize@24 (NVOS54, §3.2).
 * User memory is read with process_vm_readv on the process itself: a bad pointer is no block, not
 * a crash (the driver answers -EFAULT for it); where a seccomp filter refuses process_vm_readv,
 * with a plain copy. Lines are written whole with one write() on an
 * O_APPEND file under a lock, so threads and forked children do not interleave them.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define NVR_MAX_BLOCK 16384 /* NV_ABSOLUTE_MAX_IOCTL_SIZE (nv.h) */
#define NVR_FD_CACHE 4096   /* fds below this have their state and path cached */
#define NVR_PATH 64
#define NV_TYPE 0x46           /* 'F', NV_IOCTL_MAGIC (nv-ioctl-numbers.h) */
#define NV_ESC_RM_CONTROL 0x2A /* nv_escape.h */
#define NV_ESC_RM_ALLOC 0x2B
#define NV_ESC_IOCTL_XFER_CMD 0xD3 /* nv-ioctl-numbers.h */

enum { FD_UNKNOWN = 0, FD_DEVICE = 1 };

static int out_fd = -1;
static pthread_mutex_t out_lock = PTHREAD_MUTEX_INITIALIZER;
static char match_list[1024] = "/dev/nvidia";
static unsigned char fd_state[NVR_FD_CACHE];
static char fd_path[NVR_FD_CACHE][NVR_PATH];

static int (*real_ioctl)(int, unsigned long, ...);
static int (*real_open)(const char *, int, ...);
static int (*real_open64)(const char *, int, ...);
static int (*real_openat)(int, const char *, int, ...);
static int (*real_openat64)(int, const char *, int, ...);
static int (*real_close)(int);
static int (*real_dup)(int);
static int (*real_dup2)(int, int);
static int (*real_dup3)(int, int, int);

static void *next(const char *name)
{
    void *p = dlsym(RTLD_NEXT, name);
    if (!p) {
        static const char msg[] = "nvrecord: dlsym failed for a libc function\n";
        ssize_t n = write(2, msg, sizeof(msg) - 1);
        (void)n;
        _exit(127);
    }
    return p;
}

static void resolve(void)
{
    if (real_ioctl)
        return;
    real_open = next("open");
    real_open64 = next("open64");
    real_openat = next("openat");
    real_openat64 = next("openat64");
    real_close = next("close");
    real_dup = next("dup");
    real_dup2 = next("dup2");
    real_dup3 = next("dup3");
    __atomic_store_n(&real_ioctl, (int (*)(int, unsigned long, ...))next("ioctl"), __ATOMIC_RELEASE);
}

static uint64_t boottime_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_BOOTTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* A growable line buffer. */
struct line {
    char *buf;
    size_t len, cap;
};

static void put(struct line *l, const char *s, size_t n)
{
    if (l->len + n + 1 > l->cap) {
        size_t cap = l->cap ? l->cap : 1024;
        while (l->len + n + 1 > cap)
            cap *= 2;
        char *b = realloc(l->buf, cap);
        if (!b)
            return;
        l->buf = b;
        l->cap = cap;
    }
    memcpy(l->buf + l->len, s, n);
    l->len += n;
    l->buf[l->len] = 0;
}

static void putf(struct line *l, const char *fmt, ...)
{
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof(tmp), fmt, ap);
    va_end(ap);
    if (n > 0)
        put(l, tmp, (size_t)n < sizeof(tmp) ? (size_t)n : sizeof(tmp) - 1);
}

/* A JSON string: the paths we write hold no control characters, but quote and backslash can. */
static void put_str(struct line *l, const char *key, const char *s)
{
    putf(l, ",\"%s\":\"", key);
    for (; *s; s++) {
        if (*s == '"' || *s == '\\')
            put(l, "\\", 1);
        if ((unsigned char)*s >= 0x20)
            put(l, s, 1);
    }
    put(l, "\"", 1);
}

static void put_hex(struct line *l, const char *key, const unsigned char *b, size_t n)
{
    static const char digits[] = "0123456789abcdef";
    putf(l, ",\"%s\":\"", key);
    char chunk[256];
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        chunk[k++] = digits[b[i] >> 4];
        chunk[k++] = digits[b[i] & 15];
        if (k == sizeof(chunk)) {
            put(l, chunk, k);
            k = 0;
        }
    }
    put(l, chunk, k);
    put(l, "\"", 1);
}

static void emit(struct line *l)
{
    if (!l->buf)
        return;
    put(l, "}\n", 2);
    pthread_mutex_lock(&out_lock);
    size_t off = 0;
    while (off < l->len) {
        ssize_t n = write(out_fd, l->buf + off, l->len - off);
        if (n <= 0) {
            if (n < 0 && errno == EINTR)
                continue;
            break;
        }
        off += (size_t)n;
    }
    pthread_mutex_unlock(&out_lock);
    free(l->buf);
    l->buf = NULL;
}

static int matches(const char *path)
{
    const char *p = match_list;
    while (*p) {
        const char *end = strchr(p, ':');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n && strncmp(path, p, n) == 0)
            return 1;
        if (!end)
            break;
        p = end + 1;
    }
    return 0;
}

/* The fd's path when it is a device file to record; NULL otherwise. `fresh` looks it up again. */
static const char *device_path(int fd, int fresh, char *scratch)
{
    if (fd < 0 || fd == out_fd)
        return NULL;
    if (!fresh && fd < NVR_FD_CACHE && fd_state[fd] == FD_DEVICE)
        return fd_path[fd];
    char link[64];
    snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, scratch, NVR_PATH - 1);
    if (n <= 0)
        return NULL;
    scratch[n] = 0;
    if (!matches(scratch)) {
        if (fd < NVR_FD_CACHE)
            fd_state[fd] = FD_UNKNOWN; /* not cached as "other": the number may be reused unseen */
        return NULL;
    }
    if (fd < NVR_FD_CACHE) {
        memcpy(fd_path[fd], scratch, (size_t)n + 1);
        fd_state[fd] = FD_DEVICE;
        return fd_path[fd];
    }
    return scratch;
}

static void forget(int fd)
{
    if (fd >= 0 && fd < NVR_FD_CACHE)
        fd_state[fd] = FD_UNKNOWN;
}

static void start_line(struct line *l, const char *ev, int fd, const char *dev, uint64_t ts_ns)
{
    putf(l, "{\"ev\":\"%s\",\"ts_ns\":%llu,\"pid\":%d,\"fd\":%d", ev, (unsigned long long)ts_ns,
         (int)getpid(), fd);
    put_str(l, "dev", dev);
}

static void opened(int fd)
{
    char scratch[NVR_PATH];
    forget(fd);
    if (out_fd < 0 || fd < 0)
        return;
    const char *dev = device_path(fd, 1, scratch);
    if (!dev)
        return;
    struct line l = {0};
    start_line(&l, "open", fd, dev, boottime_ns());
    emit(&l);
}

static void closing(int fd)
{
    char scratch[NVR_PATH];
    if (out_fd < 0)
        return;
    const char *dev = device_path(fd, 0, scratch);
    if (!dev)
        return;
    struct line l = {0};
    start_line(&l, "close", fd, dev, boottime_ns());
    emit(&l);
}

/* read_user's fallback where process_vm_readv is refused (a seccomp filter, as some container
 * runtimes install): the kernel copies from `addr` into a pipe, and an unreadable address is EFAULT
 * there, as the driver's own copy_from_user makes it, never a crash of the program as a memcpy
 * would. NVR_MAX_BLOCK fits a pipe's default capacity (64 KiB), so one write takes it whole. Raw
 * syscalls: close is intercepted here, and this is not the program's fd to record. */
static size_t read_user_via_pipe(uint64_t addr, size_t len, unsigned char *dst)
{
    int p[2];
    if (syscall(SYS_pipe2, p, O_CLOEXEC | O_NONBLOCK) != 0)
        return 0;
    long n = syscall(SYS_write, p[1], (const void *)(uintptr_t)addr, len);
    size_t got = 0;
    while (n > 0 && got < (size_t)n) {
        long r = syscall(SYS_read, p[0], dst + got, (size_t)n - got);
        if (r <= 0)
            break;
        got += (size_t)r;
    }
    syscall(SYS_close, p[0]);
    syscall(SYS_close, p[1]);
    return got;
}

/* Reads up to `len` bytes of this process's memory at `addr`; the number read (0: unreadable). */
static size_t read_user(uint64_t addr, size_t len, unsigned char *dst)
{
    if (!addr || !len)
        return 0;
    if (len > NVR_MAX_BLOCK)
        len = NVR_MAX_BLOCK;
    struct iovec local = {dst, len}, remote = {(void *)(uintptr_t)addr, len};
    ssize_t n = process_vm_readv(getpid(), &local, 1, &remote, 1, 0);
    if (n < 0 && (errno == ENOSYS || errno == EPERM))
        return read_user_via_pipe(addr, len, dst); /* a seccomp filter refuses the call */
    return n > 0 ? (size_t)n : 0;
}

static uint32_t u32_at(const unsigned char *b, size_t n, size_t off)
{
    uint32_t v = 0;
    if (off + 4 <= n)
        memcpy(&v, b + off, 4);
    return v;
}

static uint64_t u64_at(const unsigned char *b, size_t n, size_t off)
{
    uint64_t v = 0;
    if (off + 8 <= n)
        memcpy(&v, b + off, 8);
    return v;
}

/* Allocation-parameter sizes of the classes whose parameters the decoder reads, for a block with
 * no paramsSize (NVOS21 and NVOS64 before 535.43.02): docs/reference/nvidia-ioctl-abi.md §4.1. */
static uint32_t class_params_size(uint32_t h_class)
{
    switch (h_class) {
    case 0x3E: case 0x3F: case 0x40: return 128; /* NV_MEMORY_ALLOCATION_PARAMS (nvos.h) */
    case 0x80: return 56;                        /* NV0080_ALLOC_PARAMETERS (class/cl0080.h) */
    case 0x2080: return 4;                       /* NV2080_ALLOC_PARAMETERS (class/cl2080.h) */
    case 0x5: case 0x78: case 0x79: return 24;   /* NV0005_ALLOC_PARAMETERS (class/cl0005.h) */
    default: return 0;
    }
}

/* Where the pointer block of escape `nr` (whose block `b` has `n` bytes) is, and its size. */
static void ptr_block(unsigned nr, const unsigned char *b, size_t n, uint64_t *addr, size_t *len)
{
    *addr = 0;
    *len = 0;
    if (nr == NV_ESC_RM_ALLOC && (n == 32 || n == 40 || n == 48)) {
        uint32_t size = 0;
        if (n == 32)
            size = u32_at(b, n, 24); /* NVOS21.paramsSize from 535.43.02; status (0) before */
        else if (n == 48)
            size = u32_at(b, n, 32); /* NVOS64.paramsSize */
        if (size == 0 || size > NVR_MAX_BLOCK)
            size = class_params_size(u32_at(b, n, 12));
        *addr = u64_at(b, n, 16);
        *len = size;
    } else if (nr == NV_ESC_RM_CONTROL && n == 32) {
        *addr = u64_at(b, n, 16);
        *len = u32_at(b, n, 24);
    }
}

int ioctl(int fd, unsigned long request, ...)
{
    va_list ap;
    va_start(ap, request);
    void *arg = va_arg(ap, void *);
    va_end(ap);
    resolve();
    char scratch[NVR_PATH];
    const char *dev = out_fd >= 0 ? device_path(fd, 0, scratch) : NULL;
    if (!dev)
        return real_ioctl(fd, request, arg);

    unsigned type = (request >> 8) & 0xFF, nr = request & 0xFF;
    size_t size = (request >> 16) & 0x3FFF; /* _IOC_SIZE */
    size_t nb = 0, na = 0, nxb = 0, nxa = 0, npb = 0, npa = 0;
    uint64_t xptr = 0, pptr = 0;
    size_t xlen = 0, plen = 0;
    int blocks = type == NV_TYPE && size > 0;
    /* Six block buffers from the heap, per call: not in TLS, whose static block glibc carves out
     * of every thread's stack (a thread created with a small stack would fail to start). */
    static unsigned char none[6][1];
    unsigned char *mem = blocks ? malloc(6 * (size_t)NVR_MAX_BLOCK) : NULL;
    unsigned char *buf[6];
    for (int i = 0; i < 6; i++)
        buf[i] = mem ? mem + (size_t)i * NVR_MAX_BLOCK : none[i];
    unsigned char *before = buf[0], *after = buf[1], *xb = buf[2], *xa = buf[3], *pb = buf[4], *pa = buf[5];
    if (!mem)
        blocks = 0;
    if (blocks) {
        nb = read_user((uint64_t)(uintptr_t)arg, size, before);
        const unsigned char *carried = before;
        size_t carried_n = nb;
        unsigned carried_nr = nr;
        if (nr == NV_ESC_IOCTL_XFER_CMD && nb >= 16) {
            carried_nr = u32_at(before, nb, 0) & 0xFF; /* a bare nr (nv.c) */
            xlen = u32_at(before, nb, 4);
            xptr = u64_at(before, nb, 8);
            nxb = read_user(xptr, xlen, xb);
            carried = xb;
            carried_n = nxb;
        }
        ptr_block(carried_nr, carried, carried_n, &pptr, &plen);
        npb = read_user(pptr, plen, pb);
    }

    uint64_t entry_ns = boottime_ns();
    int ret = real_ioctl(fd, request, arg);
    int err = errno;

    struct line l = {0};
    start_line(&l, "ioctl", fd, dev, entry_ns);
    putf(&l, ",\"tid\":%ld,\"req\":\"0x%lx\",\"ret\":%d,\"errno\":%d", (long)syscall(SYS_gettid), request,
         ret, ret < 0 ? err : 0);
    if (blocks) {
        na = read_user((uint64_t)(uintptr_t)arg, size, after);
        put_hex(&l, "before", before, nb);
        put_hex(&l, "after", after, na);
        if (xptr) {
            nxa = read_user(xptr, xlen, xa);
            put_hex(&l, "xfer_before", xb, nxb);
            put_hex(&l, "xfer_after", xa, nxa);
        }
        if (pptr && plen) {
            npa = read_user(pptr, plen, pa);
            putf(&l, ",\"ptr_at\":\"0x%llx\"", (unsigned long long)pptr);
            put_hex(&l, "ptr_before", pb, npb);
            put_hex(&l, "ptr_after", pa, npa);
        }
    }
    emit(&l);
    free(mem);
    errno = err;
    return ret;
}

static mode_t mode_arg(int flags, va_list ap)
{
    return (flags & O_CREAT) || (flags & O_TMPFILE) == O_TMPFILE ? (mode_t)va_arg(ap, int) : 0;
}

int open(const char *path, int flags, ...)
{
    va_list ap;
    va_start(ap, flags);
    mode_t mode = mode_arg(flags, ap);
    va_end(ap);
    resolve();
    int fd = real_open(path, flags, mode);
    opened(fd);
    return fd;
}

int open64(const char *path, int flags, ...)
{
    va_list ap;
    va_start(ap, flags);
    mode_t mode = mode_arg(flags, ap);
    va_end(ap);
    resolve();
    int fd = real_open64(path, flags, mode);
    opened(fd);
    return fd;
}

int openat(int dirfd, const char *path, int flags, ...)
{
    va_list ap;
    va_start(ap, flags);
    mode_t mode = mode_arg(flags, ap);
    va_end(ap);
    resolve();
    int fd = real_openat(dirfd, path, flags, mode);
    opened(fd);
    return fd;
}

int openat64(int dirfd, const char *path, int flags, ...)
{
    va_list ap;
    va_start(ap, flags);
    mode_t mode = mode_arg(flags, ap);
    va_end(ap);
    resolve();
    int fd = real_openat64(dirfd, path, flags, mode);
    opened(fd);
    return fd;
}

/* The _FORTIFY_SOURCE entry points of open (glibc's fcntl2.h). */
int __open_2(const char *path, int flags) { return open(path, flags); }
int __open64_2(const char *path, int flags) { return open64(path, flags); }
int __openat_2(int dirfd, const char *path, int flags) { return openat(dirfd, path, flags); }
int __openat64_2(int dirfd, const char *path, int flags) { return openat64(dirfd, path, flags); }

int close(int fd)
{
    resolve();
    if (fd >= 0 && fd == out_fd)
        return 0; /* a program closing every fd keeps the recording going */
    closing(fd);
    forget(fd);
    return real_close(fd);
}

int dup(int oldfd)
{
    resolve();
    int fd = real_dup(oldfd);
    opened(fd);
    return fd;
}

int dup2(int oldfd, int newfd)
{
    resolve();
    if (newfd != oldfd)
        closing(newfd); /* dup2 closes what newfd was */
    int fd = real_dup2(oldfd, newfd);
    opened(fd);
    return fd;
}

int dup3(int oldfd, int newfd, int flags)
{
    resolve();
    if (newfd != oldfd)
        closing(newfd);
    int fd = real_dup3(oldfd, newfd, flags);
    opened(fd);
    return fd;
}

static void read_line(const char *path, char *dst, size_t cap)
{
    dst[0] = 0;
    int fd = (int)syscall(SYS_openat, AT_FDCWD, path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    ssize_t n = read(fd, dst, cap - 1);
    syscall(SYS_close, fd);
    if (n <= 0)
        return;
    dst[n] = 0;
    dst[strcspn(dst, "\n")] = 0;
}

/* A fork while another thread holds the lock would leave the child's copy locked forever. */
static void lock_out(void) { pthread_mutex_lock(&out_lock); }
static void unlock_out(void) { pthread_mutex_unlock(&out_lock); }

__attribute__((constructor)) static void nvrecord_init(void)
{
    resolve();
    pthread_atfork(lock_out, unlock_out, unlock_out);
    const char *out = getenv("NVRECORD_OUT");
    if (!out || !*out)
        return;
    const char *match = getenv("NVRECORD_MATCH");
    if (match && *match)
        snprintf(match_list, sizeof(match_list), "%s", match);
    /* Opened by syscall, not through our own open(); moved high so the program's fd numbers are
     * what they would be without the library (after this one low number is closed again). */
    int fd = (int)syscall(SYS_openat, AT_FDCWD, out, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) {
        fprintf(stderr, "nvrecord: cannot open NVRECORD_OUT=%s: %s\n", out, strerror(errno));
        return;
    }
    int high = fcntl(fd, F_DUPFD_CLOEXEC, 900);
    if (high >= 0) {
        syscall(SYS_close, fd);
        fd = high;
    }
    out_fd = fd;
    char exe[256] = "", driver[64] = "";
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    exe[n > 0 ? n : 0] = 0;
    read_line("/sys/module/nvidia/version", driver, sizeof(driver));
    struct line l = {0};
    putf(&l, "{\"ev\":\"start\",\"ts_ns\":%llu,\"pid\":%d,\"ppid\":%d", (unsigned long long)boottime_ns(),
         (int)getpid(), (int)getppid());
    put_str(&l, "exe", exe);
    if (driver[0])
        put_str(&l, "driver", driver);
    put_str(&l, "match", match_list);
    emit(&l);
}
