"""Which DP group of a prefill server holds a room's KV, when the request does not say
(``disagg_prefill_dp_rank``): decode asks the prefill's bootstrap server.

A prefill server with DP attention records every room it takes (``POST /register_dp_rank``, by
the group's first rank, when the request arrives); a decode rank learns the instance's
``dp_size`` once per address (``GET /route``; an instance that does not answer is taken as one
group, whose connection then fails in the usual way), and for an instance with several groups looks
its rooms up in batches (``POST /query_dp_ranks``) on a helper thread until they appear.
``ResolvingReceiver`` wraps a room's receiver until then: it stays Bootstrapping, and fails
after the waiting timeout naming what is missing.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Sequence

from pdserve.disagg.bootstrap import fetch_prefill_info, parse_addr, query_dp_ranks
from pdserve.disagg.poll import KVPoll

logger = logging.getLogger(__name__)

RETRY_S = 0.02  # between look-ups of rooms not registered yet


class PrefillDPResolver:
    def __init__(self, name: str = "decode", secret: Optional[str] = None):
        self.secret = secret  # signs the look-ups (--disaggregation-secret)
        self.lock = threading.Lock()
        self.dp_sizes: dict[str, int] = {}  # bootstrap address -> the instance's DP groups
        self.found: dict[tuple[str, int], int] = {}  # (address, room) -> DP group
        self.wanted: dict[str, set[int]] = {}
        self.errors: dict[str, str] = {}  # address -> last look-up error
        self._busy: set[str] = set()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"pd-dp-lookup-{name}")

    def lookup(self, addr: str, room: int) -> Optional[int]:
        """The room's prefill DP group, or None while unknown (a look-up is then under way)."""
        with self.lock:
            if self.dp_sizes.get(addr) == 1:
                return 0
            got = self.found.get((addr, room))
            if got is not None:
                return got
            self.wanted.setdefault(addr, set()).add(room)
            if addr not in self._busy:
                self._busy.add(addr)
                self._pool.submit(self._work, addr)
        return None

    def forget(self, addr: str, room: int) -> None:
        with self.lock:
            self.found.pop((addr, room), None)
            self.wanted.get(addr, set()).discard(room)

    def error(self, addr: str) -> str:
        with self.lock:
            return self.errors.get(addr, "")

    def _work(self, addr: str) -> None:
        host, port = parse_addr(addr)
        while True:
            with self.lock:
                rooms = sorted(self.wanted.get(addr, ()))
                if not rooms:
                    self._busy.discard(addr)  # under the lock: a later lookup starts a new worker
                    return
                dp_size = self.dp_sizes.get(addr)
            try:
                if dp_size is None:
                    try:
                        dp_size = int(
                            fetch_prefill_info(host, port, 2.0, self.secret).get("dp_size", 1)
                        )
                    except Exception:
                        # not up (yet), unreachable: group 0, whose connection reports the problem
                        # in the usual way (the look-up is tried again for the next room)
                        dp_size = 1
                    else:
                        with self.lock:
                            self.dp_sizes[addr] = dp_size
                got = (
                    {r: 0 for r in rooms}
                    if dp_size == 1
                    else query_dp_ranks(host, port, rooms, 2.0, self.secret)
                )
                with self.lock:
                    self.errors.pop(addr, None)
                    for room, dp in got.items():
                        if room in self.wanted.get(addr, ()):
                            self.found[(addr, room)] = int(dp)
                            self.wanted[addr].discard(room)
            except (
                Exception
            ) as e:  # not up yet, or unreachable: the rooms time out with this reason
                with self.lock:
                    self.errors[addr] = f"{type(e).__name__}: {e}"
            time.sleep(RETRY_S)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class ResolvingReceiver:
    """A room's receiver whose prefill DP group is not known yet (see the module docstring);
    the same interface as ``KVReceiver``, whose work starts once the group is known."""

    def __init__(
        self, mgr, bootstrap_addr: str, room: int, receiver_cls, resolver: PrefillDPResolver
    ):
        self.mgr, self.bootstrap_addr, self.room = mgr, bootstrap_addr, room
        self.receiver_cls, self.resolver = receiver_cls, resolver
        self.inner: Optional[Any] = None
        self.failed: Optional[str] = None
        self.started = time.monotonic()
        self._advance()

    def _advance(self) -> None:
        if self.inner is not None or self.failed is not None:
            return
        dp = self.resolver.lookup(self.bootstrap_addr, self.room)
        if dp is not None:
            self.resolver.forget(self.bootstrap_addr, self.room)
            self.inner = self.receiver_cls(
                self.mgr, self.bootstrap_addr, self.room, prefill_dp_rank=dp
            )
        elif time.monotonic() - self.started > self.mgr.waiting_timeout:
            why = self.resolver.error(self.bootstrap_addr)
            self.failed = (
                f"prefill {self.bootstrap_addr} did not say which of its DP groups holds room "
                f"{self.room} within {self.mgr.waiting_timeout:.1f}s"
                + (f" (last look-up: {why})" if why else "")
            )
            self.resolver.forget(self.bootstrap_addr, self.room)

    def init(self, prefill_dp_rank: Optional[int] = None) -> None:
        pass

    def poll(self) -> KVPoll:
        self._advance()
        if self.inner is not None:
            return self.inner.poll()
        return KVPoll.Failed if self.failed else KVPoll.Bootstrapping

    def failure_reason(self) -> str:
        return self.inner.failure_reason() if self.inner is not None else (self.failed or "")

    def send_metadata(
        self, dst_pages: Sequence[Sequence[int]], aux_slot: int, decode_prefix_pages: int = 0
    ) -> None:
        if self.inner is None:
            raise RuntimeError(
                f"send_metadata for room {self.room} before its prefill DP group is known"
            )
        self.inner.send_metadata(dst_pages, aux_slot, decode_prefix_pages)

    def abort(self, reason: str = "aborted by decode") -> None:
        if self.inner is not None:
            self.inner.abort(reason)
        elif self.failed is None:
            self.failed = reason
            self.resolver.forget(self.bootstrap_addr, self.room)

    def writes_drained(self) -> bool:
        return self.inner.writes_drained() if self.inner is not None else True

    def clear(self) -> None:
        if self.inner is not None:
            self.inner.clear()
        self.resolver.forget(self.bootstrap_addr, self.room)
