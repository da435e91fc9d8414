"""The control protocol between prefill and decode servers of different TP sizes, in one
process: two prefill ranks (tp 2) holding the same replicated KV head (MQA) and one decode rank
(tp 1) that reads it from rank 0 only. Rank 1 writes nothing, yet it must conclude every room
(``rank_map``'s empty slice): a Success room ends on both prefill ranks, an aborted one too, and
no rank keeps a room or a destination claim afterwards."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import ServerArgs
from pdserve.disagg.bootstrap import BootstrapServer
from pdserve.disagg.destinations import DestinationGuard
from pdserve.disagg.kv_args import KVArgs
from pdserve.disagg.manager import KVManager, buffer_allocator, get_kv_class
from pdserve.disagg.messages import BufferDesc, TransferRequest
from pdserve.disagg.metadata import MetadataBuffers
from pdserve.disagg.poll import KVPoll
from pdserve.engine.kv_pool import KVPool
from tests.helpers.cluster import wait_for

torch.set_num_threads(1)

LAYERS, PAGES, PAGE_SIZE, HEAD_DIM, QUERY_HEADS = 2, 8, 4, 8, 4


def _args(port: int) -> ServerArgs:
    return ServerArgs(
        model_path="m",
        device="cpu",
        page_size=PAGE_SIZE,
        disaggregation_bootstrap_port=port,
        disaggregation_bootstrap_timeout=20,
        disaggregation_waiting_timeout=20,
    )


def _kv_args(pool, meta, rank: int, tp: int) -> KVArgs:
    return KVArgs.from_buffers(
        pool,
        meta,
        engine_rank=rank,
        tp_size=tp,
        global_rank=rank,
        total_kv_head_num=1,
        num_heads=QUERY_HEADS,
        model_fingerprint="tiny",
    )


@pytest.fixture
def mqa_pd():
    """Prefill tp 2 and decode tp 1 KV managers on the local backend, with their pools."""
    server = BootstrapServer("127.0.0.1", 0, expected_ranks=2)
    args = _args(server.port)
    prefill = []
    for rank in range(2):
        pool = KVPool(LAYERS, PAGES, PAGE_SIZE, 1, HEAD_DIM, torch.float32, "cpu")
        pool.buffer.copy_(
            torch.randn(pool.buffer.shape)
        )  # both ranks hold the same head; their bytes differ
        meta = MetadataBuffers(4)
        prefill.append(
            (KVManager(_kv_args(pool, meta, rank, 2), "prefill", args, "local"), pool, meta)
        )
    alloc = buffer_allocator("local", "decode")
    pool = KVPool(LAYERS, PAGES, PAGE_SIZE, 1, HEAD_DIM, torch.float32, "cpu", alloc)
    meta = MetadataBuffers(4, allocator=alloc)
    decode = (KVManager(_kv_args(pool, meta, 0, 1), "decode", args, "local"), pool, meta)
    yield prefill, decode, f"127.0.0.1:{server.port}"
    for mgr, _, _ in [*prefill, decode]:
        mgr.close()
    server.shutdown()


def _start_room(prefill, decode, addr: str, room: int, dst: list[int]):
    Sender, Receiver = get_kv_class("local", "sender"), get_kv_class("local", "receiver")
    senders = [Sender(mgr, addr, room) for mgr, _, _ in prefill]
    receiver = Receiver(decode[0], addr, room)
    wait_for(
        lambda: receiver.poll() == KVPoll.WaitingForInput, 20, "decode's connection to prefill"
    )
    receiver.send_metadata([dst], 1)
    wait_for(
        lambda: all(s.poll() == KVPoll.WaitingForInput for s in senders),
        20,
        "every prefill rank's transfer request, the idle rank's included",
    )
    return senders, receiver


def _all_rooms_ended(mgrs) -> None:
    for mgr in mgrs:
        counts = mgr.counts()
        assert counts["kv_rooms"] == 0 and counts.get("kv_dst_claims", 0) == 0, (mgr.name, counts)


def test_the_idle_prefill_rank_concludes_a_room_without_writing(mqa_pd):
    prefill, decode, addr = mqa_pd
    room, src, dst = 7, [1, 2, 3], [5, 4, 6]
    senders, receiver = _start_room(prefill, decode, addr, room, dst)
    assert [s.decode_prefix_pages() for s in senders] == [0, 0]
    prefill[0][2].set_row(0, room, 42)
    for s in senders:  # the scheduler drives every rank alike
        s.init([len(src)], 0)
        s.send([src], last_chunk=True)
    wait_for(
        lambda: [s.poll() for s in senders] == [KVPoll.Success] * 2,
        20,
        "Success on both prefill ranks",
    )
    wait_for(lambda: receiver.poll() == KVPoll.Success, 20, "Success on decode")
    d_pool, p_pool = decode[1], prefill[0][1]
    assert torch.equal(
        d_pool.buffer[:, :, dst], p_pool.buffer[:, :, src]
    )  # rank 0's copy of the head
    assert decode[2].row_room(1) == room and decode[2].get_row(1).first_token == 42
    assert senders[0].written()[1] > 0 and senders[1].written()[:2] == (0, 0)
    for s in senders:
        s.clear()
    receiver.clear()
    _all_rooms_ended([m for m, _, _ in [*prefill, decode]])


def test_an_abort_reaches_the_idle_prefill_rank(mqa_pd):
    prefill, decode, addr = mqa_pd
    senders, receiver = _start_room(prefill, decode, addr, 8, [2, 3])
    receiver.abort("client went away")
    # both prefill ranks stop (the idle one too: nothing else would end its part of the room) ...
    wait_for(
        lambda: all(s.poll() == KVPoll.Failed for s in senders), 20, "Failed on both prefill ranks"
    )
    assert all("client went away" in s.failure_reason() for s in senders)
    # ... and acknowledge, so decode may free the pages
    wait_for(receiver.writes_drained, 20, "both prefill ranks' abort acknowledgements")
    for s in senders:
        s.clear()
    receiver.clear()
    _all_rooms_ended([m for m, _, _ in [*prefill, decode]])


def test_a_request_naming_pages_to_a_rank_that_writes_nothing_is_refused():
    pool, meta = KVPool(1, 4, 4, 1, 8, torch.float32, "cpu"), MetadataBuffers(2)
    buffers = BufferDesc.from_kv_args(KVArgs.from_buffers(pool, meta))
    guard = DestinationGuard(buffers, buffers.regions, 1, empty=True)
    assert (
        guard.check(
            TransferRequest(session_id="s", room=1, generation=1, dst_pages=[[]], aux_slot=-1)
        )
        == ""
    )
    why = guard.check(
        TransferRequest(session_id="s", room=1, generation=1, dst_pages=[[0, 1]], aux_slot=-1)
    )
    assert "holds none of that decode rank's bytes" in why and "2 destination page(s)" in why
    assert guard.check(
        TransferRequest(session_id="s", room=1, generation=1, dst_pages=[[]], aux_slot=0)
    )
