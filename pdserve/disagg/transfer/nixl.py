"""``nixl`` backend: NVIDIA NIXL agents (UCX by default), prefill and decode on any hosts.

One ``nixl_agent`` per backend object (one per scheduler rank) with the plugin named by
``--disaggregation-nixl-backend`` (default ``UCX``). Prefill registers every KV, aux and state
region in one ``register_memory`` call at start-up (``DRAM`` on CPU, ``VRAM`` on CUDA). Decode
on CPU registers one window of its buffers per prefill session (``window.py``), decode's device
memory is registered directly; ``describe()`` returns the agent's name and metadata (which
include the registrations), and the writer side loads it with ``add_remote_agent`` in
``connect()`` (loading a known agent again updates it). Deregistering alone does not fence a
session over UCX's TCP transport (a write with stale metadata still lands: measured with NIXL
1.5.1), which is why a fenced window is also remapped to scratch memory.

Writes: one ``WRITE`` transfer request per batch (``initialize_xfer`` + ``transfer``);
``TransferHandle.wait`` polls ``check_xfer_state`` until the target confirmed the data, so the
KV manager reports Success only after every byte landed. A transfer still running after
``transfer_timeout`` (default: ``--disaggregation-waiting-timeout``, after which decode gives up
on the room anyway) or in state ``ERR`` becomes a ``TransferError`` and fails the room.
A write given ``notify`` carries it as the request's NIXL notification: the writer puts a
completion notice on a room's last write, and the decode side reads them with
``take_notifications()`` and marks the room's rank done without waiting for the control-plane
Success status.

Progress: with UCX over TCP (every plain host; NIXL's peer-failure mode rules out UCX's
shared-memory transports) a WRITE needs the *target* agent to make progress too. NIXL's
progress thread does that, but the Python wrapper starts it with a zero delay, i.e. spinning
(half a core or more while idle), which a 2-core machine cannot afford. So:
- ``progress_thread`` on (the default on hosts with ``PROGRESS_THREAD_MIN_CPUS`` cores, or the
  ``progress_thread`` option, or ``PDSERVE_NIXL_PROGRESS_THREAD=1``, read when the backend
  starts): NIXL's spinning progress thread on both sides, lowest latency;
- off (the default on small machines, ``PDSERVE_NIXL_PROGRESS_THREAD=0``): no thread on the
  writer (prefill), which progresses its agent while it waits for a request; the written side
  (decode) runs the progress thread in event mode, asleep in ``poll()`` on UCX's event fd until
  traffic arrives (``EVENT_THREAD_TIMEOUT_US`` is only its safety-net wake-up), which costs
  nothing while idle.

The agent is not thread-safe in the mode used here: every call into it holds ``self._agent_lock``.

Install: ``pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1`` (``pdserve[nixl]``; plain
``pip install nixl`` also pulls a CUDA torch). NIXL needs only numpy (and torch, already a pdserve
dependency) at import time. Hosts with Debian's ``ibverbs-providers`` make NIXL processes crash
at exit: install ``libibverbs1`` with ``--no-install-recommends``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from typing import Any, Optional

import numpy as np

from pdserve.disagg.transfer.base import TransferBackend, TransferError, TransferHandle
from pdserve.disagg.transfer.window import Window, memfd_allocator
from pdserve.engine.kv_pool import BufferAllocator

try:
    import nixl._api as _nixl_api
    from nixl._api import nixl_agent, nixl_agent_config
except ImportError as e:  # the registry turns this into "backend 'nixl' is not available: ..."
    raise ImportError(
        f"NIXL cannot be imported ({e}); install it with: "
        "pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1"
    ) from e

logger = logging.getLogger(__name__)

PROGRESS_THREAD_MIN_CPUS = 16
PROGRESS_THREAD_ENV = "PDSERVE_NIXL_PROGRESS_THREAD"
EVENT_THREAD_TIMEOUT_US = 10_000
WAIT_POLL_MAX_S = 100e-6  # the writer's own polling: without a progress thread UCX sends only then


def progress_thread_default() -> bool:
    raw = os.environ.get(PROGRESS_THREAD_ENV)
    if raw is not None and raw.strip():
        return raw.strip().lower() not in ("0", "false", "no", "off")
    return (os.cpu_count() or 1) >= PROGRESS_THREAD_MIN_CPUS


class NixlHandle(TransferHandle):
    """One posted WRITE request; released once it finished (or failed)."""

    def __init__(self, backend: "NixlBackend", peer: str, xfer: Any, state: str, deadline: float):
        self.backend, self.peer, self.xfer, self.state, self.deadline = (
            backend,
            peer,
            xfer,
            state,
            deadline,
        )
        self.error: Optional[str] = None
        if state == "ERR":
            self._finish("NIXL reported an error when posting the transfer")

    def _finish(self, error: Optional[str] = None) -> None:
        self.error = error
        with self.backend._agent_lock:
            try:
                self.backend.agent.release_xfer_handle(self.xfer)
            except Exception as e:  # a request that cannot be cancelled: NIXL keeps it until close
                logger.debug("NIXL release of a finished transfer failed: %s", e)
        self.xfer = None

    def done(self) -> bool:
        if self.xfer is None:
            return True
        with self.backend._agent_lock:
            self.state = self.backend.agent.check_xfer_state(self.xfer)
        if self.state == "DONE":
            self._finish()
        elif self.state == "ERR":
            self._finish(f"NIXL transfer to {self.peer} failed (peer exited or unreachable)")
        return self.xfer is None

    def wait(self, timeout: Optional[float] = None) -> None:
        deadline = (
            self.deadline if timeout is None else min(self.deadline, time.monotonic() + timeout)
        )
        delay = 0.0
        while not self.done():
            if time.monotonic() > deadline:
                self._finish(
                    f"NIXL transfer to {self.peer} did not complete within "
                    f"{self.backend.transfer_timeout:.1f}s"
                )
                break
            time.sleep(
                delay
            )  # the first polls only yield the GIL: small writes finish in microseconds
            delay = min(delay * 2 or 5e-6, WAIT_POLL_MAX_S)
        if self.error:
            raise TransferError(self.error)


class NixlBackend(TransferBackend):
    name = "nixl"

    def __init__(self, role: str, device: str = "cpu", **options: Any):
        super().__init__(role, device, **options)
        sa = options.get("server_args")
        self.plugin = (
            options.get("nixl_backend") or getattr(sa, "disaggregation_nixl_backend", None) or "UCX"
        )
        progress = options.get("progress_thread")
        self.progress_thread = progress_thread_default() if progress is None else bool(progress)
        timeout = (
            options.get("transfer_timeout")
            or getattr(sa, "disaggregation_waiting_timeout", None)
            or 30.0
        )
        self.transfer_timeout = float(timeout)
        self.mem_type = "VRAM" if str(device).startswith("cuda") else "DRAM"
        self.dev_id = int(str(device).split(":")[1]) if str(device).startswith("cuda:") else 0
        self.agent_name = f"pdserve-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._agent_lock = threading.Lock()
        if self.progress_thread:
            self.agent = _make_agent(self.agent_name, self.plugin, thread=True, delay_us=0)
        else:  # only the written side needs its agent progressed while nobody calls into it
            self.agent = _make_agent(
                self.agent_name,
                self.plugin,
                thread=role == "decode",
                delay_us=EVENT_THREAD_TIMEOUT_US,
            )
        if self.plugin not in self.agent.backends:
            raise TransferError(
                f"NIXL plugin {self.plugin!r} is not available; available: "
                f"{', '.join(self.agent.get_plugin_list())}"
            )
        self._reg: Any = None
        self._remote: dict[
            str, tuple[str, str, int]
        ] = {}  # peer_id -> (agent name, memory type, device id)
        self._closed = False
        logger.info(
            "NIXL agent %s (%s, progress thread %s)",
            self.agent_name,
            self.plugin,
            "spinning" if self.progress_thread else "event-driven" if role == "decode" else "off",
        )

    supports_windows = True

    @classmethod
    def buffer_allocator(cls, device: Optional[str] = None) -> BufferAllocator:
        return memfd_allocator

    # ---- lifecycle ---------------------------------------------------------------------

    def _register_window(self, win: Window, regions: list[tuple[int, int]]) -> None:
        descs = [(p, n, self.dev_id, "") for p, n in regions]
        with self._agent_lock:
            try:
                win.registered = self.agent.register_memory(
                    descs, self.mem_type, backends=[self.plugin]
                )
            except Exception as e:
                raise TransferError(
                    f"NIXL register_memory of a window ({len(descs)} regions) failed: {e}"
                ) from e

    def _unregister_window(self, win: Window) -> None:
        reg = win.registered
        if reg is None:
            return
        with self._agent_lock:
            try:
                self.agent.deregister_memory(reg)
            except Exception as e:
                logger.warning("NIXL deregister_memory of window %s failed: %s", win.key, e)
        win.registered = None

    def _register(self, regions: list[tuple[int, int]]) -> None:
        descs = [(int(p), int(n), self.dev_id, "") for p, n in regions if n > 0]
        if not descs:
            return
        with self._agent_lock:
            try:
                self._reg = self.agent.register_memory(descs, self.mem_type, backends=[self.plugin])
            except Exception as e:
                raise TransferError(
                    f"NIXL register_memory of {len(descs)} regions failed: {e}"
                ) from e

    def describe(self) -> dict[str, Any]:
        with self._agent_lock:
            metadata = self.agent.get_agent_metadata()
        return {
            "agent": self.agent_name,
            "metadata": bytes(metadata),
            "mem_type": self.mem_type,
            "dev_id": self.dev_id,
        }

    def _connect(self, peer_id: str, info: dict[str, Any]) -> None:
        metadata = info.get("metadata")
        if not metadata:
            raise TransferError(
                "peer described no NIXL agent metadata (is decode using the nixl backend?)"
            )
        with self._agent_lock:
            old = self._remote.pop(peer_id, None)
            if old is not None and old[0] != info.get("agent") and old[0] not in self._names():
                self._remove_remote(old[0])
            try:
                name = self.agent.add_remote_agent(metadata)
            except Exception as e:
                raise TransferError(
                    f"NIXL cannot load the metadata of agent {info.get('agent')}: {e}"
                ) from e
            name = name.decode() if isinstance(name, bytes) else str(name)
            try:
                self.agent.make_connection(
                    name
                )  # pay the endpoint set-up now, not on the first write
            except Exception as e:
                logger.debug(
                    "NIXL make_connection(%s) failed, the first write connects: %s", name, e
                )
            self._remote[peer_id] = (name, info.get("mem_type", "DRAM"), int(info.get("dev_id", 0)))

    def _names(self) -> set[str]:
        return {entry[0] for entry in self._remote.values()}

    def _remove_remote(self, name: str) -> None:
        try:
            self.agent.remove_remote_agent(name)
        except Exception as e:
            logger.debug("NIXL remove_remote_agent(%s): %s", name, e)

    def _disconnect(self, peer_id: str) -> None:
        with self._agent_lock:
            old = self._remote.pop(peer_id, None)
            if old is not None and old[0] not in self._names():
                self._remove_remote(old[0])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        super().close()
        with self._agent_lock:
            if self._reg is not None:
                try:
                    self.agent.deregister_memory(self._reg)
                except Exception as e:
                    logger.warning("NIXL deregister_memory failed: %s", e)
                self._reg = None

    # ---- data path -----------------------------------------------------------------------
    supports_notify = True

    def _write(
        self,
        peer_id: str,
        src: np.ndarray,
        dst: np.ndarray,
        lengths: np.ndarray,
        notify: Optional[bytes] = None,
    ) -> TransferHandle:
        with self._agent_lock:
            entry = self._remote.get(peer_id)
        if entry is None:
            raise TransferError(f"not connected to peer {peer_id}")
        remote, peer_mem, peer_dev = entry
        # [n, 3] rows of (address, length, device id)
        local = np.stack([src, lengths, np.full_like(src, self.dev_id)], axis=1).astype(np.uint64)
        far = np.stack([dst, lengths, np.full_like(dst, peer_dev)], axis=1).astype(np.uint64)
        with self._agent_lock:
            try:
                xfer = self.agent.initialize_xfer(
                    "WRITE",
                    self.agent.get_xfer_descs(local, self.mem_type),
                    self.agent.get_xfer_descs(far, peer_mem),
                    remote,
                    notify or b"",
                )
                state = self.agent.transfer(xfer)
            except Exception as e:
                raise TransferError(
                    f"NIXL cannot post a write of {len(src)} descriptors to {remote}: "
                    f"{type(e).__name__}: {e}"
                ) from e
        return NixlHandle(self, remote, xfer, state, time.monotonic() + self.transfer_timeout)

    def take_notifications(self) -> dict[str, list[bytes]]:
        """NIXL notifications that arrived since the last call: remote agent name -> messages."""
        with self._agent_lock:
            new = self.agent.get_new_notifs()
        return {
            (k.decode() if isinstance(k, bytes) else str(k)): [bytes(m) for m in v]
            for k, v in new.items()
        }


def _make_agent(name: str, plugin: str, thread: bool, delay_us: int) -> Any:
    """A ``nixl_agent`` whose progress thread (if any) waits up to ``delay_us`` for events between
    rounds. The wrapper hard-codes a zero delay (a spinning thread); a non-zero one is set on the
    binding's config as the wrapper builds the agent."""
    config = nixl_agent_config(enable_prog_thread=thread, backends=[plugin])
    if not thread or delay_us == 0 or not hasattr(_nixl_api, "nixlBind"):
        return nixl_agent(name, config)
    real = _nixl_api.nixlBind

    class _Binding:
        def __getattr__(self, attr: str) -> Any:
            return getattr(real, attr)

        def nixlAgent(self, agent_name: str, agent_config: Any) -> Any:  # noqa: N802 (the binding's name)
            agent_config.pthrDelay = delay_us
            return real.nixlAgent(agent_name, agent_config)

    with _make_agent_lock:
        _nixl_api.nixlBind = _Binding()
        try:
            return nixl_agent(name, config)
        finally:
            _nixl_api.nixlBind = real


_make_agent_lock = threading.Lock()
