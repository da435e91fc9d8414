"""The disk tier (``--hicache-storage-backend file``): one file per page under
``--hicache-file-backend-storage-dir`` (``PDSERVE_HICACHE_FILE_BACKEND_STORAGE_DIR``, default
/tmp/hicache as SGLang's ``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR``), in a directory per layout
key: ``<dir>/<layout key>/<block hash>.kv``.

A file is written to a temporary name in the same directory and renamed into place, so a reader
sees a whole entry or none; there is no fsync (an entry torn by a crash fails its checksum and is
dropped on read). At start the index of the layout's directory is rebuilt from the files, so a
restarted server hits what it wrote before. Several servers of one layout may share the
directory: a key missing from this server's index is still looked up on disk.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import uuid
from typing import Iterable, Optional

from pdserve.engine.kv_tier.base import TierBackend

logger = logging.getLogger(__name__)

SUFFIX = ".kv"
_NAME = re.compile(r"^[0-9a-f]{16}$")


class FileTierBackend(TierBackend):
    medium = "STORAGE"

    def __init__(self, args, layout_key: str, page_nbytes: int):
        super().__init__(args, layout_key, page_nbytes)
        self.root = os.path.join(args.hicache_file_backend_storage_dir, layout_key)
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise ValueError(
                f"hicache_file_backend_storage_dir: cannot create {self.root!r}: {e}"
            ) from e
        self._lock = threading.Lock()
        self._index: set[str] = set()
        for name in os.listdir(self.root):
            stem, ext = os.path.splitext(name)
            if ext == SUFFIX and _NAME.match(stem):
                self._index.add(f"{layout_key}/{stem}")
        logger.info("disk tier at %s: %d entries found", self.root, len(self._index))

    def _path(self, key: str) -> Optional[str]:
        layout, _, name = key.rpartition("/")
        if layout != self.layout_key or not _NAME.match(name):
            return None
        return os.path.join(self.root, name + SUFFIX)

    def put(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        if path is None:
            logger.warning("disk tier: malformed key %r", key)
            return False
        tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            logger.warning("disk tier: writing %s failed: %s", path, e)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False
        with self._lock:
            self._index.add(key)
        return True

    def get(self, key: str) -> Optional[bytes]:
        path = self._path(key)
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            with self._lock:
                self._index.discard(key)
            return None
        with self._lock:
            self._index.add(key)
        return data

    def exists(self, keys: list[str]) -> int:
        n = 0
        for key in keys:
            with self._lock:
                known = key in self._index
            if not known:
                path = self._path(key)
                if path is None or not os.path.exists(path):
                    break
            n += 1
        return n

    def remove(self, key: str) -> None:
        path = self._path(key)
        with self._lock:
            self._index.discard(key)
        if path is not None:
            try:
                os.unlink(path)
            except OSError:
                pass

    def startup_entries(self, header_nbytes: int) -> Iterable[tuple[str, bytes]]:
        with self._lock:
            keys = sorted(self._index)
        for key in keys:
            try:
                with open(self._path(key), "rb") as f:
                    yield key, f.read(header_nbytes)
            except OSError:
                continue

    def __len__(self) -> int:
        return len(self._index)
