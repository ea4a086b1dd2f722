/* churn: fork/exec churn of short-lived GPU device holders, for ghostgpu's churn test and bench.
 *
 * Usage:
 *   churn run [--count N] [--concurrency C] [--hold-ms MS] [--device PATH] [--rate-per-s R]
 *             [--private-dev NAME:MAJ:MIN]... [--join PID] [--cgroup PROCS_FILE]...
 *   churn hold MS      the exec'd image: fd 3 must be a character device; sleeps MS, exits 0
 *   churn spin MS      a CPU hog: a busy loop for MS, then exit 0
 *
 * `run` keeps up to C children alive until N have been reaped. Each child opens PATH as fd 3
 * (no O_CLOEXEC, as `sh -c 'exec 3<>/dev/nvidia0; exec job'` would), then execs this program as
 * `churn hold MS`, so the hold survives exec: open, exec, exit, all within ~MS. Where the children
 * live is the launcher's choice, made once before the first fork:
 *   --private-dev  a private mount namespace with a tmpfs /dev holding these nodes (the host half:
 *                  no /dev/nvidia0 appears on the real host)
 *   --join PID     the PID and mount namespaces of PID (a fake container's init): children are
 *                  forked into its PID namespace, yet fork() returns their host PID here
 *   --cgroup F     write 0 to each cgroup.procs F first (the container's cgroups), so children
 *                  start in them with no per-child cgroup migration
 * Output on stdout, one write(2) per line as it happens (readers poll the file mid-run):
 *   start <launcher pid> <boot ns>
 *   child <host pid> <fork boot ns> <reap boot ns> <status>   status: exit code, 128+signal
 *   done <children> <boot ns>
 * Times are CLOCK_BOOTTIME, the clock of bpf_ktime_get_boot_ns() and of the tracer's ts_ns.
 * Setup failures print "churn-error <what> <errno>" on stderr and exit 3.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_LIST 64
#define HIGH_FD 64 /* the launcher's own fds live at or above this, so a child's open() gets fd 3 */

struct slot { pid_t pid; uint64_t fork_ns; };

static uint64_t boot_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_BOOTTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void die(const char *what) {
    fprintf(stderr, "churn-error %s %d\n", what, errno);
    exit(3);
}

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {}
}

/* Lines go out with one write(2) each: a reader of the file never sees half a line. */
static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...) {
    char line[160];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    if (n > 0 && write(1, line, (size_t)n) != n) die("write-stdout");
}

static int high_fd(int fd, const char *what) {
    if (fd < 0) die(what);
    int moved = fcntl(fd, F_DUPFD_CLOEXEC, HIGH_FD);
    if (moved < 0) die(what);
    close(fd);
    return moved;
}

static void private_dev(char **devs, int ndev) {
    if (unshare(CLONE_NEWNS) < 0) die("unshare-mnt");
    /* Without this a shared / (systemd hosts) would propagate our /dev tmpfs to the host. */
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) die("make-private");
    if (mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=64k") < 0) die("mount-dev");
    for (int k = 0; k < ndev; k++) {
        char path[256];
        unsigned maj, min;
        char name[128];
        if (sscanf(devs[k], "%127[^:]:%u:%u", name, &maj, &min) != 3) { errno = EINVAL; die(devs[k]); }
        snprintf(path, sizeof(path), "/dev/%s", name);
        if (mknod(path, S_IFCHR | 0666, makedev(maj, min)) < 0) die(path);
        chmod(path, 0666); /* mknod's mode is masked by umask */
    }
}

static void join(const char *pid, char **cgroups, int ncg) {
    char path[64];
    snprintf(path, sizeof(path), "/proc/%s/ns/pid", pid);
    int pidns = high_fd(open(path, O_RDONLY | O_CLOEXEC), "open-pidns");
    snprintf(path, sizeof(path), "/proc/%s/ns/mnt", pid);
    int mntns = high_fd(open(path, O_RDONLY | O_CLOEXEC), "open-mntns");
    for (int k = 0; k < ncg; k++) {
        int fd = open(cgroups[k], O_WRONLY | O_CLOEXEC);
        if (fd < 0 || write(fd, "0", 1) != 1) die(cgroups[k]);
        close(fd);
    }
    /* pid_for_children only: this process stays in the host PID namespace, so fork() returns
     * the host PID of a child that is PID n inside the container. */
    if (setns(pidns, CLONE_NEWPID) < 0) die("setns-pid");
    if (setns(mntns, CLONE_NEWNS) < 0) die("setns-mnt");
    if (chdir("/") < 0) die("chdir");
    close(pidns);
    close(mntns);
}

/* The forked child: the device on fd 3, kept across exec. */
static void child(const char *self, const char *device, const char *hold_ms, const sigset_t *mask) {
    sigprocmask(SIG_SETMASK, mask, NULL); /* the launcher blocks SIGCHLD; the job should not */
    int fd = open(device, O_RDWR);
    if (fd < 0) _exit(10);
    if (fd != 3) { /* fds 0-2 closed by the caller: still run, on fd 3 all the same */
        if (dup2(fd, 3) < 0) _exit(11);
        close(fd);
    }
    char *argv[] = {(char *)"churn", (char *)"hold", (char *)hold_ms, NULL};
    execv(self, argv);
    _exit(12);
}

static int run(int argc, char **argv) {
    long count = 100, concurrency = 4, hold_ms = 10;
    double rate_per_s = 0;
    const char *device = "/dev/nvidia0", *join_pid = NULL;
    char *devs[MAX_LIST], *cgroups[MAX_LIST];
    int ndev = 0, ncg = 0;
    for (int i = 2; i < argc; i += 2) {
        if (i + 1 >= argc) { errno = EINVAL; die(argv[i]); }
        const char *k = argv[i], *v = argv[i + 1];
        if (!strcmp(k, "--count")) count = strtol(v, NULL, 0);
        else if (!strcmp(k, "--concurrency")) concurrency = strtol(v, NULL, 0);
        else if (!strcmp(k, "--hold-ms")) hold_ms = strtol(v, NULL, 0);
        else if (!strcmp(k, "--rate-per-s")) rate_per_s = strtod(v, NULL);
        else if (!strcmp(k, "--device")) device = v;
        else if (!strcmp(k, "--join")) join_pid = v;
        else if (!strcmp(k, "--private-dev") && ndev < MAX_LIST) devs[ndev++] = argv[i + 1];
        else if (!strcmp(k, "--cgroup") && ncg < MAX_LIST) cgroups[ncg++] = argv[i + 1];
        else { errno = EINVAL; die(k); }
    }
    if (count < 0 || concurrency < 1 || hold_ms < 0) { errno = EINVAL; die("arguments"); }
    char self[4096], hold[32];
    ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1); /* before any setns: /proc moves */
    if (n < 0) die("readlink-exe");
    self[n] = '\0';
    snprintf(hold, sizeof(hold), "%ld", hold_ms);
    if (ndev) private_dev(devs, ndev);
    if (join_pid) join(join_pid, cgroups, ncg);
    else if (ncg) { errno = EINVAL; die("--cgroup needs --join"); }

    sigset_t chld, old;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigprocmask(SIG_BLOCK, &chld, &old); /* sigtimedwait below: pace forks, wake on an exit */
    struct slot *slots = calloc((size_t)concurrency, sizeof(*slots));
    if (slots == NULL) die("calloc");
    long launched = 0, running = 0, reaped = 0;
    uint64_t start = boot_ns();
    say("start %d %llu\n", (int)getpid(), (unsigned long long)start);
    while (reaped < count) {
        int status;
        pid_t pid = 0;
        uint64_t now = boot_ns();
        if (launched < count && running < concurrency) {
            uint64_t due = rate_per_s > 0 ? start + (uint64_t)(launched * 1e9 / rate_per_s) : now;
            if (now >= due) {
                uint64_t fork_ns = boot_ns();
                pid_t c = fork();
                if (c < 0) { if (errno == EAGAIN) { sleep_ms(1); continue; } die("fork"); }
                if (c == 0) child(self, device, hold, &old);
                int k = 0;
                while (slots[k].pid != 0) k++;
                slots[k] = (struct slot){c, fork_ns};
                launched++, running++;
            } else if (running > 0) {
                struct timespec wait = {(time_t)((due - now) / 1000000000ull), (long)((due - now) % 1000000000ull)};
                sigtimedwait(&chld, NULL, &wait);
            } else {
                sleep_ms((long)((due - now) / 1000000ull));
            }
            pid = waitpid(-1, &status, WNOHANG);
        } else {
            while ((pid = waitpid(-1, &status, 0)) < 0 && errno == EINTR) {}
        }
        while (pid > 0) {
            uint64_t reap_ns = boot_ns();
            for (long k = 0; k < concurrency; k++) {
                if (slots[k].pid != pid) continue;
                int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
                say("child %d %llu %llu %d\n", (int)pid, (unsigned long long)slots[k].fork_ns,
                    (unsigned long long)reap_ns, code);
                slots[k].pid = 0;
                running--, reaped++;
                break;
            }
            pid = waitpid(-1, &status, WNOHANG);
        }
        if (pid < 0 && errno != ECHILD && errno != EINTR) die("waitpid");
    }
    say("done %ld %llu\n", reaped, (unsigned long long)boot_ns());
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 3 && !strcmp(argv[1], "hold")) {
        struct stat st;
        if (fstat(3, &st) < 0 || !S_ISCHR(st.st_mode)) return 4; /* the hold did not survive exec */
        sleep_ms(strtol(argv[2], NULL, 0));
        return 0;
    }
    if (argc == 3 && !strcmp(argv[1], "spin")) {
        uint64_t end = boot_ns() + (uint64_t)strtol(argv[2], NULL, 0) * 1000000ull;
        volatile uint64_t x = 0;
        while (boot_ns() < end)
            for (int i = 0; i < 100000; i++) x += (uint64_t)i;
        return 0;
    }
    if (argc >= 2 && !strcmp(argv[1], "run")) return run(argc, argv);
    fprintf(stderr, "usage: churn run [OPTION VALUE]... | churn hold MS | churn spin MS\n");
    return 2;
}
