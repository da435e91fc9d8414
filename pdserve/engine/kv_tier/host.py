"""The host tier: a bounded set of host-memory slots, one entry each, least recently used first
out (SGLang's host pool of the hierarchical cache).

The slots are one allocation made at start (pinned when a GPU is present, so copies to and from
the device can be asynchronous), ``capacity`` slots of the largest framed entry. On a CPU server
the pool is host memory too; this is still a store of its own, with its own bound, which the pool
never allocates from.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Optional

import torch

from pdserve.engine.kv_tier.base import TierBackend
from pdserve.engine.kv_tier.entry import header_nbytes

logger = logging.getLogger(__name__)


class HostTierBackend(TierBackend):
    medium = "CPU"

    def __init__(self, args, layout_key: str, page_nbytes: int, capacity: int = 0):
        super().__init__(args, layout_key, page_nbytes)
        if capacity < 1:
            raise ValueError(f"host tier: capacity must be >= 1 page, got {capacity}")
        self.slot_nbytes = page_nbytes + header_nbytes(layout_key, args.page_size)
        self.capacity = capacity
        pin = torch.cuda.is_available()
        # [capacity, slot_nbytes]: one framed entry per slot
        self.slots = torch.empty((capacity, self.slot_nbytes), dtype=torch.uint8, pin_memory=pin)
        self._bytes = self.slots.numpy()
        self._lock = threading.Lock()
        self._index: OrderedDict[str, tuple[int, int]] = OrderedDict()  # key -> (slot, length)
        self._free = list(range(capacity - 1, -1, -1))
        self._removed: list[str] = []

    def put(self, key: str, data: bytes) -> bool:
        if len(data) > self.slot_nbytes:
            logger.warning(
                "host tier: entry of %d bytes exceeds a slot (%d)", len(data), self.slot_nbytes
            )
            return False
        with self._lock:
            if key in self._index:
                slot, _ = self._index.pop(key)
            else:
                if not self._free:
                    old, (slot, _) = self._index.popitem(last=False)
                    self._removed.append(old)
                    self._free.append(slot)
                slot = self._free.pop()
            self._bytes[slot, : len(data)] = memoryview(data)
            self._index[key] = (slot, len(data))
        return True

    def get(self, key: str) -> Optional[bytes]:
        with self._lock:
            found = self._index.get(key)
            if found is None:
                return None
            self._index.move_to_end(key)
            slot, length = found
            return self._bytes[slot, :length].tobytes()

    def exists(self, keys: list[str]) -> int:
        with self._lock:
            n = 0
            for k in keys:
                if k not in self._index:
                    break
                n += 1
            return n

    def remove(self, key: str) -> None:
        with self._lock:
            found = self._index.pop(key, None)
            if found is not None:
                self._free.append(found[0])

    def drain_removed(self) -> list[str]:
        with self._lock:
            out, self._removed = self._removed, []
        return out

    def __len__(self) -> int:
        return len(self._index)

    def close(self) -> None:
        with self._lock:
            self._index.clear()
        self.slots = self._bytes = None
