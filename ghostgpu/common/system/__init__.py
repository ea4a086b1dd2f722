"""The system room: what a long-running process needs of the OS and its files (fd limits, private
file modes, a loop thread, the safe YAML loader)."""
