"""The disk tier (``--hicache-storage-backend file``): one file per page under
``--hicache-file-backend-storage-dir`` (``PDSERVE_HICACHE_FILE_BACKEND_STORAGE_DIR``, default
/tmp/hicache as SGLang's ``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR``), in a directory per layout
key: ``<dir>/<layout key>/<block hash>.kv``.

A file is written to a temporary name in the same directory and renamed into place, so a reader
sees a whole entry or none; there is no fsync (an entry torn by a crash fails its checksum and is
dropped on read). At start the index of the layout's directory is rebuilt from the files, so a
restarted server hits what it wrote before. Several servers of one layout may share the
directory: a key missing from this server's index is still looked up on disk.

The tier is bounded (``--hicache-file-backend-max-gb``; by default half the space free on its
filesystem at start): past the bound the entries read or written longest ago are deleted (at
start the oldest files first), and the tier reports them (``drain_removed``) for KV events.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import uuid
from collections import OrderedDict
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
        # key -> its file's bytes, least recently read or written first
        self._index: OrderedDict[str, int] = OrderedDict()
        self._bytes = 0
        self._removed: list[str] = []
        found = []
        for name in os.listdir(self.root):
            stem, ext = os.path.splitext(name)
            if ext == SUFFIX and _NAME.match(stem):
                try:
                    st = os.stat(os.path.join(self.root, name))
                except OSError:
                    continue
                found.append((st.st_mtime, f"{layout_key}/{stem}", st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self._bytes += size
        if args.hicache_file_backend_max_gb:
            self.max_bytes = int(args.hicache_file_backend_max_gb * 2**30)
        else:
            self.max_bytes = (shutil.disk_usage(self.root).free + self._bytes) // 2
        with self._lock:
            self._evict()
        logger.info(
            "disk tier at %s: %d entries found, bounded at %.1f GiB",
            self.root,
            len(self._index),
            self.max_bytes / 2**30,
        )

    def _touch(self, key: str, size: int) -> None:
        """``key`` was read or written (its file ``size`` bytes); under the lock."""
        self._bytes += size - self._index.pop(key, 0)
        self._index[key] = size

    def _evict(self) -> None:
        """Delete the least recently used entries past the bound; under the lock."""
        while self._bytes > self.max_bytes and len(self._index) > 1:
            key, size = self._index.popitem(last=False)
            self._bytes -= size
            self._removed.append(key)
            try:
                os.unlink(self._path(key))
            except OSError:
                pass

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
            self._touch(key, len(data))
            self._evict()
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
                self._bytes -= self._index.pop(key, 0)
            return None
        with self._lock:
            self._touch(key, len(data))
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
            self._bytes -= self._index.pop(key, 0)
        if path is not None:
            try:
                os.unlink(path)
            except OSError:
                pass

    def drain_removed(self) -> list[str]:
        with self._lock:
            out, self._removed = self._removed, []
        return out

    @property
    def nbytes(self) -> int:
        return self._bytes

    def startup_entries(self, header_nbytes: int) -> Iterable[tuple[str, bytes]]:
        with self._lock:
            keys = list(self._index)
        for key in keys:
            try:
                with open(self._path(key), "rb") as f:
                    yield key, f.read(header_nbytes)
            except OSError:
                continue

    def __len__(self) -> int:
        return len(self._index)
