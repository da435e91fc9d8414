"""No-protocol sender/receiver for warmup and scheduler tests (SGLang's "fake" semantics):
nothing is looked up, registered or moved.

- ``FakeKVSender``: WaitingForInput until ``send()``, then Success.
- ``FakeKVReceiver``: Bootstrapping until ``init()``, WaitingForInput until ``send_metadata()``,
  then Success (decode then reads whatever its metadata row holds).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from pdserve.disagg.poll import KVPoll

# Requests sent with this bootstrap host (warm-up, calibration, /health_generate) use the fake
# sender/receiver: no peer is contacted and nothing is transferred.
FAKE_BOOTSTRAP_HOST = "2.2.2.2"


def is_fake_host(host: Optional[str]) -> bool:
    return host == FAKE_BOOTSTRAP_HOST


def fake_bootstrap(disaggregation_mode: str) -> dict:
    """The bootstrap fields of a server's own requests (warm-up and the like): fake in PD modes,
    none otherwise."""
    if disaggregation_mode == "null":
        return {}
    return {"bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_port": 0, "bootstrap_room": 0}


class FakeKVManager:
    def __init__(
        self,
        kv_args=None,
        mode: str = "prefill",
        server_args: Any = None,
        backend_name: str = "fake",
        bootstrap_host: Optional[str] = None,
    ):
        self.kv_args = kv_args
        self.mode = mode
        self.backend_name = backend_name

    def close(self) -> None:
        pass


class FakeKVSender:
    def __init__(self, mgr=None, bootstrap_addr: str = "", room: int = 0, **_: Any):
        self.room = room
        self.sent_pages: list[int] = []  # per cache group
        self._sent = False
        self._failed = ""

    def poll(self) -> KVPoll:
        if self._failed:
            return KVPoll.Failed
        return KVPoll.Success if self._sent else KVPoll.WaitingForInput

    def decode_prefix_pages(self) -> int:
        return 0

    def init(self, num_pages: Sequence[int], aux_slot: int) -> None:
        self.sent_pages = [0] * len(num_pages)

    def send_layers(self, src_pages: Sequence[Sequence[int]], layers) -> None:
        pass

    def send(
        self, src_pages: Sequence[Sequence[int]], last_chunk: bool = False, skip=frozenset()
    ) -> None:
        self.sent_pages = [
            n + len(p) for n, p in zip(self.sent_pages or [0] * len(src_pages), src_pages)
        ]
        self._sent = True

    def failure_reason(self) -> str:
        return self._failed

    def written(self) -> tuple[int, int, None]:
        return 0, 0, None

    def keepalive(self) -> None:
        pass

    def failed_here(self) -> bool:
        return bool(self._failed)

    def abort(self, reason: str = "aborted by prefill") -> None:
        self._failed = reason

    def clear(self) -> None:
        pass


class FakeKVReceiver:
    def __init__(
        self,
        mgr=None,
        bootstrap_addr: str = "",
        room: int = 0,
        prefill_dp_rank: Optional[int] = None,
        **_: Any,
    ):
        self.room = room
        self._state = KVPoll.Bootstrapping
        self._failed = ""

    def init(self, prefill_dp_rank: Optional[int] = None) -> None:
        if self._state == KVPoll.Bootstrapping:
            self._state = KVPoll.WaitingForInput

    def poll(self) -> KVPoll:
        return KVPoll.Failed if self._failed else self._state

    def send_metadata(
        self, dst_pages: Sequence[Sequence[int]], aux_slot: int, decode_prefix_pages: int = 0
    ) -> None:
        if self._state == KVPoll.WaitingForInput:
            self._state = KVPoll.Success

    def failure_reason(self) -> str:
        return self._failed

    def abort(self, reason: str = "aborted by decode") -> None:
        self._failed = reason

    def writes_drained(self) -> bool:
        return True

    def clear(self) -> None:
        pass
