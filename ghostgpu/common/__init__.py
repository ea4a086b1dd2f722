"""The shared floor (ARCHITECTURE.md): what the tracer, the collector and the commands all speak.

The model (a node's Consumer, the cluster's ClusterConsumer), the typed records the tracer emits,
the one mapping of both to the generated API, every class rule, the protocol's constants, address
parsing, display helpers and the small HTTP server. It imports only the generated code below it.
"""
