"""The ghostgpu node tracer: sources (bpf, procfs, nvml) -> node state -> classify -> sinks."""
