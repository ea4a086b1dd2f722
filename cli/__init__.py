"""The command layer (`ghostgpu.cli`): the `ghostgpu` command, its parser in main.py, one module per
command family. It sits on top of the house: it may import the tracer, the collector and the shared
floor, and nothing imports it."""
