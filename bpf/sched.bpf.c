/* sched.bpf.c: lifecycle of holders: FORK (a new process, not a thread), EXEC, RENAME, EXIT.
 *
 * "Holder" here is any tgid with a procs entry: FORK and EXEC need a device held now (count > 0);
 * EXIT is reported for every entry, including a process that has released all its devices,
 * because its ioctl counters wait for that EXIT (see gg_procs_add).
 *
 * Every fork, exec and thread exit on the node passes here; a non-holder pays one hash miss in
 * procs (fork/exec/exit are three orders of magnitude rarer than ioctl).
 */

/* task_newtask runs in the parent and carries clone_flags; sched_process_fork has no flags and
 * telling a thread from a process there would need task_struct. So: note here, report there. */
TRACEPOINT_PROBE(task, task_newtask)
{
    if (args->clone_flags & GG_CLONE_THREAD)
        return 0; /* a thread shares the fd table: nothing new to track */
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = (u32)(id >> 32);
    gg_trace_fork(tgid, (u32)id, (u32)args->pid);
    u32 *held = procs.lookup(&tgid);
    if (!held || *held == 0) /* 0: held devices once, holds none now (kept for EXIT) */
        return 0;
    u32 child = (u32)args->pid;
    if (forking.update(&child, &tgid) != 0)
        gg_stat(GG_STAT_FORKING_FULL);
    return 0;
}

/* Emitting here rather than at task_newtask means a clone that fails after task_newtask (e.g. on
 * a cgroup pids limit) reports nothing; its forking entry is overwritten when the pid is reused. */
TRACEPOINT_PROBE(sched, sched_process_fork)
{
    u32 child = (u32)args->child_pid;
    u32 *parent = forking.lookup(&child);
    if (!parent)
        return 0;
    u32 parent_tgid = *parent;
    forking.delete(&child);
    u64 id = bpf_get_current_pid_tgid();
    if (parent_tgid != (u32)(id >> 32))
        return 0; /* stale entry from a clone that failed, the pid since reused by someone else */
    /* Mark the child a holder at once so its exit is seen even before user space seeds its fd
     * table; the count is the parent's until seed() sets the child's own. */
    u32 *count = procs.lookup(&parent_tgid);
    u32 inherited = count ? *count : 1;
    if (procs.update(&child, &inherited) != 0)
        gg_stat(GG_STAT_PROCS_FULL);
    else
        gg_set_holder(child, 1);
    gg_alloc_fork(parent_tgid, child);
    gg_emit(GG_EV_FORK, parent_tgid, (u32)id, -1, 0, child, 0);
    return 0;
}

/* Close-on-exec fds vanish without close() and the old mappings with the old mm, so the tgid's
 * fds entries are stale: the new image's loader reuses fd 3 for libc and would "mmap" and
 * "close" the GPU device. Clearing the holder byte mutes them; user space drops the tgid's fd
 * and hold entries, rereads /proc/<tgid>/fd and reseeds (HolderTables.reset_fds + seed), which
 * sets it again. The procs entry stays: an exit at any moment from here on is still reported
 * (deleting it here or in user space left a window in which an exit was reported by nobody).
 * Until the reseed a new GPU open by the new image is tracked but may not report OPEN (its
 * hold entry is stale too). */
TRACEPOINT_PROBE(sched, sched_process_exec)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = (u32)(id >> 32);
    gg_trace_exec(tgid, (u32)id);
    u32 *held = procs.lookup(&tgid);
    if (!held || *held == 0)
        return 0;
    gg_set_holder(tgid, 0);
    gg_emit(GG_EV_EXEC, tgid, (u32)id, -1, 0, 0, 0);
    return 0;
}

/* A holder's name changes without an exec, too: busybox exec's its applets through
 * /proc/self/exe (comm "exe") and then names itself with prctl(PR_SET_NAME), and so do runtimes
 * and worker pools. Only the leader's name is the process's (/proc/PID/stat); a thread naming
 * itself (pthread_setname_np) is not reported. The exec's own rename (begin_new_exec) fires here
 * too, just before sched_process_exec: one extra identity read per holder exec. A rename only
 * ever comes from the task's own thread group (proc_pid_set_comm checks same_thread_group), so
 * the current tgid is the renamed process. */
TRACEPOINT_PROBE(task, task_rename)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = (u32)(id >> 32);
    if ((u32)args->pid != tgid)
        return 0;
    u32 *held = procs.lookup(&tgid);
    if (!held || *held == 0)
        return 0;
    gg_emit(GG_EV_RENAME, tgid, (u32)id, -1, 0, 0, 0);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = (u32)(id >> 32);
    /* A pending entry left by this thread (its exit program was not attached yet when the tracer
     * started mid-syscall) would keep pending_count above 0 and every open exit on the slow road:
     * a dying thread drops it. One inlined byte load for threads that left nothing. */
    struct gg_pending stale = {};
    gg_take_pending((u32)id, -1, &stale);
    gg_mem_thread_gone((u32)id); /* likewise a memory call it left in flight (mem_inflight) */
#ifdef GG_HAVE_GROUP_DEAD
    /* group_dead is true for the last thread of the group to exit. Older kernels' format lacks
     * the field (the Debian 6.1 headers used to build here predate it); 6.18 has it. */
    if (!args->group_dead)
        return 0;
    gg_trace_gone(tgid, (u32)id);
    if (!procs.lookup(&tgid))
        return 0;
    /* fds/holds/ioctls stay until user space has read the final counts (BpfSource.forget). */
    procs.delete(&tgid);
    gg_set_holder(tgid, 0);
    gg_emit(GG_EV_EXIT, tgid, (u32)id, -1, 0, 0, 0);
#else
    /* Older kernels: no group_dead and no way to count live threads without task_struct. The
     * leader's exit is reported with LEADER_ONLY; BpfSource holds it back until /proc/<tgid>/stat
     * shows no live thread left (a zombie leader counts itself until the last thread is gone). */
    if ((u32)id != tgid)
        return 0;
    gg_trace_gone(tgid, (u32)id);
    if (!procs.lookup(&tgid))
        return 0;
    gg_emit(GG_EV_EXIT, tgid, (u32)id, -1, 0, 0, GG_FLAG_LEADER_ONLY);
#endif
    return 0;
}
