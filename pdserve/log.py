"""Logging tagged with role and rank (``prefill-tp0``, ``decode-tp0``, ``router``)."""

from __future__ import annotations

import logging
import os

_FORMAT = "%(asctime)s %(levelname)s [%(tag)s] %(name)s: %(message)s"


class _TagFilter(logging.Filter):
    def __init__(self, tag: str):
        super().__init__()
        self.tag = tag

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "tag"):
            record.tag = self.tag
        return True


def setup_logging(tag: str, level: str = "info") -> None:
    """Configure the root logger of this process so that every line carries ``tag``."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_FORMAT))
    handler.addFilter(_TagFilter(tag))
    root.addHandler(handler)
    root.setLevel(level.upper())
    os.environ["PDSERVE_LOG_TAG"] = tag


def role_tag(role: str, rank: int = 0) -> str:
    return "router" if role == "router" else f"{role}-tp{rank}"


def retag(tag: str) -> None:
    """Change the tag of this process's lines (a server that switched its role)."""
    for handler in logging.getLogger().handlers:
        for f in handler.filters:
            if isinstance(f, _TagFilter):
                f.tag = tag
    os.environ["PDSERVE_LOG_TAG"] = tag
