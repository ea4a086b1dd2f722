"""The ghostgpu collector: ingests node tracers' streams and keeps the cluster-wide picture.

It never imports tracer internals: it shares only ghostgpu.common.model.consumers and the generated API.
"""
