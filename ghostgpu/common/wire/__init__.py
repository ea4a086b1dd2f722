"""The wire room: the one mapping of the model to the generated API (ghostgpu.v1), and what the
tracer, the collector and clients agree on besides the generated messages."""
