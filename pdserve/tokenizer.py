"""A checkpoint's tokenizer, as transformers' ``AutoTokenizer`` loads it, without paying each time
for what ``AutoTokenizer`` imports to choose the class.

``AutoTokenizer`` decides from ``tokenizer_config.json`` and the model's configuration, which it
reads through the model's configuration class. In transformers 5 that import pulls torch, the
model-loading modules and ``torch.distributed.tensor`` (about 2 CPU seconds per process; the
HTTP front end and the router need none of it). What it decides depends only on the
checkpoint's small files and transformers' version, so the class it picked is recorded under
the cache directory, keyed by the bytes of those files, the version and the arguments. When the
record says the generic ``TokenizersBackend`` (what a tokenizer saved by transformers 5 names),
later loads build that class directly; any other choice, a hub id or an unreadable directory
goes through ``AutoTokenizer`` every time."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

GENERIC = "TokenizersBackend"
# what AutoTokenizer's choice can depend on: every file but the weights
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")


def load_tokenizer(path: str, **kwargs: Any):
    """``AutoTokenizer.from_pretrained(path, **kwargs)``, or the class it chose for these files
    before (see the module docstring)."""
    from transformers import TokenizersBackend

    key = _key(path, kwargs)
    record = _records() / key if key else None
    if record is not None and _read(record) == GENERIC:
        return TokenizersBackend.from_pretrained(path, **kwargs)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    if record is not None:
        cls = type(tokenizer)
        _write(record, GENERIC if cls is TokenizersBackend else f"{cls.__module__}.{cls.__name__}")
    return tokenizer


def _records() -> Path:
    from pdserve.envs import cache_dir

    return Path(cache_dir()) / "tokenizer-classes"


def _key(path: str, kwargs: dict) -> str:
    """A digest of the directory's small files, transformers' version and ``kwargs`` ("" for
    anything but a readable local directory, or arguments that are not plain values)."""
    if not os.path.isdir(path) or not all(
        isinstance(v, (str, int, float, bool, type(None))) for v in kwargs.values()
    ):
        return ""
    from importlib.metadata import version

    h = hashlib.sha256()
    h.update(f"transformers {version('transformers')}\n{sorted(kwargs.items())!r}\n".encode())
    try:
        for f in sorted(Path(path).iterdir()):
            if f.is_file() and not f.name.endswith(_WEIGHTS):
                h.update(f"{f.name}\n".encode())
                h.update(hashlib.sha256(f.read_bytes()).digest())
    except OSError:
        return ""
    return h.hexdigest()[:32]


def _read(record: Path) -> str:
    try:
        return record.read_text().strip()
    except OSError:
        return ""


def _write(record: Path, name: str) -> None:
    """Best effort: a read-only cache only costs the next process the slow path."""
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        tmp = record.with_name(f"{record.name}.{os.getpid()}.tmp")
        tmp.write_text(name + "\n")
        os.replace(tmp, record)
    except OSError as e:
        logger.debug("cannot record the tokenizer class in %s: %s", record, e)
