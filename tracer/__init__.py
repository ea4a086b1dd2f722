"""The ghostgpu node tracer: sources (bpf, procfs, nvml) -> the holder table -> classify -> sinks."""
