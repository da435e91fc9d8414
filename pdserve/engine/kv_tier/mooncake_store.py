"""The cluster-wide tier (``--hicache-storage-backend mooncake``): pages in a Mooncake Store
that every server of the cluster joins, so a prefix one server computed is a hit on the others.

Each server is a store client that also contributes ``global_segment_size`` bytes of its memory
to the store (Mooncake's embedded mode): the master (``mooncake_master``; ``pdserve launch
--kv-store mooncake`` starts one) only places and finds objects, values move between the
clients' segments over the transfer engine (TCP here, RDMA where devices are given). An entry
written by a server lives in one of the segments, possibly another server's, until the store
evicts it or its segment's server leaves. Configuration: ``mooncake_config``.

A store that is down or slow never fails or stalls a request, it only costs hits:

- joining the store runs on a thread of its own, and only once the master accepts a connection
  (Mooncake's ``setup`` retries a dead master for ~90 s holding the GIL); until it has joined, every
  call is a miss (and a failed put), and a failed join is retried after the breaker's cool-down;
- every call has a deadline (``timeout_s``) and goes through a circuit breaker
  (``breaker.GuardedCalls``): a timeout or repeated failures stop calls for a while, then one
  probe call tests the store again;
- puts come from the tier's writer thread (``kv_tier.writer``), off the scheduler's path.

Values are the tier's framed entries (``kv_tier.entry``: layout key, tokens, crc32), stored and
returned verbatim; the tier drops one whose checksum does not match, as a miss. An empty value
is Mooncake's answer for a missing key.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Optional

from pdserve.config import split_host_port
from pdserve.engine.kv_tier.base import TierBackend
from pdserve.engine.kv_tier.breaker import CLOSED, CircuitBreaker, GuardedCalls
from pdserve.engine.kv_tier.mooncake_config import FLAG, MooncakeStoreConfig

logger = logging.getLogger(__name__)

# clients left without closing (their master is gone): never destroyed, see ``close``
_ABANDONED: list = []

CLOSE_TIMEOUT_S = 3.0  # leaving a live master takes ~2 s (unmounting the segment)


class MooncakeStoreBackend(TierBackend):
    medium = "STORAGE"

    def __init__(self, args, layout_key: str, page_nbytes: int, config=None):
        super().__init__(args, layout_key, page_nbytes)
        self.config = config or MooncakeStoreConfig.resolve(
            getattr(args, FLAG, None), getattr(args, "host", "127.0.0.1")
        )
        # a get lands in the local buffer first: one framed entry must fit in it
        if self.config.local_buffer_size < 2 * page_nbytes:
            raise ValueError(
                f"{FLAG}: local_buffer_size ({self.config.local_buffer_size} bytes) must hold "
                f"two pages of this model's KV ({page_nbytes} bytes each)"
            )
        cfg = self.config
        self.breaker = CircuitBreaker(
            "mooncake-store",
            cfg.breaker_failures,
            cfg.breaker_cooldown_s,
            cfg.breaker_max_cooldown_s,
        )
        self.calls = GuardedCalls(self.breaker, cfg.timeout_s)
        self._lock = threading.Lock()
        self._store = None  # the joined MooncakeDistributedStore, None until then
        self._joining = False
        self._closed = False
        self.joins_failed = 0
        # counters for /metrics and stats (read without the lock: ints, single writers)
        self.hits = 0
        self.misses = 0
        self.puts = 0
        self.put_failures = 0
        self.get_failures = 0
        self._join()

    # ----- joining the store -----
    def _join(self) -> None:
        """Start joining the store on a thread of its own unless joined, joining or refused by
        the breaker (a failed join waits for its cool-down)."""
        with self._lock:
            if self._store is not None or self._joining or self._closed:
                return
            if not self.breaker.allow():
                return
            self._joining = True
        threading.Thread(
            target=self._join_blocking, name="mooncake-store-join", daemon=True
        ).start()

    def _join_blocking(self) -> None:
        cfg = self.config
        store, rc = None, -1
        try:
            # setup() holds the GIL while it retries an unreachable master (~90 s): the whole
            # server would stall, so it is called only once the master accepts a connection
            if not self._master_answers():
                raise OSError("no answer on its port")
            from mooncake.store import MooncakeDistributedStore

            store = MooncakeDistributedStore()
            rc = store.setup(
                cfg.local_hostname,
                cfg.metadata_server,
                cfg.global_segment_size,
                cfg.local_buffer_size,
                cfg.protocol,
                cfg.device_name,
                cfg.master_server_address,
            )
        except OSError as e:
            logger.warning(
                "mooncake store: master %s unreachable: %s", cfg.master_server_address, e
            )
        except Exception as e:  # a binding that raises is a failed join, retried later
            logger.warning("mooncake store: joining raised %s: %s", type(e).__name__, e)
        with self._lock:
            self._joining = False
            if rc == 0 and not self._closed:
                self._store = store
                store = None
        if rc == 0 and store is None:
            self.breaker.record(True)
            logger.info(
                "joined the Mooncake store at %s (%s, %d MiB contributed, metadata %s)",
                cfg.master_server_address,
                cfg.protocol,
                cfg.global_segment_size >> 20,
                cfg.metadata_server,
            )
            return
        if rc != 0:
            self.joins_failed += 1
            self.breaker.record_timeout("joining failed")  # the next try after the cool-down
            logger.warning(
                "cannot join the Mooncake store at %s (setup returned %s): prefixes are "
                "recomputed locally until it answers",
                cfg.master_server_address,
                rc,
            )
        if store is not None:
            _close_quietly(store)

    def _client(self):
        store = self._store
        if store is None:
            self._join()
        return store

    @property
    def joined(self) -> bool:
        return self._store is not None

    # ----- TierBackend -----
    def put(self, key: str, data: bytes) -> bool:
        store = self._client()
        if store is None:
            self.put_failures += 1
            return False
        rc = self.calls.call(
            lambda: store.put(key, data), default=-1, failed=lambda rc: rc != 0, what="put"
        )
        if rc != 0:
            self.put_failures += 1
            return False
        self.puts += 1
        return True

    def get(self, key: str) -> Optional[bytes]:
        store = self._client()
        if store is None:
            self.misses += 1
            return None
        value = self.calls.call(lambda: store.get(key), default=None, what="get")
        if value is None:
            self.get_failures += 1
            self.misses += 1
            return None
        if not value:  # Mooncake's answer for a missing key
            self.misses += 1
            return None
        self.hits += 1
        return bytes(value)

    def exists(self, keys: list[str]) -> int:
        if not keys:
            return 0
        store = self._client()
        if store is None:
            return 0
        # 1 present, 0 absent, negative: the store could not tell (e.g. master unreachable)
        found = self.calls.call(
            lambda: store.batch_is_exist(list(keys)),
            default=None,
            failed=lambda res: len(res) != len(keys) or any(r < 0 for r in res),
            what="exists",
        )
        if found is None:
            return 0
        n = 0
        for present in found:
            if present != 1:
                break
            n += 1
        return n

    def remove(self, key: str) -> None:
        store = self._client()
        if store is not None:
            # a lease still held by a reader refuses the removal: the tier's check drops it again
            self.calls.call(lambda: store.remove(key), default=-1, what="remove")

    def stats(self) -> dict:
        return {
            "joined": self.joined,
            "hits": self.hits,
            "misses": self.misses,
            "puts": self.puts,
            "put_failures": self.put_failures,
            "get_failures": self.get_failures,
            "timeouts": self.calls.timeouts,
            "refused": self.calls.refused,
            "breaker": self.breaker.state,
            "breaker_opened": self.breaker.opened,
        }

    def close(self) -> None:
        with self._lock:
            self._closed = True
            store, self._store = self._store, None
        self.calls.close()
        if store is None:
            return
        if self.breaker.state != CLOSED or not self._master_answers():
            # leaving a dead (or hung) master holds the GIL for its own timeouts (6-14 s): the
            # whole process would stall on its way out, for a segment nobody can reach any
            # more. The client's destructor does the same, so it is kept alive (the process is
            # ending)
            logger.warning(
                "mooncake store: master gone or not answering, leaving without unmounting"
            )
            _ABANDONED.append(store)
            return
        _close_quietly(store)

    def _master_answers(self) -> bool:
        try:
            host, port = split_host_port(self.config.master_server_address)
            socket.create_connection((host, port), timeout=min(self.config.timeout_s, 1.0)).close()
            return True
        except OSError:
            return False


def _close_quietly(store) -> None:
    """Leave the store (unmount our segment), waiting at most ``CLOSE_TIMEOUT_S`` for it."""

    def run() -> None:
        try:
            store.close()
        except Exception as e:
            logger.warning("mooncake store: leaving raised %s: %s", type(e).__name__, e)

    t = threading.Thread(target=run, name="mooncake-store-close", daemon=True)
    t.start()
    t.join(CLOSE_TIMEOUT_S)
