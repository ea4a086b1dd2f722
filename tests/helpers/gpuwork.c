/* gpuwork: a scriptable stand-in for a GPU client, for ghostgpu's integration tests.
 *
 * Usage:  gpuwork STEP...                     run the script as a plain process
 *         gpuwork --shim [OPT]... -- STEP...  be a container "shim": see shim_main()
 *
 * Steps run in order; every fd the script gets (open, dup, recvfd) is pushed on a table and
 * named by its index (0, 1, ...) in later steps:
 *   open PATH | ioctl IDX CMD N | mmap IDX | close IDX | dup IDX | sleep MS | ready | wait
 *   fork | thread-hold | sendfd SOCKPATH IDX | recvfd SOCKPATH | exit CODE | exec | rename COMM
 *   rmalloc IDX HOW CLASS
 * rmalloc issues one NVIDIA allocation call with RM class CLASS at hClass@12 of a real parameter
 * block (docs/reference/nvidia-ioctl-abi.md §2-§4); HOW picks the escape and block: alloc
 * (NV_ESC_RM_ALLOC, 32-byte NVOS21), alloc64 (48-byte NVOS64), xfer (NVOS21 carried by
 * NV_ESC_IOCTL_XFER_CMD), object (NV_ESC_RM_ALLOC_OBJECT), memory (NV_ESC_RM_ALLOC_MEMORY), heap
 * (NV_ESC_RM_VID_HEAP_CONTROL, CLASS is the NVOS32 function@8). Its result (ENOTTY on a fake
 * node) is ignored, like ioctl's.
 * A bad script prints "script-error ..." and exits 2 before any step runs. A failed
 * open/mmap/dup/sendfd/recvfd prints "step-error <step> <errno>" and the script goes on.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <stdint.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_FDS 256
#define CONNECT_DEADLINE_MS 10000

static int fds[MAX_FDS];
static int nfds;
static unsigned char ioctl_buf[4096]; /* zeroed arg; _IOC_SIZE of any ioctl fits in 14 bits */

/* args: one letter per argument, 'p' a path, 'i' an integer (decimal or 0x hex) */
static const struct { const char *name; const char *args; } STEPS[] = {
    {"open", "p"}, {"ioctl", "iii"}, {"mmap", "i"}, {"close", "i"}, {"dup", "i"}, {"sleep", "i"},
    {"ready", ""}, {"wait", ""}, {"fork", ""}, {"thread-hold", ""}, {"sendfd", "pi"},
    {"recvfd", "p"}, {"exit", "i"}, {"exec", ""}, {"rename", "p"}, {"rmalloc", "ipi"},
};

#define NV_IOWR(nr, size) ((3u << 30) | ((uint32_t)(size) << 16) | (0x46u << 8) | (uint32_t)(nr))
/* rmalloc's HOW: escape nr (nv_escape.h, nv-ioctl-numbers.h) and block size (sheet §2) */
static const struct { const char *how; uint32_t nr, size; int xfer; } RM_ALLOCS[] = {
    {"alloc", 0x2B, 32, 0}, {"alloc64", 0x2B, 48, 0}, {"xfer", 0x2B, 32, 1}, {"object", 0x28, 20, 0},
    {"memory", 0x27, 56, 0}, {"heap", 0x4A, 184, 0},
};
#define NRM_ALLOCS (sizeof(RM_ALLOCS) / sizeof(RM_ALLOCS[0]))

static int rm_alloc_kind(const char *how) {
    for (size_t k = 0; k < NRM_ALLOCS; k++)
        if (strcmp(RM_ALLOCS[k].how, how) == 0) return (int)k;
    return -1;
}

static void rm_alloc(int fd, const char *how, uint32_t cls) {
    int k = rm_alloc_kind(how);
    uint32_t blk[46] = {0}; /* 184 bytes, the largest block here */
    blk[0] = 0xc1d00001, blk[1] = 0xc1d00001, blk[2] = 0xc1d00009; /* hRoot, hObjectParent, hObjectNew */
    if (RM_ALLOCS[k].nr == 0x4A) blk[2] = cls; /* NVOS32: function@8 */
    else blk[3] = cls;                         /* hClass@12 */
    if (!RM_ALLOCS[k].xfer) {
        (void)ioctl(fd, NV_IOWR(RM_ALLOCS[k].nr, RM_ALLOCS[k].size), blk);
        return;
    }
    struct { uint32_t cmd, size; uint64_t ptr; } x = {RM_ALLOCS[k].nr, RM_ALLOCS[k].size, (uintptr_t)blk};
    (void)ioctl(fd, NV_IOWR(0xD3, sizeof(x)), &x);
}

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {}
}

static void step_error(const char *step, int err) {
    printf("step-error %s %d\n", step, err);
    fflush(stdout);
}

static int push_fd(int fd) {
    if (nfds == MAX_FDS) { close(fd); return -1; }
    fds[nfds++] = fd;
    return 0;
}

static int fd_at(const char *idx) {
    long i = strtol(idx, NULL, 0);
    return (i >= 0 && i < nfds) ? fds[i] : -1;
}

/* Blocks until a full line or EOF arrives on stdin; read() byte by byte so that nothing past
 * the newline is consumed (a later `wait` gets the next line). */
static void wait_line(void) {
    char c;
    ssize_t n;
    while ((n = read(0, &c, 1)) == 1 && c != '\n') {}
    (void)n;
}

static void *hold_thread(void *arg) {
    (void)arg;
    wait_line();
    exit(0); /* ends the whole thread group, zombie leader included */
}

static int unix_addr(const char *path, struct sockaddr_un *sa) {
    memset(sa, 0, sizeof(*sa));
    sa->sun_family = AF_UNIX;
    if (strlen(path) >= sizeof(sa->sun_path)) { errno = ENAMETOOLONG; return -1; }
    strcpy(sa->sun_path, path);
    return 0;
}

static int send_fd(const char *path, int fd) {
    struct sockaddr_un sa;
    if (fd < 0) { errno = EBADF; return -1; }
    if (unix_addr(path, &sa) < 0) return -1;
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0) return -1;
    /* The receiver may not be listening yet: retry until a deadline instead of making every
     * caller order the two processes. */
    int waited_ms = 0;
    while (connect(s, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
        if ((errno != ENOENT && errno != ECONNREFUSED) || waited_ms >= CONNECT_DEADLINE_MS) {
            int err = errno; close(s); errno = err; return -1;
        }
        sleep_ms(2);
        waited_ms += 2;
    }
    char byte = 'f';
    struct iovec iov = {&byte, 1};
    union { struct cmsghdr h; char buf[CMSG_SPACE(sizeof(int))]; } ctl;
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf,
                         .msg_controllen = sizeof(ctl.buf)};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &fd, sizeof(int));
    ssize_t n = sendmsg(s, &msg, 0);
    int err = errno;
    close(s);
    errno = err;
    return n == 1 ? 0 : -1;
}

static int recv_fd(const char *path) {
    struct sockaddr_un sa;
    if (unix_addr(path, &sa) < 0) return -1;
    int ls = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (ls < 0) return -1;
    unlink(path);
    if (bind(ls, (struct sockaddr *)&sa, sizeof(sa)) < 0 || listen(ls, 1) < 0) {
        int err = errno; close(ls); errno = err; return -1;
    }
    int s = accept4(ls, NULL, NULL, SOCK_CLOEXEC);
    int err = errno;
    close(ls);
    unlink(path);
    if (s < 0) { errno = err; return -1; }
    char byte;
    struct iovec iov = {&byte, 1};
    union { struct cmsghdr h; char buf[CMSG_SPACE(sizeof(int))]; } ctl;
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf,
                         .msg_controllen = sizeof(ctl.buf)};
    ssize_t n = recvmsg(s, &msg, 0);
    err = errno;
    close(s);
    struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
    if (n != 1 || cm == NULL || cm->cmsg_type != SCM_RIGHTS) { errno = n < 0 ? err : EPROTO; return -1; }
    int fd;
    memcpy(&fd, CMSG_DATA(cm), sizeof(int));
    return fd;
}

/* Checks names and arguments of the whole script so that a typo fails before any step has
 * side effects: returns, or prints one script-error line and exits 2. */
static void check_script(int argc, char **argv) {
    for (int i = 0; i < argc;) {
        size_t k = 0;
        while (k < sizeof(STEPS) / sizeof(STEPS[0]) && strcmp(STEPS[k].name, argv[i]) != 0) k++;
        if (k == sizeof(STEPS) / sizeof(STEPS[0])) {
            printf("script-error unknown step '%s'\n", argv[i]);
            exit(2);
        }
        int nargs = (int)strlen(STEPS[k].args);
        if (i + 1 + nargs > argc) {
            printf("script-error step '%s' needs %d argument(s)\n", argv[i], nargs);
            exit(2);
        }
        for (int a = 0; a < nargs; a++) {
            char *end;
            const char *arg = argv[i + 1 + a];
            (void)strtoul(arg, &end, 0);
            if (STEPS[k].args[a] == 'i' && (*arg == '\0' || *end != '\0')) {
                printf("script-error step '%s': '%s' is not an integer\n", argv[i], arg);
                exit(2);
            }
        }
        if (strcmp(STEPS[k].name, "rmalloc") == 0 && rm_alloc_kind(argv[i + 2]) < 0) {
            printf("script-error rmalloc: unknown HOW '%s'\n", argv[i + 2]);
            exit(2);
        }
        i += 1 + nargs;
        if (strcmp(STEPS[k].name, "thread-hold") == 0 && i < argc) {
            printf("script-error thread-hold must be the last step\n");
            exit(2);
        }
    }
}

static int run_script(int argc, char **argv) {
    for (int i = 0; i < argc; i++) {
        const char *s = argv[i];
        if (strcmp(s, "open") == 0) {
            int fd = open(argv[++i], O_RDWR);
            if (fd < 0 || push_fd(fd) < 0) step_error(s, fd < 0 ? errno : EMFILE);
        } else if (strcmp(s, "ioctl") == 0) {
            int fd = fd_at(argv[i + 1]);
            unsigned long cmd = strtoul(argv[i + 2], NULL, 0);
            long n = strtol(argv[i + 3], NULL, 0);
            for (long k = 0; k < n; k++) (void)ioctl(fd, cmd, ioctl_buf); /* ENOTTY is fine */
            i += 3;
        } else if (strcmp(s, "rmalloc") == 0) {
            rm_alloc(fd_at(argv[i + 1]), argv[i + 2], (uint32_t)strtoul(argv[i + 3], NULL, 0));
            i += 3;
        } else if (strcmp(s, "mmap") == 0) {
            void *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd_at(argv[++i]), 0);
            if (p == MAP_FAILED) step_error(s, errno);
        } else if (strcmp(s, "close") == 0) {
            long idx = strtol(argv[++i], NULL, 0);
            if (idx >= 0 && idx < nfds && fds[idx] >= 0) { close(fds[idx]); fds[idx] = -1; }
        } else if (strcmp(s, "dup") == 0) {
            int fd = dup(fd_at(argv[++i]));
            if (fd < 0 || push_fd(fd) < 0) step_error(s, fd < 0 ? errno : EMFILE);
        } else if (strcmp(s, "sleep") == 0) {
            sleep_ms(strtol(argv[++i], NULL, 0));
        } else if (strcmp(s, "ready") == 0) {
            printf("ready %d", (int)getpid());
            for (int k = 0; k < nfds; k++) printf(" %d", fds[k]);
            printf("\n");
            fflush(stdout);
        } else if (strcmp(s, "wait") == 0) {
            wait_line();
        } else if (strcmp(s, "fork") == 0) {
            fflush(stdout);
            pid_t child = fork();
            if (child < 0) { step_error(s, errno); continue; }
            if (child > 0) {
                while (waitpid(child, NULL, 0) < 0 && errno == EINTR) {}
                exit(0);
            }
        } else if (strcmp(s, "thread-hold") == 0) {
            pthread_t t;
            fflush(stdout);
            if (pthread_create(&t, NULL, hold_thread, NULL) != 0) { step_error(s, EAGAIN); return 1; }
            pthread_exit(NULL); /* the leader turns zombie; the thread keeps the group alive */
        } else if (strcmp(s, "sendfd") == 0) {
            int idx_fd = fd_at(argv[i + 2]);
            if (send_fd(argv[i + 1], idx_fd) < 0) {
                step_error(s, errno);
            } else {
                long idx = strtol(argv[i + 2], NULL, 0);
                close(fds[idx]);
                fds[idx] = -1;
            }
            i += 2;
        } else if (strcmp(s, "recvfd") == 0) {
            int fd = recv_fd(argv[++i]);
            if (fd < 0 || push_fd(fd) < 0) step_error(s, fd < 0 ? errno : EMFILE);
        } else if (strcmp(s, "exit") == 0) {
            fflush(stdout);
            exit((int)strtol(argv[++i], NULL, 0));
        } else if (strcmp(s, "rename") == 0) {
            /* What busybox does after exec'ing an applet through /proc/self/exe: the comm reads
             * "exe" until the applet names itself. */
            if (prctl(PR_SET_NAME, argv[++i], 0, 0, 0) < 0) step_error(s, errno);
        } else if (strcmp(s, "exec") == 0) {
            /* Re-exec this program with the rest of the script: fds opened without O_CLOEXEC
             * (every `open` here) survive into the new image, but its fd table starts empty. */
            char self[4096];
            ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
            if (n < 0) { step_error(s, errno); continue; }
            self[n] = '\0'; /* exec by the real path so that comm stays "gpuwork" */
            fflush(stdout);
            argv[i] = "gpuwork";
            execv(self, &argv[i]);
            step_error(s, errno);
        }
    }
    return 0;
}

static void shim_die(const char *what) {
    fprintf(stderr, "shim-error %s %d\n", what, errno);
    _exit(3);
}

/* Container init, still on the host side of the mount namespace: joins the container's
 * cgroups, gets a private /dev with the requested nodes (and bound files) and a /proc of its PID
 * namespace, then execs gpuwork (or --exec's program) with the script so that it is PID 1 there. */
static void container_init(int go_fd, const char *self, char **cgroups, int ncg, char **devs,
                           int ndev, char **binds, int nbind, const char *exec_path, char **script) {
    char go;
    if (read(go_fd, &go, 1) != 1) shim_die("sync"); /* the shim has announced our PID */
    close(go_fd);
    for (int k = 0; k < ncg; k++) {
        int fd = open(cgroups[k], O_WRONLY | O_CLOEXEC);
        if (fd < 0 || write(fd, "0", 1) != 1) shim_die(cgroups[k]);
        close(fd);
    }
    if (unshare(CLONE_NEWNS) < 0) shim_die("unshare-mnt");
    /* Without this a shared / (systemd hosts) would propagate our /dev tmpfs to the host. */
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) shim_die("make-private");
    /* --bind sources are reached by their host path, which the /dev tmpfs may cover: pin them
     * first (O_PATH), bind them through /proc/self/fd after. */
    int bind_fds[64];
    for (int k = 0; k < nbind; k++) {
        char *colon = strchr(binds[k], ':'); /* NAME:HOST_PATH */
        if (colon == NULL) { errno = EINVAL; shim_die(binds[k]); }
        *colon = '\0';
        bind_fds[k] = open(colon + 1, O_PATH | O_CLOEXEC);
        if (bind_fds[k] < 0) shim_die(colon + 1);
    }
    if (mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=64k") < 0)
        shim_die("mount-dev");
    for (int k = 0; k < nbind; k++) {
        char path[512], src[64];
        snprintf(path, sizeof(path), "/dev/%s", binds[k]);
        int fd = open(path, O_CREAT | O_WRONLY | O_CLOEXEC, 0666); /* the mount point */
        if (fd < 0) shim_die(path);
        close(fd);
        snprintf(src, sizeof(src), "/proc/self/fd/%d", bind_fds[k]);
        if (mount(src, path, NULL, MS_BIND, NULL) < 0) shim_die(path);
        close(bind_fds[k]);
    }
    for (int k = 0; k < ndev; k++) {
        char path[512];
        unsigned maj, min;
        char *colon = strrchr(devs[k], ':'); /* NAME:MAJ:MIN, NAME may hold '/' */
        if (colon == NULL) { errno = EINVAL; shim_die(devs[k]); }
        *colon = '\0';
        char *maj_s = strrchr(devs[k], ':');
        if (maj_s == NULL) { errno = EINVAL; shim_die(devs[k]); }
        *maj_s = '\0';
        maj = (unsigned)strtoul(maj_s + 1, NULL, 0);
        min = (unsigned)strtoul(colon + 1, NULL, 0);
        snprintf(path, sizeof(path), "/dev/%s", devs[k]);
        for (char *p = path + 5; (p = strchr(p, '/')) != NULL; p++) {
            *p = '\0';
            mkdir(path, 0755);
            *p = '/';
        }
        if (mknod(path, S_IFCHR | 0666, makedev(maj, min)) < 0) shim_die(path);
        chmod(path, 0666); /* mknod's mode is masked by umask */
    }
    if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
        shim_die("mount-proc");
    if (exec_path != NULL) { /* another program as the init, e.g. rmplan, with the script as its argv */
        const char *base = strrchr(exec_path, '/');
        script[-1] = (char *)(base ? base + 1 : exec_path);
        execv(exec_path, script - 1);
        shim_die(exec_path);
    }
    script[-1] = (char *)"gpuwork";
    execv(self, script - 1);
    shim_die("exec");
}

/* --shim [--comm NAME] [--cgroup PROCS_FILE]... [--dev NAME:MAJ:MIN]... [--bind NAME:HOST_PATH]...
 *        [--exec PROGRAM] -- STEP...
 * --bind mounts HOST_PATH (e.g. a fake driver's FUSE file) on /dev/NAME; --exec makes PROGRAM
 * the init instead of gpuwork, with the STEPs as its arguments.
 * The shim stays on the host (its cgroups, its namespaces), like containerd-shim: it only
 * forks the container init into a new PID namespace, prints "shim-init <host pid>", and
 * waits for it, exiting with its status. Setup failures print "shim-error <what> <errno>"
 * on stderr and exit 3. */
static int shim_main(int argc, char **argv) {
    char *cgroups[64], *devs[64], *binds[64];
    int ncg = 0, ndev = 0, nbind = 0, i = 2;
    const char *comm = "containerd-shim", *exec_path = NULL;
    for (; i < argc && strcmp(argv[i], "--") != 0; i += 2) {
        if (i + 1 >= argc) { errno = EINVAL; shim_die(argv[i]); }
        if (strcmp(argv[i], "--comm") == 0) comm = argv[i + 1];
        else if (strcmp(argv[i], "--cgroup") == 0 && ncg < 64) cgroups[ncg++] = argv[i + 1];
        else if (strcmp(argv[i], "--dev") == 0 && ndev < 64) devs[ndev++] = argv[i + 1];
        else if (strcmp(argv[i], "--bind") == 0 && nbind < 64) binds[nbind++] = argv[i + 1];
        else if (strcmp(argv[i], "--exec") == 0) exec_path = argv[i + 1];
        else { errno = EINVAL; shim_die(argv[i]); }
    }
    if (i >= argc) { errno = EINVAL; shim_die("missing --"); }
    if (exec_path == NULL) check_script(argc - i - 1, argv + i + 1);
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n < 0) shim_die("readlink-exe");
    self[n] = '\0';
    prctl(PR_SET_NAME, comm, 0, 0, 0);
    if (unshare(CLONE_NEWPID) < 0) shim_die("unshare-pid");
    int sync[2];
    if (pipe2(sync, O_CLOEXEC) < 0) shim_die("pipe");
    pid_t child = fork();
    if (child < 0) shim_die("fork");
    if (child == 0) {
        close(sync[1]);
        container_init(sync[0], self, cgroups, ncg, devs, ndev, binds, nbind, exec_path, argv + i + 1);
    }
    /* First line on stdout, before the init may print anything: the init's host PID, which
     * nothing inside the container can tell (getpid() there is 1). */
    char line[64];
    int len = snprintf(line, sizeof(line), "shim-init %d\n", (int)child);
    if (write(1, line, (size_t)len) != len || write(sync[1], "g", 1) != 1) shim_die("announce");
    close(sync[1]);
    close(sync[0]);
    int status = 0;
    while (waitpid(child, &status, 0) < 0 && errno == EINTR) {}
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--shim") == 0) return shim_main(argc, argv);
    check_script(argc - 1, argv + 1);
    return run_script(argc - 1, argv + 1);
}
