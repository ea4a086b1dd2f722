"""The ghostgpu collector: ingests node tracers' streams and keeps the cluster-wide picture.

It never imports the tracer: what the two share is the floor below them, ghostgpu.common and the
generated API (ARCHITECTURE.md; tests/unit/test_layering.py checks it).
"""
