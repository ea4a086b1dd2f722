"""The audit room: the audit trail's records and their hash chain, shared by the collector (which
writes it) and `ghostgpu audit` (which checks it)."""
