"""Names that come from outside (a Hello's node, a flag) checked before anything stores or says
them, and text from outside cut down to one bounded line before it is logged or audited.

    node_name_problem("gpu-node-1")   # None: a Kubernetes node name
    node_name_problem("x" * 300)      # "... longer than 253 characters ..."
    one_line(str(error), 240)         # newlines folded, cut with "..."
"""

from __future__ import annotations

import re

NODE_NAME_MAX = 253
# Kubernetes names nodes with DNS-1123 subdomains (k8s.io/apimachinery validation.IsDNS1123Subdomain):
# lowercase alphanumeric labels of '-' inside, joined by '.'; 253 characters at most.
_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = re.compile(rf"{_LABEL}(\.{_LABEL})*")
_SHOWN = 40  # characters of a refused name said back


def shown(text: str, limit: int = _SHOWN) -> str:
    """repr(text), cut to about `limit` characters with its length said when cut."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def node_name_problem(name: str) -> str | None:
    """None for a valid node name (a DNS-1123 subdomain of at most 253 characters); else why not,
    one short line that shows at most the first 40 characters of the name."""
    if not name:
        return "the node name is empty"
    if len(name) > NODE_NAME_MAX:
        return f"node name {shown(name)} is longer than {NODE_NAME_MAX} characters"
    if not _DNS1123_SUBDOMAIN.fullmatch(name):
        return (f"node name {shown(name)} is not a DNS-1123 subdomain (lowercase letters, digits, '-' "
                "and '.', starting and ending with a letter or digit), as Kubernetes names nodes")
    return None


def one_line(text: str, limit: int) -> str:
    """`text` on one line (runs of whitespace, newlines included, become one space), at most `limit`
    characters: cut with "..." at the end."""
    line = " ".join(text[:limit * 4 + 4].split())  # a huge text is never split whole
    return line if len(line) <= limit else line[:max(limit - 3, 0)] + "..."
