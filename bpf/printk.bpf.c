/* printk.bpf.c: the kernel log lines that report an Xid, read where printk stores them.
 *
 * Why here and not only /dev/kmsg: a pod's unprivileged container has no /dev/kmsg (the device
 * cgroup refuses it) and reading it needs CAP_SYSLOG; the printk:console tracepoint needs only
 * what the other programs need. trace_console() is called by printk_sprint(), which vprintk_store()
 * calls for every record it stores, continuation or new (kernel/printk/printk.c, Linux 5.15 to
 * 6.x), whether or not a console prints it: each stored line passes here once, before the
 * ring buffer of /dev/kmsg has it.
 *
 * Cost: every printk on the node runs the tracepoint program, which reads 9 bytes and compares;
 * printk is no hot path (it takes the console and log locks itself). Only "NVRM: Xid" lines go
 * on to the ring buffer.
 *
 * Origin: the tracepoint's record holds only the text, not the facility that tells a line user
 * space wrote to /dev/kmsg (devkmsg_write forces LOG_USER, kernel/printk/printk.c). It fires in
 * the writer's context, though: a line stored while the current task is inside a syscall that can
 * reach devkmsg_write (write and its vector, positioned, splice, AIO and io_uring_enter forms,
 * native and compat numbers) is taken as user-written. The driver prints its Xid reports from its
 * ioctl paths and its own threads, never inside a write. An interrupt that prints an Xid during
 * such a syscall is called user too (the safe side). Not told apart: a write that io_uring hands
 * to one of its worker threads (io-wq: zeroed pt_regs, like a kernel thread's) reads as the
 * kernel's; only root can write /dev/kmsg at all. Needs bpf_task_pt_regs (Linux 5.15), kernel BTF
 * and the syscall number in pt_regs (x86_64: orig_ax); without them (GG_KMSG_ORIGIN unset) every
 * line reads as the kernel's and the tracer says so once. No kprobe or fentry on devkmsg_write: a
 * kernel without CONFIG_KPROBES, or one that refuses tracing programs, would lose the source. */

#define GG_LOG_TEXT 248

struct gg_log_line {
    u64 ts_ns;    /* CLOCK_BOOTTIME when stored, as every ghostgpu record */
    u32 len;      /* bytes of text, its NUL included (bpf_probe_read_kernel_str) */
    u32 user;     /* 1: written through /dev/kmsg by user space (gg_log_user) */
    char text[GG_LOG_TEXT];
};

BPF_RINGBUF_OUTPUT(log_lines, 4);             /* 16 KiB: 64 lines; Xid lines come a few at a time */

#ifdef GG_KMSG_ORIGIN
#define GG_X32_SYSCALL_BIT 0x40000000ull /* arch/x86/include/uapi/asm/unistd.h */
/* pt_regs.orig_ax, the syscall number: ORIG_RAX in arch/x86/include/uapi/asm/ptrace-abi.h, a
 * user ABI (ptrace), so no kernel header is compiled for it (linux/sched.h costs every start). */
#define GG_PT_REGS_ORIG_AX 120

/* Syscalls whose path can call a file's write_iter: arch/x86/entry/syscalls/syscall_64.tbl and
 * syscall_32.tbl (write, pwrite64, writev, sendfile[64], io_submit, splice, vmsplice, pwritev,
 * copy_file_range, pwritev2, io_uring_enter), x32's own numbers for the vector forms included. */
static __always_inline bool gg_write_syscall(u64 nr)
{
    nr &= ~GG_X32_SYSCALL_BIT;
    switch (nr) {
    case 1: case 18: case 20: case 40: case 209: case 275: case 278: case 296: case 326: case 328:
    case 426:                                                      /* x86_64 */
    case 4: case 146: case 181: case 187: case 239: case 248: case 313: case 316: case 334:
    case 377: case 379:                                            /* i386 (compat) */
    case 516: case 532: case 535: case 544: case 547:              /* x32 */
        return true;
    }
    return false;
}

/* 1 when the line was written by user space through /dev/kmsg (see Origin above). A kernel
 * thread's pt_regs are zeroed (copy_thread): number 0, not a write. */
static __always_inline u32 gg_log_user(void)
{
    void *regs = (void *)bpf_task_pt_regs(bpf_get_current_task_btf());
    u64 nr = 0;
    if (bpf_probe_read_kernel(&nr, sizeof(nr), regs + GG_PT_REGS_ORIG_AX) != 0)
        return 1; /* unreadable: the safe side */
    return gg_write_syscall(nr) ? 1 : 0;
}
#else
static __always_inline u32 gg_log_user(void) { return 0; }
#endif

TRACEPOINT_PROBE(printk, console)
{
    /* __data_loc: the low 16 bits are the text's offset in this record, the high 16 its length. */
    u16 off = args->data_loc_msg & 0xFFFF;
    char head[9] = {};
    if (bpf_probe_read_kernel(head, sizeof(head), (void *)args + off) != 0)
        return 0;
    if (head[0] != 'N' || head[1] != 'V' || head[2] != 'R' || head[3] != 'M' || head[4] != ':' ||
        head[5] != ' ' || head[6] != 'X' || head[7] != 'i' || head[8] != 'd')
        return 0; /* "NVRM: Xid": how krcReportXid starts every report (tracer/xid.py) */
    struct gg_log_line *l = log_lines.ringbuf_reserve(sizeof(*l));
    if (!l) {
        gg_stat(GG_STAT_RINGBUF_DROPS);
        return 0;
    }
    l->ts_ns = bpf_ktime_get_boot_ns();
    l->user = gg_log_user();
    int n = bpf_probe_read_kernel_str(l->text, sizeof(l->text), (void *)args + off);
    l->len = n > 0 ? n : 0;
    log_lines.ringbuf_submit(l, 0);
    return 0;
}
