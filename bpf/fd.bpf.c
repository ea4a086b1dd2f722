/* fd.bpf.c: close and the dup family keep the fds table true; CLOSE on a tgid's last fd.
 *
 * close_range(2) is not traced: its range would need a bounded loop of fds lookups per call, and
 * it is mostly used right before exec (where EXEC makes user space rescan anyway). A GPU fd closed
 * by it stays in the table until the /proc scan reconciles, or until its number is reused (then
 * gg_set_fd accounts the implicit close).
 */

/* The exit side's slow path (see gg_fd_exit): settle what this thread's enter left in pending. */
int gg_settle(void *ctx)
{
    u32 zero = 0;
    struct gg_scratch *s = scratch.lookup(&zero);
    if (!s)
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    struct gg_pending op = {};
    if (!gg_take_pending(tid, s->nr, &op) || s->ret < 0)
        return 0;
    u32 flags = op.op == GG_OP_DUP ? GG_FD_DUP : 0;
    gg_set_fd((u32)(id >> 32), tid, (s32)s->ret, op.dev_id, flags);
    return 0;
}

static __always_inline int gg_close(s32 fd)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = (u32)(id >> 32);
    if (!gg_maybe_holder(tgid))
        return 0;
    struct gg_fd_key fk = {.tgid = tgid, .fd = fd};
    struct gg_fd_val *fv = fds.lookup(&fk);
    if (!fv)
        return 0;
    u32 dev_id = fv->dev_id;
    /* Two threads closing the same fd: the kernel closes it once, and only one delete succeeds.
     * Counted at enter: close releases the fd even when it returns an error (EINTR, EIO). */
    if (fds.delete(&fk) != 0)
        return 0;
    gg_drop_fd(tgid, (u32)id, fd, dev_id);
    return 0;
}

/* Remember what the exit side must do: newfd = -1 for dup/fcntl (the kernel picks the number). */
static __always_inline int gg_dup_enter(s32 oldfd, s32 newfd, s32 nr)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = (u32)(id >> 32);
    if (!gg_maybe_holder(tgid))
        return 0;
    struct gg_fd_key fk = {.tgid = tgid, .fd = oldfd};
    struct gg_fd_val *fv = fds.lookup(&fk);
    u32 dev_id = fv ? fv->dev_id : 0;
    if (dev_id == 0) {
        /* dup2(other, gpu_fd) closes gpu_fd implicitly: that matters even though oldfd is not ours */
        if (newfd < 0 || newfd == oldfd)
            return 0;
        fk.fd = newfd;
        if (!fds.lookup(&fk))
            return 0;
    }
    struct gg_pending p = {.dev_id = dev_id, .fd = newfd, .op = GG_OP_DUP, .nr = nr};
    gg_set_pending((u32)id, &p);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_close)
{
    return gg_close((s32)args->fd);
}

TRACEPOINT_PROBE(syscalls, sys_enter_dup)
{
    return gg_dup_enter((s32)args->fildes, -1, args->__syscall_nr);
}

TRACEPOINT_PROBE(syscalls, sys_exit_dup)
{
    return gg_fd_exit(args, args->ret, args->__syscall_nr);
}

#ifdef GG_HAVE_SYS_DUP2 /* x86_64 has dup2; arm64 only dup3 */
TRACEPOINT_PROBE(syscalls, sys_enter_dup2)
{
    return gg_dup_enter((s32)args->oldfd, (s32)args->newfd, args->__syscall_nr);
}

TRACEPOINT_PROBE(syscalls, sys_exit_dup2)
{
    return gg_fd_exit(args, args->ret, args->__syscall_nr);
}
#endif

TRACEPOINT_PROBE(syscalls, sys_enter_dup3)
{
    return gg_dup_enter((s32)args->oldfd, (s32)args->newfd, args->__syscall_nr);
}

TRACEPOINT_PROBE(syscalls, sys_exit_dup3)
{
    return gg_fd_exit(args, args->ret, args->__syscall_nr);
}

TRACEPOINT_PROBE(syscalls, sys_enter_fcntl)
{
    /* fcntl is hot (F_GETFL, F_SETFD, locks): test the command before anything else. */
    u32 cmd = (u32)args->cmd;
    if (cmd != GG_F_DUPFD && cmd != GG_F_DUPFD_CLOEXEC)
        return 0;
    return gg_dup_enter((s32)args->fd, -1, args->__syscall_nr);
}

TRACEPOINT_PROBE(syscalls, sys_exit_fcntl)
{
    return gg_fd_exit(args, args->ret, args->__syscall_nr);
}
