/* ioctl.bpf.c: count ioctls on GPU fds (no event) and notice the first mapping of a device; hand
 * both to a trace session when one covers the caller (trace.bpf.c), and the allocation and memory
 * calls to the always-on captures (alloc.bpf.c), whose exit half is here too.
 *
 * Hot path: ioctl and mmap are among the busiest syscalls of a node (terminals, sockets, malloc's
 * large blocks). A process that holds no GPU device pays one inlined array load and a byte test
 * (gg_maybe_holder); only a holder pays the fds hash lookup. The ioctl exit is always attached
 * (one program serves the memory calls and trace sessions): with no memory call in flight on the
 * node and no session, it returns after two inlined array loads; else a thread whose entry left
 * nothing returns after one more array load and a byte test (gg_take_call).
 */

TRACEPOINT_PROBE(syscalls, sys_enter_ioctl)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = (u32)(id >> 32);
    s32 fd = (s32)args->fd;
    if (!gg_maybe_holder(tgid)) /* gg_gpu_fd's filter, spelled out: the trace path below needs it too */
        return 0;
    struct gg_fd_key fk = {.tgid = tgid, .fd = fd};
    struct gg_fd_val *fv = fds.lookup(&fk);
    bool inherited = false; /* a traced fork child's fd, not seeded yet: no counter of its own */
    if (!fv) {
        fv = gg_trace_inherited_fd(tgid, fd);
        if (!fv)
            return 0;
        inherited = true;
    }
    u32 dev_id = fv->dev_id;
    /* One call site each: every inlined copy is compiled by bcc at each tracer start. */
    gg_trace_ioctl_enter(tgid, (u32)id, fd, dev_id, (u32)args->cmd, (u64)args->arg);
    /* After the GPU-fd check, so a non-GPU call pays nothing for it. */
    gg_alloc_ioctl(tgid, (u32)id, fd, dev_id, (u32)args->cmd, (u64)args->arg);
    if (inherited)
        return 0;
    /* The request word is 32 bits in the ioctl ABI; the tracepoint widens it to 64. */
    struct gg_ioctl_key ik = {.tgid = tgid, .fd = fd, .dev_id = dev_id, .cmd = (u32)args->cmd};
    u64 *count = ioctls.lookup(&ik);
    if (count) {
        __sync_fetch_and_add(count, 1);
        return 0;
    }
    u64 one = 1;
    if (ioctls.insert(&ik, &one) != 0) {
        count = ioctls.lookup(&ik); /* another thread inserted it first and reported the key */
        if (count)
            __sync_fetch_and_add(count, 1);
        else
            gg_stat(GG_STAT_IOCTLS_FULL);
        return 0;
    }
    /* Once per (tgid, fd, device, request): a CUDA process has a few dozen. */
    gg_emit(GG_EV_IOCTL_KEY, tgid, (u32)id, fd, ik.dev_id, ik.cmd, 0);
    return 0;
}

/* Every ioctl of the node passes here. Nearly always no thread has a memory call in flight and no
 * trace session runs: two inlined array loads and out. Otherwise the thread's pending byte says
 * whether its own entry left a memory call (alloc.bpf.c) or a traced call (trace.bpf.c). */
TRACEPOINT_PROBE(syscalls, sys_exit_ioctl)
{
#ifndef GG_NO_HOLDER_FILTER
    if (!gg_mem_any_inflight() && !gg_trace_any())
        return 0;
#endif
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    u32 work = gg_take_call(tid);
    if (!work)
        return 0;
    if (work & (GG_PB_MEM | GG_PB_MAYBE))
        gg_mem_exit((u32)(id >> 32), tid, args->ret, (work & GG_PB_MEM) != 0);
    if (work & (GG_PB_TRACE | GG_PB_MAYBE))
        gg_trace_exit(GG_TK_IOCTL, args->ret);
    return 0;
}

/* Counted at enter, so a failing mmap of a GPU fd still reports MMAP; the /proc scan's UNMAP
 * corrects it. Doing it at exit would add a pending round trip to every file mmap on the node. */
TRACEPOINT_PROBE(syscalls, sys_enter_mmap)
{
    /* MAP_ANONYMOUS ignores fd (callers pass -1, some pass 0): reject before any map access. */
    s32 fd = (s32)args->fd;
    if (fd < 0 || (args->flags & GG_MAP_ANONYMOUS))
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = (u32)(id >> 32);
    struct gg_fd_val *fv = gg_gpu_fd(tgid, fd);
    if (!fv)
        return 0;
    u32 dev_id = fv->dev_id;
    gg_trace_mmap_enter(tgid, (u32)id, fd, dev_id, (u64)args->len, (u64)args->prot, (u64)args->flags,
                        (u64)args->off);
    struct gg_hold_key hk = {.tgid = tgid, .dev_id = dev_id};
    struct gg_hold_val *h = holds.lookup(&hk);
    if (!h || h->mapped)
        return 0;
    /* Plain store: two threads mapping at once may both report MMAP, which is harmless. */
    h->mapped = 1;
    gg_emit(GG_EV_MMAP, tgid, (u32)id, fd, dev_id, 0, 0);
    return 0;
}
