"""The web room: the small HTTP server for /metrics and probes, and the exporter-toolkit web config
that guards it."""
