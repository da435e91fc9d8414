"""Checks on a JSON request body that every front end (servers and router) applies at the edge.

Python's JSON reader accepts what cannot travel on: lone UTF-16 surrogates (``"\\ud800"``, not
valid Unicode, so not UTF-8), numbers too large for a float (read as infinity) and integers that
fit no 64-bit type (msgpack, the servers' wire to their schedulers, carries
[-2^63, 2^64)). ``problem`` names the first such value by its path, so the client gets a 400
that says which field to fix. The meaning of each field is checked by its API, not here.
"""

from __future__ import annotations

import math
from typing import Any, Optional

INT_MIN, INT_LIMIT = -(2**63), 2**64


def problem(body: Any) -> Optional[str]:
    """Why ``body`` (as Python's ``json.loads`` returns it) cannot be passed on, or None.

    Iterative, so a body as deep as the reader allows cannot exhaust the stack here."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                if not _is_unicode(key):
                    return (
                        f"{path or 'body'}: a key holds a lone UTF-16 surrogate, "
                        "which is not valid Unicode"
                    )
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
        elif isinstance(value, str) and not _is_unicode(value):
            return f"{path or 'body'}: holds a lone UTF-16 surrogate, which is not valid Unicode"
        elif isinstance(value, float) and not math.isfinite(value):
            return f"{path or 'body'}: number out of range"
        elif (
            isinstance(value, int)
            and not isinstance(value, bool)
            and not INT_MIN <= value < INT_LIMIT
        ):
            return f"{path or 'body'}: integer out of the 64-bit range"
    return None


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
