"""The ``TransferBackend`` contract, backend by backend, in one process: a prefill-role backend
writes into buffers a decode-role backend registered (allocated with the backend's
``buffer_allocator``), through ``register_regions`` / ``describe`` / ``connect`` / ``write``.

Runs for ``local``, ``mooncake``, ``nixl`` and (for the checks that move no bytes) ``fake``; a
backend whose library is not installed is skipped with the reason.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch

from pdserve.disagg.descriptors import region_descriptors
from pdserve.disagg.transfer import get_backend
from pdserve.disagg.transfer.base import TransferError

ITEM = 1024  # bytes per page in these tests
PAGES = 8192
AUX_BYTES = 64 * 1024
GAP = 4096  # unregistered bytes between decode's two regions
PEER = "decode-0"


class Pair:
    def __init__(self, name: str):
        cls = get_backend(name)
        self.name = name
        self.decode = cls("decode")
        self.prefill = cls("prefill")
        kv_bytes = PAGES * ITEM
        # decode: [kv pages | gap | aux], both regions in one backend-visible allocation
        self.dst_buf = cls.buffer_allocator()(kv_bytes + GAP + AUX_BYTES, torch.device("cpu"))
        self.src_buf = torch.randint(
            0,
            256,
            (kv_bytes + AUX_BYTES,),
            dtype=torch.uint8,
            generator=torch.Generator().manual_seed(5),
        )
        d, s = self.dst_buf.data_ptr(), self.src_buf.data_ptr()
        self.src_kv, self.src_aux = s, s + kv_bytes
        self.decode.register_regions([(d, kv_bytes), (d + kv_bytes + GAP, AUX_BYTES)])
        # backends that fence a peer's late writes give each peer session its own window (a second
        # mapping of the same memory, docs/reliability.md): the peer writes to the window's
        # addresses
        window = self.decode.open_window(PEER)
        at = window.translate if window is not None else (lambda ptr: ptr)
        self.dst_kv, self.dst_aux = at(d), at(d + kv_bytes + GAP)  # where prefill writes
        self.dst_regions = [(self.dst_kv, kv_bytes), (self.dst_aux, AUX_BYTES)]
        self.prefill.register_regions([(self.src_kv, kv_bytes), (self.src_aux, AUX_BYTES)])
        self.prefill.connect(PEER, self.decode.describe(), self.dst_regions)

    def dst_page(self, i: int) -> bytes:
        return self.dst_buf[i * ITEM : (i + 1) * ITEM].numpy().tobytes()

    def src_page(self, i: int) -> bytes:
        return self.src_buf[i * ITEM : (i + 1) * ITEM].numpy().tobytes()

    def write_pages(self, src_pages, dst_pages, timeout: float = 60) -> None:
        descs = region_descriptors([self.src_kv], [self.dst_kv], [ITEM], src_pages, dst_pages)
        self.prefill.write(PEER, *descs).wait(timeout)

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


@pytest.fixture(scope="module", params=["local", "mooncake", "nixl", "fake"])
def pair(request):
    try:
        get_backend(request.param)
    except ValueError as e:
        pytest.skip(str(e))
    p = Pair(request.param)
    yield p
    p.close()


@pytest.fixture
def moving(pair):
    if pair.name == "fake":
        pytest.skip("the fake backend moves no bytes")
    pair.dst_buf.zero_()
    return pair


def _layouts():
    rng = random.Random(3)
    runs, i = [], 0
    while i < 512:
        n = rng.randint(1, 16)
        runs.append(list(range(i, min(i + n, 512))))
        i += n
    rng.shuffle(runs)
    return {
        "contiguous": (list(range(100, 356)), list(range(1000, 1256))),
        "runs": (list(range(0, 512)), [p + 2000 for run in runs for p in run]),
        "random": (rng.sample(range(PAGES), 300), rng.sample(range(PAGES), 300)),
    }


@pytest.mark.parametrize("layout", ["contiguous", "runs", "random"])
def test_page_sets_land_byte_exact(moving, layout):
    src, dst = _layouts()[layout]
    moving.write_pages(src, dst)
    for s, d in zip(src, dst):
        assert moving.dst_page(d) == moving.src_page(s), f"page {s} -> {d}"
    untouched = sorted(set(range(PAGES)) - set(dst))[:200]
    assert all(moving.dst_page(d) == bytes(ITEM) for d in untouched), (
        "a page outside the batch was written"
    )


def test_one_write_of_4096_pages(moving):
    rng = random.Random(9)
    src, dst = rng.sample(range(PAGES), 4096), rng.sample(range(PAGES), 4096)  # 4096 descriptors
    moving.write_pages(src, dst)
    assert all(moving.dst_page(d) == moving.src_page(s) for s, d in zip(src, dst))


def test_32_writes_in_flight_from_8_threads(moving):
    rng = random.Random(4)
    dst_all = rng.sample(range(PAGES), 32 * 64)
    jobs = [(rng.sample(range(PAGES), 64), dst_all[i * 64 : (i + 1) * 64]) for i in range(32)]
    errors: list[BaseException] = []
    handles_lock = threading.Lock()

    def worker(k: int) -> None:
        try:
            handles = []
            for src, dst in jobs[k::8]:  # post all of this thread's writes, then wait for them
                descs = region_descriptors([moving.src_kv], [moving.dst_kv], [ITEM], src, dst)
                handles.append(moving.prefill.write(PEER, *descs))
            for h in handles:
                h.wait(60)
        except BaseException as e:  # noqa: BLE001 - reported below
            with handles_lock:
                errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for src, dst in jobs:
        assert all(moving.dst_page(d) == moving.src_page(s) for s, d in zip(src, dst))


def test_aux_region_written_after_pages(moving):
    moving.write_pages(list(range(16)), list(range(16)))
    moving.prefill.write(
        PEER, np.array([moving.src_aux]), np.array([moving.dst_aux]), np.array([AUX_BYTES])
    ).wait(30)
    got = moving.dst_buf[PAGES * ITEM + GAP :].numpy().tobytes()
    assert got == moving.src_buf[PAGES * ITEM :].numpy().tobytes()


@pytest.mark.parametrize("where", ["past the end", "in the gap", "straddling the end"])
def test_destination_outside_registered_regions_rejected_before_any_byte_moves(pair, where):
    pair.dst_buf.zero_()
    good_src, good_dst = list(range(16)), list(range(200, 216))
    src, dst, lens = region_descriptors([pair.src_kv], [pair.dst_kv], [ITEM], good_src, good_dst)
    bad_dst = {
        "past the end": pair.dst_aux + AUX_BYTES,
        "in the gap": pair.dst_kv + PAGES * ITEM,
        "straddling the end": pair.dst_kv + PAGES * ITEM - ITEM // 2,
    }[where]
    src, dst, lens = np.append(src, pair.src_kv), np.append(dst, bad_dst), np.append(lens, ITEM)
    with pytest.raises(TransferError, match="outside the peer's registered buffers"):
        pair.prefill.write(PEER, src, dst, lens)
    assert all(pair.dst_page(d) == bytes(ITEM) for d in good_dst), (
        "bytes moved before the batch was rejected"
    )


def test_source_outside_own_regions_rejected(pair):
    outside = pair.src_aux + AUX_BYTES
    with pytest.raises(TransferError, match="outside this rank's registered buffers"):
        pair.prefill.write(PEER, np.array([outside]), np.array([pair.dst_kv]), np.array([ITEM]))


def test_write_to_unknown_or_disconnected_peer_fails():
    with pytest.raises(TransferError, match="not connected"):
        get_backend("fake")("prefill").write("nobody", np.array([1]), np.array([1]), np.array([1]))


def test_library_refuses_unregistered_destination(pair):
    """Below our bounds check, the library itself refuses a destination the peer never registered
    (the write fails; it does not land somewhere else)."""
    if pair.name in ("fake", "local"):
        pytest.skip(f"{pair.name}: no library-side registration to check")
    with pytest.raises(TransferError):
        h = pair.prefill._write(
            PEER, np.array([pair.src_kv]), np.array([pair.dst_kv + PAGES * ITEM]), np.array([64])
        )
        h.wait(30)
    # the connection is still usable afterwards
    pair.dst_buf.zero_()
    pair.write_pages([1], [2])
    assert pair.dst_page(2) == pair.src_page(1)


def test_disconnect_then_reconnect(pair):
    pair.prefill.disconnect(PEER)
    with pytest.raises(TransferError, match="not connected"):
        pair.prefill.write(PEER, np.array([pair.src_kv]), np.array([pair.dst_kv]), np.array([ITEM]))
    pair.prefill.connect(PEER, pair.decode.describe(), pair.dst_regions)
    if pair.name != "fake":
        pair.dst_buf.zero_()
        pair.write_pages([5], [6])
        assert pair.dst_page(6) == pair.src_page(5)


def test_nixl_notifications_reach_the_written_side(pair):
    if pair.name != "nixl":
        pytest.skip("NIXL only: notifications are a NIXL feature")
    ((remote, _, _),) = pair.prefill._remote.values()
    pair.prefill.agent.send_notif(remote, b"room 7 done")
    got: dict = {}
    for _ in range(500):  # prefill has no progress thread: its polls push the message out
        pair.prefill.take_notifications()
        for agent, msgs in pair.decode.take_notifications().items():
            got.setdefault(agent, []).extend(msgs)
        if got:
            break
        threading.Event().wait(0.01)
    assert got == {pair.prefill.agent_name: [b"room 7 done"]}
