"""GET a URL as a probe or a scraper does: (HTTP status, body text), never raising for a status."""

from __future__ import annotations

import urllib.error
import urllib.request


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    """(status, text); an error status is returned, not raised, and (0, "") means nothing answered
    (not listening yet, or gone), which a test polls through."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""
