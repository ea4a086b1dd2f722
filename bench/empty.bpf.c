/* empty.bpf.c: the ghostgpu tracepoint set with programs that do nothing, for
 * bench/bench_syscall_cost.py: the cost of merely having BPF on these tracepoints (syscall
 * tracepoint slow path, perf trace buffer, program dispatch), against which the work done by the
 * ghostgpu programs is measured. Keep the set in step with bpf/open.bpf.c, fd.bpf.c, ioctl.bpf.c,
 * sched.bpf.c and printk.bpf.c, including their GG_HAVE_* guards (trace.bpf.c's own hooks, the mmap exit and
 * munmap, are attached only while a trace session runs; the ioctl exit in ioctl.bpf.c is always
 * attached; alloc.bpf.c has none). */

TRACEPOINT_PROBE(syscalls, sys_enter_openat) { return 0; }
TRACEPOINT_PROBE(syscalls, sys_exit_openat) { return 0; }
#ifdef GG_HAVE_SYS_OPENAT2
TRACEPOINT_PROBE(syscalls, sys_enter_openat2) { return 0; }
TRACEPOINT_PROBE(syscalls, sys_exit_openat2) { return 0; }
#endif
#ifdef GG_HAVE_SYS_OPEN
TRACEPOINT_PROBE(syscalls, sys_enter_open) { return 0; }
TRACEPOINT_PROBE(syscalls, sys_exit_open) { return 0; }
#endif
TRACEPOINT_PROBE(syscalls, sys_enter_close) { return 0; }
TRACEPOINT_PROBE(syscalls, sys_enter_dup) { return 0; }
TRACEPOINT_PROBE(syscalls, sys_exit_dup) { return 0; }
#ifdef GG_HAVE_SYS_DUP2
TRACEPOINT_PROBE(syscalls, sys_enter_dup2) { return 0; }
TRACEPOINT_PROBE(syscalls, sys_exit_dup2) { return 0; }
#endif
TRACEPOINT_PROBE(syscalls, sys_enter_dup3) { return 0; }
TRACEPOINT_PROBE(syscalls, sys_exit_dup3) { return 0; }
TRACEPOINT_PROBE(syscalls, sys_enter_fcntl) { return 0; }
TRACEPOINT_PROBE(syscalls, sys_exit_fcntl) { return 0; }
TRACEPOINT_PROBE(syscalls, sys_enter_ioctl) { return 0; }
TRACEPOINT_PROBE(syscalls, sys_exit_ioctl) { return 0; }
TRACEPOINT_PROBE(syscalls, sys_enter_mmap) { return 0; }
TRACEPOINT_PROBE(task, task_newtask) { return 0; }
TRACEPOINT_PROBE(task, task_rename) { return 0; }
TRACEPOINT_PROBE(sched, sched_process_fork) { return 0; }
TRACEPOINT_PROBE(sched, sched_process_exec) { return 0; }
TRACEPOINT_PROBE(sched, sched_process_exit) { return 0; }
TRACEPOINT_PROBE(printk, console) { return 0; }
