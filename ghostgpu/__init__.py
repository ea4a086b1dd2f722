"""ghostgpu: find every process that holds a GPU device file, and say why NVML does or does not list it."""

__version__ = "0.1.0"
