"""The system room: what a long-running process needs of the OS and its files (fd limits, private
file modes, a loop thread, the safe YAML loader, the TOML config reader, a config's fields as flags,
has a file changed)."""
