"""Backend-parametrised KV transfer scenarios (shared by tests/unit and tests/conformance).

Each scenario runs a prefill process and a decode process (multiprocessing spawn) through the
whole protocol: bootstrap server (inside the prefill process), Register, TransferRequest,
chunked sends, metadata row, TransferStatus. Both sides build a real ``KVPool``; decode's pool
and metadata buffers come from the backend's ``buffer_allocator``. The test process compares
what prefill sent with what decode received, byte for byte.

A test module uses it by defining a module-scoped ``backend`` fixture and binding the ``test_*``
functions below (see tests/unit/test_disagg_transfer.py).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import random
import socket
import threading
import time
from typing import Any

import pytest

from tests.helpers.ports import free_port

LAYERS, HEADS, HEAD_DIM = 2, 2, 8
PAGE_SIZE = 4


# ---- room specs ---------------------------------------------------------------------------


def room_spec(
    room: int,
    src: list[int],
    dst: list[int],
    chunks: list[int],
    prefill: str = "send",
    decode: str = "normal",
    prefix: int = 0,
) -> dict[str, Any]:
    """``prefix``: decode already holds the first ``prefix`` pages (``dst[:prefix]``, its cached
    prefix): it asks for the rest only, and prefill sends ``src[prefix:]``."""
    assert len(src) == len(dst) and sum(chunks) == len(src) - prefix
    return {
        "room": room,
        "src": src,
        "dst": dst,
        "chunks": chunks,
        "prefill": prefill,
        "decode": decode,
        "prefix": prefix,
    }


def expected_row(room: int) -> dict[str, Any]:
    tok = room % 1000 + 1
    lp = -(room % 7) / 8
    return {
        "room": room,
        "first_token": tok,
        "logprob": lp,
        "top_logprobs": [(lp, tok), (-3.0, 17)],
        "cached_tokens": (room % 5, 1, 2, 3),
    }


# ---- the two processes --------------------------------------------------------------------


def _setup(cfg: dict[str, Any], role: str):
    import torch

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {role} %(name)s: %(message)s")
    from pdserve.config import ServerArgs

    return ServerArgs(
        model_path="test-model",
        device="cpu",
        page_size=cfg[f"{role}_page_size"],
        disaggregation_mode=role,
        disaggregation_transfer_backend=cfg["backend"],
        disaggregation_bootstrap_port=cfg["port"],
        disaggregation_bootstrap_timeout=cfg.get("bootstrap_timeout", 30.0),
        disaggregation_waiting_timeout=cfg.get("waiting_timeout", 30.0),
        disaggregation_heartbeat_interval=cfg.get("heartbeat_interval", 1.0),
        disaggregation_heartbeat_misses=cfg.get("heartbeat_misses", 3),
    )


def _page_bytes(pool, pages: list[int]) -> bytes:
    # KVPool [num_layers, 2, n, kv_heads, page_size, head_dim] or LatentPool [num_layers, n,
    # page_size, dim]
    # -> raw bytes, layer-major
    from pdserve.engine.kv_pool import KVPool

    rows = pool.buffer[:, :, pages] if isinstance(pool, KVPool) else pool.buffer[:, pages]
    return rows.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()


def _items(group, pages: list[int], first: int = 0) -> list[int]:
    """A room's page ids as cache group ``group`` holds them from logical page ``first`` on: the
    same ids in each group, but 0 on the pages where a group holds no item (compressed entries
    on the pages where a window closes only)."""
    return [p if group.spec.holds_item(first + i, PAGE_SIZE) else 0 for i, p in enumerate(pages)]


def _bytes(pools, groups, pages: list[int], first: int = 0) -> bytes:
    """The bytes of the items of ``pages`` (logical pages ``first ..``) in every cache group's
    pool."""
    return b"".join(
        _page_bytes(p, [i for i in _items(g, pages, first) if i]) for p, g in zip(pools, groups)
    )


def _pools(cfg: dict[str, Any], num_pages: int, page_size: int, alloc):
    """One pool (regions split by KV heads), or with ``groups=2`` a second cache group (one layer,
    another head size) whose pages are final only after the last chunk, as a sliding window's are,
    and with ``groups=3`` a third, latent one (replicated regions, no head axis), and with
    ``groups=4`` a fourth of compressed entries, one per two pages (0 on the others), final with
    each chunk; and their groups."""
    import torch

    from pdserve.engine.cache_kinds import make_pool
    from pdserve.kv_spec import (
        CacheGroup,
        CompressedEntries,
        FullAttention,
        LatentAttention,
        SlidingWindow,
    )

    groups = [CacheGroup(0, FullAttention(HEADS, HEAD_DIM), tuple(range(LAYERS)))]
    if cfg.get("groups", 1) >= 2:
        groups.append(CacheGroup(1, SlidingWindow(HEADS, 2 * HEAD_DIM, 8), (LAYERS,)))
    if cfg.get("groups", 1) >= 3:
        groups.append(
            CacheGroup(2, LatentAttention(4 * HEAD_DIM, HEAD_DIM), (LAYERS + 1, LAYERS + 2))
        )
    if cfg.get("groups", 1) >= 4:
        groups.append(CacheGroup(3, CompressedEntries(HEAD_DIM, 2 * PAGE_SIZE), (LAYERS + 3,)))
    return [
        make_pool(g, num_pages, page_size, torch.bfloat16, "cpu", alloc) for g in groups
    ], groups


def prefill_main(cfg: dict[str, Any], out, stop) -> None:
    import torch

    args = _setup(cfg, "prefill")
    from pdserve.disagg.bootstrap import BootstrapServer
    from pdserve.disagg.kv_args import KVArgs
    from pdserve.disagg.manager import KVManager, buffer_allocator, get_kv_class
    from pdserve.disagg.metadata import MetadataBuffers, SlotAllocator
    from pdserve.disagg.poll import KVPoll

    server = BootstrapServer("127.0.0.1", cfg["port"], expected_ranks=1)
    alloc = buffer_allocator(cfg["backend"], "prefill")
    pools, groups = _pools(cfg, cfg["prefill_pages"], args.page_size, alloc)
    meta = MetadataBuffers(64, allocator=alloc)
    gen = torch.Generator().manual_seed(cfg["seed"])
    for pool in pools:
        raw = pool.buffer.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    rooms = [r for r in cfg["rooms"] if r["prefill"] != "absent"]
    out.put(
        (
            "expected",
            {r["room"]: _bytes(pools, groups, r["src"][r["prefix"] :], r["prefix"]) for r in rooms},
        )
    )

    kv_args = KVArgs.from_buffers(
        pools, meta, cache_groups=groups, model_fingerprint=cfg.get("prefill_fingerprint", "tiny")
    )
    mgr = KVManager(kv_args, "prefill", args, cfg["backend"], bootstrap_host="127.0.0.1")
    Sender = get_kv_class(cfg["backend"], "sender")
    addr = f"127.0.0.1:{cfg['port']}"
    senders = {r["room"]: Sender(mgr, addr, r["room"]) for r in rooms}
    spec_of = {r["room"]: r for r in rooms}
    slots = SlotAllocator(64)
    started: set[int] = set()
    pending: dict[
        int, list
    ] = {}  # room -> [chunks still to send, offset, time the next one is due]
    chunk_delay = cfg.get("chunk_delay", 0.0)
    announced = False
    deadline = time.monotonic() + cfg.get("deadline", 60)
    while not stop.is_set() and time.monotonic() < deadline:
        now = time.monotonic()
        for room, p in list(
            pending.items()
        ):  # chunk_delay > 0: one chunk every chunk_delay seconds
            while p[0] and now >= p[2]:
                n = p[0].pop(0)
                first = spec_of[room]["prefix"]  # decode holds the prefix
                src = spec_of[room]["src"][first:]
                # a group final after the last chunk sends all its pages with it; the others
                # each chunk's
                pages = [
                    (src if not p[0] else [])
                    if kv_args.final_after_last_chunk(g.id)
                    else _items(g, src, first)[p[1] : p[1] + n]
                    for g in groups
                ]
                senders[room].send(pages, last_chunk=not p[0])
                p[1], p[2] = p[1] + n, now + chunk_delay
                if chunk_delay:
                    out.put(("sent_chunk", room))
            if not p[0]:
                del pending[room]
        states = {room: s.poll() for room, s in senders.items()}
        if all(st in (KVPoll.Success, KVPoll.Failed) for st in states.values()):
            break
        ready = all(st >= KVPoll.WaitingForInput or st == KVPoll.Failed for st in states.values())
        if ready and not announced:
            out.put(("waiting", None))
            announced = True
        if ready or not cfg.get("barrier"):  # barrier: start only when every room is requested
            for r in rooms:
                room = r["room"]
                if (
                    r["prefill"] != "send"
                    or room in started
                    or states[room] != KVPoll.WaitingForInput
                ):
                    continue
                started.add(room)
                s, slot = senders[room], slots.alloc()
                assert s.decode_prefix_pages() == r["prefix"]
                s.init([len(r["src"]) - r["prefix"]] * len(pools), slot)
                row = expected_row(room)
                meta.set_row(
                    slot,
                    room,
                    row["first_token"],
                    row["logprob"],
                    row["top_logprobs"],
                    row["cached_tokens"],
                )
                pending[room] = [list(r["chunks"]), 0, 0.0]
        time.sleep(0.005)
    out.put(("final", {room: (int(s.poll()), s.failure_reason()) for room, s in senders.items()}))
    stop.wait(cfg.get("deadline", 60))  # keep answering decode until the test is done
    mgr.close()
    server.shutdown()


def decode_main(cfg: dict[str, Any], out, stop) -> None:
    args = _setup(cfg, "decode")
    from pdserve.disagg.kv_args import KVArgs
    from pdserve.disagg.manager import KVManager, buffer_allocator, get_kv_class
    from pdserve.disagg.metadata import MetadataBuffers, SlotAllocator
    from pdserve.disagg.poll import KVPoll

    alloc = buffer_allocator(cfg["backend"], "decode")
    pools, groups = _pools(cfg, cfg["decode_pages"], args.page_size, alloc)
    meta = MetadataBuffers(64, allocator=alloc)
    kv_args = KVArgs.from_buffers(
        pools, meta, cache_groups=groups, model_fingerprint=cfg.get("decode_fingerprint", "tiny")
    )
    mgr = KVManager(kv_args, "decode", args, cfg["backend"], bootstrap_host="127.0.0.1")
    Receiver = get_kv_class(cfg["backend"], "receiver")
    addr = f"127.0.0.1:{cfg['port']}"
    recvs = {}
    for r in cfg["rooms"]:
        recvs[r["room"]] = Receiver(mgr, addr, r["room"])
        recvs[r["room"]].init()
    slot_of: dict[int, int] = {}
    slots = SlotAllocator(64)
    max_in_flight = 0
    deadline = time.monotonic() + cfg.get("deadline", 60)
    terminal = (KVPoll.Success, KVPoll.Failed)
    # decode="watch": the moment the metadata row shows the room, the pages must already be there
    watched = {r["room"]: r for r in cfg["rooms"] if r["decode"] == "watch"}
    at_row: dict[int, bytes] = {}
    watching = threading.Event()

    def watch() -> None:
        while not watching.is_set() and len(at_row) < len(watched):
            for room, r in watched.items():
                slot = slot_of.get(room)
                if room not in at_row and slot is not None and meta.row_room(slot) == room:
                    at_row[room] = _bytes(pools, groups, r["dst"])
            time.sleep(0.0002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    # decode's cached prefix pages: the transfer must leave them as they are
    padding = [_page_bytes(p, [0]) for p in pools]
    prefix_before = {
        r["room"]: _bytes(pools, groups, r["dst"][: r["prefix"]])
        for r in cfg["rooms"]
        if r["prefix"]
    }
    while time.monotonic() < deadline:
        states = {room: rv.poll() for room, rv in recvs.items()}
        if all(st in terminal for st in states.values()):
            break
        for r in cfg["rooms"]:
            room = r["room"]
            if states[room] == KVPoll.WaitingForInput and room not in slot_of:
                slot_of[room] = slots.alloc()
                recvs[room].send_metadata(
                    [_items(g, r["dst"][r["prefix"] :], r["prefix"]) for g in groups],
                    slot_of[room],
                    decode_prefix_pages=r["prefix"],
                )
                if r["decode"] == "abort":
                    recvs[room].abort("test abort")
                # requested and not finished as of the snapshot taken before this pass
                in_flight = sum(1 for rm in slot_of if states[rm] not in terminal)
                max_in_flight = max(max_in_flight, in_flight)
        time.sleep(0.005)
    while time.monotonic() < deadline and not all(rv.writes_drained() for rv in recvs.values()):
        time.sleep(0.01)
    watching.set()
    watcher.join()
    result = {}
    for r in cfg["rooms"]:
        room, rv = r["room"], recvs[r["room"]]
        st = rv.poll()
        item = {"state": int(st), "reason": rv.failure_reason(), "drained": rv.writes_drained()}
        if st == KVPoll.Success:
            row = meta.get_row(slot_of[room])
            item["bytes"] = _bytes(pools, groups, r["dst"][r["prefix"] :], r["prefix"])
            if r["prefix"]:
                item["prefix_untouched"] = (
                    _bytes(pools, groups, r["dst"][: r["prefix"]]) == prefix_before[room]
                )
            # the padding page, which the 0s of a group without an item stand for, is never
            # written
            item["padding_untouched"] = all(
                _page_bytes(p, [0]) == before for p, before in zip(pools, padding)
            )
            item["row"] = {
                "room": row.room,
                "first_token": row.first_token,
                "logprob": row.logprob,
                "top_logprobs": row.top_logprobs,
                "cached_tokens": row.cached_tokens,
            }
            item["row_room_ok"] = meta.row_room(slot_of[room]) == room
            if room in watched:
                item["bytes_at_row"] = at_row.get(room)
        result[room] = item
        rv.clear()
    out.put(("decode", {"rooms": result, "max_in_flight": max_in_flight}))
    mgr.close()
    shm = "/dev/shm"
    left = [n for n in (os.listdir(shm) if os.path.isdir(shm) else []) if f"-{os.getpid()}-" in n]
    out.put(("shm_left", left))
    stop.wait(30)


# ---- running a scenario --------------------------------------------------------------------


class StopFlag:
    """The test's "done" signal to both processes: one shared byte without a lock. A
    multiprocessing ``Event`` holds a lock while a process waits on it; a process the test kills
    at that moment leaves it taken, and ``set`` then blocks forever (seen: a hang in
    ``test_prefill_dies_mid_transfer``)."""

    def __init__(self, ctx):
        self._value = ctx.RawValue("b", 0)

    def set(self) -> None:
        self._value.value = 1

    def is_set(self) -> bool:
        return bool(self._value.value)

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.is_set() and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.is_set()


class Run:
    """Start both processes; collect their messages."""

    def __init__(self, backend: str, rooms: list[dict], **cfg: Any):
        self.cfg = {
            "backend": backend,
            "port": free_port(),
            "rooms": rooms,
            "seed": 1234,
            "prefill_page_size": PAGE_SIZE,
            "decode_page_size": PAGE_SIZE,
            "prefill_pages": 128,
            "decode_pages": 200,
            **cfg,
        }
        ctx = mp.get_context("spawn")
        self.out_p, self.out_d = ctx.Queue(), ctx.Queue()
        self.stop = StopFlag(ctx)
        self.prefill = ctx.Process(
            target=prefill_main, args=(self.cfg, self.out_p, self.stop), daemon=True
        )
        self.decode = ctx.Process(
            target=decode_main, args=(self.cfg, self.out_d, self.stop), daemon=True
        )
        self.prefill.start()
        # decode's look-up waits at most its waiting timeout (short in some scenarios): start it
        # once the prefill's bootstrap server accepts connections, however slow the start-up
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.prefill.is_alive():
            try:
                socket.create_connection(("127.0.0.1", self.cfg["port"]), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        self.decode.start()

    def expect(self, q, kind: str, timeout: float = 90):
        deadline = time.monotonic() + timeout
        while True:
            try:
                got, value = q.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"no {kind!r} message within {timeout}s "
                    f"(prefill alive={self.prefill.is_alive()}, decode "
                    f"alive={self.decode.is_alive()})"
                )
            if got == kind:
                return value

    def finish(self) -> dict[str, Any]:
        decode = self.expect(self.out_d, "decode")
        self.stop.set()
        res = {"decode": decode, "shm_left": self.expect(self.out_d, "shm_left")}
        self.close()
        return res

    def close(self) -> None:
        self.stop.set()
        for p in (self.prefill, self.decode):
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
                p.join()


# ---- scenarios -----------------------------------------------------------------------------

FAILED, SUCCESS = 0, 4


def protocol_rooms() -> list[dict]:
    rng = random.Random(7)
    rooms = [
        room_spec(101, list(range(1, 9)), list(range(10, 18)), [3, 3, 2]),  # contiguous both sides
        room_spec(
            102, list(range(20, 26)), [30, 32, 34, 35, 36, 50], [4, 2]
        ),  # contiguous src only
        room_spec(103, [60, 3, 45, 46, 9], list(range(60, 65)), [5]),  # contiguous dst only
        room_spec(104, [70, 69, 68, 1, 2], [90, 80, 81, 100, 99], [1, 1, 3]),  # neither, reversed
        room_spec(2**63 - 1, [127], [191], [1]),  # single page, largest room id
        room_spec(
            105, list(range(110, 117)), list(range(192, 199)), [2, 1], prefix=4
        ),  # decode holds 4 pages
    ]
    free = list(range(101, 191))
    for i in range(32):  # 32 more rooms, all in flight together
        n = rng.randint(1, 4)
        src = rng.sample(range(1, 128), n)
        dst = [free.pop() for _ in range(n)] if len(free) >= n else rng.sample(range(101, 190), n)
        rooms.append(room_spec(1_000_000 + i * 7919, src, dst, [n]))
    # destinations overlap between some of the 32 rooms only if free pages ran out: keep them
    # disjoint
    seen: set[int] = set()
    for r in rooms:
        assert not seen & set(r["dst"]), "destination pages must not overlap"
        seen |= set(r["dst"])
    return rooms


def run_rooms(backend: str, rooms: list[dict], **cfg: Any) -> dict[str, Any]:
    """Run a scenario to its end: decode's results, with what prefill sent (``expected``) and
    its final room states (``prefill_final``)."""
    run = Run(backend, rooms, **cfg)
    try:
        expected = run.expect(run.out_p, "expected")
        final = run.expect(run.out_p, "final")
        res = run.finish()
    finally:
        run.close()
    res["expected"], res["prefill_final"] = expected, final
    return res


@pytest.fixture(scope="module")
def protocol_run(backend):
    return run_rooms(backend, protocol_rooms(), barrier=True)


def _check_room(res, room):
    got = res["decode"]["rooms"][room]
    assert got["state"] == SUCCESS, got["reason"]
    assert got["bytes"] == res["expected"][room], f"room {room}: page bytes differ"
    assert got["row_room_ok"]
    assert got["row"] == expected_row(room)


def test_pages_and_aux_byte_exact(protocol_run):
    for room in (101, 102, 103, 104, 105, 2**63 - 1):
        _check_room(protocol_run, room)


def test_decode_prefix_pages_are_not_sent(protocol_run):
    """Decode already holds the first pages (its prefix cache): prefill writes only the rest,
    page i of what it sends into decode's i-th requested page, and the prefix stays untouched."""
    got = protocol_run["decode"]["rooms"][105]
    assert got["state"] == SUCCESS and got["prefix_untouched"], got["reason"]
    assert all(st == SUCCESS for st, _ in protocol_run["prefill_final"].values())


def test_32_rooms_in_flight(protocol_run):
    rooms = [r for r in protocol_run["decode"]["rooms"] if 1_000_000 <= r < 2**62]
    assert len(rooms) == 32
    for room in rooms:
        _check_room(protocol_run, room)
    # prefill started sending only after every room was requested: all were in flight at once
    assert protocol_run["decode"]["max_in_flight"] == len(protocol_run["decode"]["rooms"])


def test_decode_shared_memory_released(protocol_run):
    assert protocol_run["shm_left"] == []


def test_two_cache_groups_byte_exact(backend):
    """A second cache group (another head size, pages final only after the last chunk, as a
    sliding window's) moves with its own page ids next to the first, byte for byte, on every
    backend; a later group's pages go in the last chunk only."""
    rooms = [
        room_spec(201, list(range(1, 9)), list(range(10, 18)), [3, 3, 2]),
        room_spec(202, [60, 3, 45, 46, 9], list(range(60, 65)), [2, 3]),
        room_spec(203, list(range(110, 117)), list(range(192, 199)), [2, 1], prefix=4),
    ]
    res = run_rooms(backend, rooms, groups=2)
    for room in (201, 202, 203):
        _check_room(res, room)
    assert res["decode"]["rooms"][203]["prefix_untouched"]


def test_head_window_and_replicated_regions_byte_exact(backend):
    """Three cache groups whose regions split three ways (by KV heads; a window's, final after the
    last chunk; a latent's, replicated) move together, each with its own page ids, byte for byte."""
    rooms = [
        room_spec(211, list(range(1, 9)), list(range(10, 18)), [3, 3, 2]),
        room_spec(212, [60, 3, 45, 46, 9], list(range(60, 65)), [5]),
        room_spec(213, list(range(110, 117)), list(range(192, 199)), [2, 1], prefix=4),
    ]
    res = run_rooms(backend, rooms, groups=3)
    for room in (211, 212, 213):
        _check_room(res, room)
    assert res["decode"]["rooms"][213]["prefix_untouched"]


def test_compressed_entries_on_every_other_page_byte_exact(backend):
    """A group of compressed entries, one per two pages (0 on the others, on both sides alike),
    moves with each chunk beside a head-split, a window's and a latent group: the pages that hold
    an entry byte for byte, nothing written for the others (the padding page stays as it was)."""
    rooms = [
        room_spec(221, list(range(1, 9)), list(range(10, 18)), [3, 3, 2]),
        room_spec(222, [60, 3, 45, 46, 9], list(range(60, 65)), [1, 1, 3]),
        room_spec(223, list(range(110, 117)), list(range(192, 199)), [1, 2], prefix=4),
        room_spec(224, list(range(120, 127)), list(range(180, 187)), [1, 1, 2], prefix=3),
    ]
    res = run_rooms(backend, rooms, groups=4)
    for room in (221, 222, 223, 224):
        _check_room(res, room)
        assert res["decode"]["rooms"][room]["padding_untouched"]
    assert res["decode"]["rooms"][223]["prefix_untouched"]
    assert res["decode"]["rooms"][224]["prefix_untouched"]


def test_incompatible_page_size_fails_with_both_values(backend):
    rooms = [room_spec(7, [1], [1], [1], prefill="hold")]
    run = Run(
        backend,
        rooms,
        prefill_page_size=16,
        decode_page_size=1,
        prefill_pages=16,
        decode_pages=64,
        bootstrap_timeout=120,
    )
    t0 = time.monotonic()
    try:
        final = run.expect(run.out_p, "final")
        res = run.finish()
    finally:
        run.close()
    got = res["decode"]["rooms"][7]
    assert got["state"] == FAILED
    assert "page_size mismatch: prefill 16, decode 1" in got["reason"]
    # decode told prefill, which ended the request at once instead of at its 120 s timeout
    assert final[7][0] == FAILED and "page_size mismatch: prefill 16, decode 1" in final[7][1]
    assert time.monotonic() - t0 < 60


def test_prefill_failures_and_aborts(backend):
    rooms = [
        room_spec(11, [1, 2], [5, 6], [2]),  # normal
        room_spec(12, [3], [7], [1], prefill="hold"),  # prefill never sends: decode times out
        room_spec(13, [4], [8], [1], prefill="absent"),  # prefill never heard of the request
        room_spec(14, [9], [9], [1], prefill="hold", decode="abort"),  # decode aborts
    ]
    run = Run(backend, rooms, waiting_timeout=1.5)
    try:
        expected = run.expect(run.out_p, "expected")
        final = run.expect(run.out_p, "final")
        res = run.finish()
    finally:
        run.close()
    got = res["decode"]["rooms"]
    assert got[11]["state"] == SUCCESS and got[11]["bytes"] == expected[11]
    for room in (12, 13):
        assert got[room]["state"] == FAILED
        assert "timed out after" in got[room]["reason"]
        assert f"127.0.0.1:{run.cfg['port']}" in got[room]["reason"]
    assert got[14]["state"] == FAILED and got[14]["reason"] == "test abort"
    # every asked prefill rank acknowledged: the pages can be reused
    assert all(got[room]["drained"] for room in (12, 13, 14))
    assert final[11][0] == SUCCESS
    assert final[12][0] == FAILED and "aborted by decode: timed out" in final[12][1]
    assert final[14][0] == FAILED and final[14][1] == "aborted by decode: test abort"


def test_dead_prefill_detected_by_heartbeat(backend):
    rooms = [
        room_spec(21, [1], [1], [1], prefill="hold"),
        room_spec(22, [2, 3], [2, 3], [2], prefill="hold"),
    ]
    run = Run(backend, rooms, heartbeat_interval=0.2, heartbeat_misses=2, waiting_timeout=60)
    try:
        run.expect(run.out_p, "waiting")
        time.sleep(0.3)  # let decode send its requests and a heartbeat round trip
        run.prefill.kill()
        t0 = time.monotonic()
        res = run.finish()
    finally:
        run.close()
    for room in (21, 22):
        got = res["decode"]["rooms"][room]
        assert got["state"] == FAILED
        assert f"prefill instance 127.0.0.1:{run.cfg['port']} unreachable" in got["reason"]
        assert got["drained"]
    assert time.monotonic() - t0 < 20  # far below the 60 s waiting timeout


# ---- large transfers and peers that die mid-transfer ----------------------------------------

LARGE_PAGES = 4096


def shuffled_runs(rng: random.Random, pages: list[int], max_run: int) -> list[int]:
    """``pages`` cut into runs of 1..max_run consecutive pages, the runs in random order."""
    runs, i = [], 0
    while i < len(pages):
        n = rng.randint(1, max_run)
        runs.append(pages[i : i + n])
        i += n
    rng.shuffle(runs)
    return [p for run in runs for p in run]


def large_room_spec(room: int = 51) -> dict:
    """4096 pages in 8 chunks: the first half in contiguous runs of random lengths (different on
    each side), the second half page by page in random order (one descriptor per page)."""
    rng = random.Random(room)
    half = LARGE_PAGES // 2
    src = shuffled_runs(rng, list(range(1, half + 1)), 48) + rng.sample(
        range(half + 1, LARGE_PAGES + 1), half
    )
    dst = shuffled_runs(rng, list(range(1, half + 1)), 32) + rng.sample(
        range(half + 1, LARGE_PAGES + 1), half
    )
    return room_spec(room, src, dst, [LARGE_PAGES // 8] * 8, decode="watch")


def test_large_transfer_lands_before_its_metadata_row(backend):
    spec = large_room_spec()
    run = Run(backend, [spec], prefill_pages=LARGE_PAGES + 8, decode_pages=LARGE_PAGES + 8)
    try:
        expected = run.expect(run.out_p, "expected")
        final = run.expect(run.out_p, "final")
        res = run.finish()
    finally:
        run.close()
    got = res["decode"]["rooms"][spec["room"]]
    assert got["state"] == SUCCESS, got["reason"]
    assert final[spec["room"]][0] == SUCCESS
    assert got["bytes"] == expected[spec["room"]], "page bytes differ"
    assert got["row"] == expected_row(spec["room"])
    # decode saw the metadata row only after every page had landed (bootstrap_room is written last)
    assert got["bytes_at_row"] == expected[spec["room"]]


def paced_room(room: int) -> dict:
    return room_spec(
        room, list(range(1, 41)), list(range(101, 141)), [4] * 10
    )  # one chunk every chunk_delay


def test_prefill_dies_mid_transfer(backend):
    run = Run(
        backend,
        [paced_room(61)],
        chunk_delay=0.3,
        heartbeat_interval=0.2,
        heartbeat_misses=2,
        waiting_timeout=60,
    )
    try:
        run.expect(run.out_p, "sent_chunk")  # the room's first pages are on their way
        time.sleep(0.2)
        run.prefill.kill()
        t0 = time.monotonic()
        res = run.finish()
    finally:
        run.close()
    got = res["decode"]["rooms"][61]
    assert got["state"] == FAILED
    assert f"prefill instance 127.0.0.1:{run.cfg['port']} unreachable" in got["reason"]
    assert got["drained"]
    assert (
        time.monotonic() - t0 < 15
    )  # heartbeat deadline (0.4 s) plus process overhead, far below 60 s


def test_decode_dies_mid_transfer(backend):
    if backend == "local":
        pytest.skip(
            "local backend: prefill writes into decode's shared memory, which stays mapped after "
            "decode died, so a write cannot fail there (decode's death shows only in heartbeats)"
        )
    waiting_timeout = 5.0
    run = Run(backend, [paced_room(71)], chunk_delay=0.3, waiting_timeout=waiting_timeout)
    try:
        run.expect(run.out_p, "sent_chunk")
        time.sleep(0.2)
        run.decode.kill()
        t0 = time.monotonic()
        final = run.expect(run.out_p, "final", timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        run.close()
    state, reason = final[71]
    assert state == FAILED, reason
    assert "KV transfer to decode" in reason and "failed" in reason, reason
    assert (
        elapsed < waiting_timeout + 5
    )  # the backend gives up on a write after the waiting timeout
