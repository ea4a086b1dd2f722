"""The one YAML loader of the project's config files (the policy, the web config): small, flat
documents that never need YAML's sharing features, read so that a hostile file costs nothing.

    text = read_capped(path)          # OSError, UnicodeDecodeError, YamlRefused (not a file, past 64 KiB)
    doc = load(text)                  # yaml.YAMLError (syntax), or YamlRefused (one line, with the line)

Refused, each as a YamlRefused whose text is one line starting `line L column C: ` and naming what
was refused:
- anchors (`&a`) and aliases (`*a`): a few hundred bytes of nested aliases expand to gigabytes
  (the "billion laughs"); neither file needs them;
- merge keys (`<<:`), which exist to merge aliased mappings;
- a key given twice in one mapping (`role: viewer` then `role: admin`): PyYAML keeps the last one
  silently, so the file would not mean what its first reader sees;
- nesting deeper than MAX_DEPTH (the composer recurses per level).
read_capped reads at most MAX_CONFIG_BYTES (64 KiB; the files are a few KiB at most), of a regular file only:
it never blocks (a FIFO without a writer would stall the collector's event loop at a policy reload).

Everything else is yaml.SafeLoader's (no Python object tags). Pure Python, not libyaml's CSafeLoader:
the checks hook the composer and constructor, which libyaml's loader does in C.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Hashable
from typing import Any, Protocol

import yaml
from yaml.events import Event
from yaml.nodes import MappingNode, Node

MAX_CONFIG_BYTES = 64 * 1024
MAX_DEPTH = 32
_KEY_SHOWN = 60  # characters of a duplicate key said in the error
_MERGE_TAG = "tag:yaml.org,2002:merge"
_HELP = "this file takes no anchors, aliases or merge keys; write the value out where it is used"


class Mark(Protocol):
    """Where in the file: PyYAML's pure and libyaml marks both have it (0-based)."""

    line: int
    column: int


class YamlRefused(ValueError):
    """One line: `line L column C: what was refused` (or the file's size, from read_capped)."""

    def __init__(self, why: str, mark: Mark | None = None) -> None:
        at = f"line {mark.line + 1} column {mark.column + 1}: " if mark is not None else ""
        super().__init__(at + why)
        self.line = mark.line + 1 if mark is not None else 0


def _clip(text: str) -> str:
    return text if len(text) <= _KEY_SHOWN else text[:_KEY_SHOWN - 3] + "..."


def _shown(value: object) -> str:
    return _clip(repr(value))


class StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader without anchors, aliases, merge keys and duplicate keys, nesting capped."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:  # index: an int or the key's node
        event: Event = self.peek_event()
        anchor: str | None = getattr(event, "anchor", None)
        if isinstance(event, yaml.AliasEvent):
            raise YamlRefused(f"alias *{_clip(str(anchor))} refused; {_HELP}", event.start_mark)
        if anchor is not None:
            raise YamlRefused(f"anchor &{_clip(anchor)} refused; {_HELP}", event.start_mark)
        if self._depth >= MAX_DEPTH:
            raise YamlRefused(f"nested more than {MAX_DEPTH} levels deep; this file is flat",
                              event.start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        if isinstance(node, MappingNode):  # SafeConstructor refuses anything else, in its own words
            first: dict[Hashable, Mark] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:
                    raise YamlRefused(f"merge key << refused; {_HELP}", key_node.start_mark)
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = first.get(key)
                except TypeError:  # an unhashable key: SafeConstructor says so below
                    continue
                if seen is not None:
                    raise YamlRefused(f"duplicate key {_shown(key)} (first at line {seen.line + 1}); "
                                      "a key may appear once in a mapping: keep the one you mean",
                                      key_node.start_mark)
                first[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)



def load(text: str) -> Any:
    """The document in `text`; yaml.YAMLError for a syntax error, YamlRefused for what is refused."""
    loader = StrictLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_capped(path: str, max_bytes: int = MAX_CONFIG_BYTES) -> str:
    """The file's text, read as UTF-8; YamlRefused (one line) when it is not a regular file or holds
    more than `max_bytes`. Never blocks: the policy is re-read on the collector's event loop, and
    opening a FIFO without a writer would wait forever, so it is opened non-blocking and anything
    but a regular file (a FIFO, a device such as /dev/zero, a directory) is refused before a read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise YamlRefused(f"not a regular file ({_file_kind(mode)}); point it at the YAML file itself")
        chunks, left = [], max_bytes + 1
        while left > 0 and (chunk := os.read(fd, left)):
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise YamlRefused(f"larger than {max_bytes // 1024} KiB; a config file this big is refused "
                          "(they are a few KiB): check that it is the right file")
    return data.decode("utf-8")


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a file")
