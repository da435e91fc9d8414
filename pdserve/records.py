"""Facts about a checkpoint that are slow to work out and depend only on its small files (every
file but the weights) and transformers' version: recorded once under the cache directory, one
file per fact kind and key, and read back by later processes.

A record is best effort both ways: a cache that cannot be written costs the next process the slow
path, and a key of "" (not a readable local directory, or arguments that are not plain values)
means "do not record"."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# what a checkpoint's configuration and tokenizer can depend on: every file but the weights
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")


def key(path: str, arguments: dict[str, Any] | None = None) -> str:
    """A digest of the directory's small files, transformers' version and ``arguments``."""
    arguments = arguments or {}
    if not os.path.isdir(path) or not all(
        isinstance(v, (str, int, float, bool, type(None))) for v in arguments.values()
    ):
        return ""
    from importlib.metadata import version

    h = hashlib.sha256()
    h.update(f"transformers {version('transformers')}\n{sorted(arguments.items())!r}\n".encode())
    try:
        for f in sorted(Path(path).iterdir()):
            if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES):
                h.update(f"{f.name}\n".encode())
                h.update(hashlib.sha256(f.read_bytes()).digest())
    except OSError:
        return ""
    return h.hexdigest()[:32]


def record_path(kind: str, digest: str) -> Path:
    from pdserve.envs import cache_dir

    return Path(cache_dir()) / kind / digest


def read(kind: str, digest: str) -> str:
    """The record's text, or "" when there is none (or no key)."""
    if not digest:
        return ""
    try:
        return record_path(kind, digest).read_text()
    except OSError:
        return ""


def write(kind: str, digest: str, text: str) -> None:
    """Atomically, so a reader never sees half a record; an error is logged at debug level."""
    if not digest:
        return
    record = record_path(kind, digest)
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        tmp = record.with_name(f"{record.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, record)
    except OSError as e:
        logger.debug("cannot write the record %s: %s", record, e)
