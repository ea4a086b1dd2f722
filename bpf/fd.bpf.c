/* fd.bpf.c: the fd table (fds, holds, procs) and the syscalls that change it besides open:
 * close and the dup family. OPEN on a tgid's first fd on a device, CLOSE on its last.
 *
 * Hot path (every close on the node): the tgid, its touched byte (gg_touch: the periodic rescan
 * rereads a table that released an fd, which is how a device fd received over a socket is found
 * when the count did not change), the holder byte; only a holder pays the fds lookup.
 *
 * close_range(2) is not traced: its range would need a bounded loop of fds lookups per call, and
 * it is mostly used right before exec (where EXEC makes user space rescan anyway). A GPU fd closed
 * by it stays in the table until the next periodic rescan (which always rereads holders), or until
 * its number is reused (then gg_set_fd accounts the implicit close).
 */

/* procs[tgid] += delta (the number of devices the tgid holds). The entry stays at 0 until EXIT:
 * a process that held a device once keeps its ioctl counters until it dies, so user space must
 * hear of its death to read them and forget it (and a reused pid must not inherit them). For the
 * same reason the holder byte is only cleared at EXIT or forget(): clearing it at 0 would race
 * another thread of the process taking a new device. Plain XADD: no fetch needed. */
static __always_inline void gg_procs_add(u32 tgid, s32 delta)
{
    u32 *count = procs.lookup(&tgid);
    if (!count && delta > 0) {
        u32 init = (u32)delta;
        if (procs.insert(&tgid, &init) == 0) {
            gg_set_holder(tgid, 1);
            return;
        }
        count = procs.lookup(&tgid); /* another thread inserted it first */
        if (!count) {
            gg_stat(GG_STAT_PROCS_FULL);
            return;
        }
    }
    if (!count || (delta < 0 && *count == 0))
        return;
    __sync_fetch_and_add(count, (u32)delta);
    if (delta > 0)
        gg_set_holder(tgid, 1);
}

/* One fd of tgid stopped referring to dev_id: update holds and emit CLOSE on the last one. */
static __always_inline void gg_drop_fd(u32 tgid, u32 tid, s32 fd, u32 dev_id)
{
    struct gg_hold_key hk = {.tgid = tgid, .dev_id = dev_id};
    struct gg_hold_val *h = holds.lookup(&hk);
    if (!h || h->nfds == 0)
        return;
    __sync_fetch_and_add(&h->nfds, (u32)-1);
    if (h->nfds != 0)
        return;
    if (h->mapped) {
        /* The mapping still pins the device: keep the hold so EXIT is still seen. */
        gg_emit(GG_EV_CLOSE, tgid, tid, fd, dev_id, 0, GG_FLAG_MAPPED);
        return;
    }
    /* Two threads closing the last two fds at once both read 0: only the delete winner reports. */
    if (holds.delete(&hk) != 0)
        return;
    gg_procs_add(tgid, -1);
    gg_emit(GG_EV_CLOSE, tgid, tid, fd, dev_id, 0, 0);
}

/* fd of tgid now refers to dev_id (0: to something that is not a GPU device). Accounts for a
 * stale entry first: an fd number reused after a close we never saw (close_range, an exec that
 * dropped close-on-exec fds, dup2 onto a GPU fd). */
static __always_inline void gg_set_fd(u32 tgid, u32 tid, s32 fd, u32 dev_id, u32 flags)
{
    struct gg_fd_key fk = {.tgid = tgid, .fd = fd};
    struct gg_fd_val *old = fds.lookup(&fk);
    if (old) {
        u32 old_dev = old->dev_id;
        gg_mem_fd_gone(tgid, tid, fd, old_dev); /* a new file now, even of the same device */
        if (old_dev == dev_id)
            return; /* already counted */
        if (fds.delete(&fk) == 0)
            gg_drop_fd(tgid, tid, fd, old_dev);
    }
    if (dev_id == 0)
        return;
    struct gg_fd_val fv = {.dev_id = dev_id, .flags = flags};
    if (fds.update(&fk, &fv) != 0) {
        gg_stat(GG_STAT_FDS_FULL);
        return;
    }
    struct gg_hold_key hk = {.tgid = tgid, .dev_id = dev_id};
    struct gg_hold_val *h = holds.lookup(&hk);
    if (h) {
        __sync_fetch_and_add(&h->nfds, 1);
        /* nfds 1: re-opened while still mapped, which is an OPEN again */
        gg_emit(h->nfds == 1 ? GG_EV_OPEN : GG_EV_FD, tgid, tid, fd, dev_id, 0, 0);
        return;
    }
    struct gg_hold_val nh = {.nfds = 1, .mapped = 0};
    if (holds.insert(&hk, &nh) != 0) {
        h = holds.lookup(&hk);
        if (h) { /* another thread created it first and reported OPEN */
            __sync_fetch_and_add(&h->nfds, 1);
            gg_emit(GG_EV_FD, tgid, tid, fd, dev_id, 0, 0);
            return;
        }
        gg_stat(GG_STAT_HOLDS_FULL);
        fds.delete(&fk);
        return;
    }
    gg_procs_add(tgid, 1);
    gg_emit(GG_EV_OPEN, tgid, tid, fd, dev_id, 0, 0);
}

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
    if (!gg_take_pending(tid, s->nr, &op))
        return 0;
    if (op.op == GG_OP_OPEN) /* failed opens too: a session records the errno */
        gg_trace_instant(GG_TK_OPEN, (u32)(id >> 32), tid, s->ret >= 0 ? (s32)s->ret : -1, op.dev_id, s->ret,
                         op.oflags, 0, 0);
    if (s->ret < 0)
        return 0;
    u32 flags = op.op == GG_OP_DUP ? GG_FD_DUP : 0;
    gg_set_fd((u32)(id >> 32), tid, (s32)s->ret, op.dev_id, flags);
    return 0;
}

static __always_inline int gg_close(s32 fd)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = (u32)(id >> 32);
    gg_touch(tgid); /* any process: its table changed, the periodic rescan rereads it */
    struct gg_fd_val *fv = gg_gpu_fd(tgid, fd);
    if (!fv)
        return 0;
    u32 dev_id = fv->dev_id;
    struct gg_fd_key fk = {.tgid = tgid, .fd = fd};
    /* Two threads closing the same fd: the kernel closes it once, and only one delete succeeds.
     * Counted at enter: close releases the fd even when it returns an error (EINTR, EIO). */
    if (fds.delete(&fk) != 0)
        return 0;
    gg_mem_fd_gone(tgid, (u32)id, fd, dev_id);
    gg_trace_instant(GG_TK_CLOSE, tgid, (u32)id, fd, dev_id, 0, 0, 0, 0);
    gg_drop_fd(tgid, (u32)id, fd, dev_id);
    return 0;
}

/* Remember what the exit side must do: newfd = -1 for dup/fcntl (the kernel picks the number). */
static __always_inline int gg_dup_enter(s32 oldfd, s32 newfd, s32 nr)
{
    if (newfd == oldfd)
        return 0; /* dup2(fd, fd) changes nothing; dup3(fd, fd) fails with EINVAL */
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = (u32)(id >> 32);
    if (newfd >= 0)
        gg_touch(tgid); /* dup2/dup3 may release what newfd referred to */
    struct gg_fd_val *fv = gg_gpu_fd(tgid, oldfd);
    u32 dev_id = fv ? fv->dev_id : 0;
    if (dev_id == 0) {
        /* dup2(other, gpu_fd) closes gpu_fd implicitly: that matters even though oldfd is not ours */
        if (newfd < 0 || !gg_gpu_fd(tgid, newfd))
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
