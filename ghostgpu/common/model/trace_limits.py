"""A trace session's default limits, the same on both sides: the longest one a tracer runs
(tracer/config.py) and a collector lets a client start, and the records kept per session
(collector/config.py). Alone in a module of constants: both configs read them when any command
builds its parser, which must not import the trace model's dataclasses."""

TRACE_MAX_DURATION_S = 600.0
TRACE_MAX_RECORDS = 100_000
