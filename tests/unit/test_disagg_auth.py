"""Control-plane authentication (HMAC on bootstrap registration and every ZMQ message) and the
prefill-side destination checks, with real KV managers in one process (local backend)."""

from __future__ import annotations

import time
import urllib.request

import msgspec
import pytest
import torch
import zmq

from pdserve.config import ServerArgs
from pdserve.disagg.bootstrap import (
    AUTH_HEADER,
    TIME_HEADER,
    BootstrapError,
    BootstrapServer,
    register_rank,
)
from pdserve.disagg.destinations import DestinationGuard
from pdserve.disagg.kv_args import KVArgs
from pdserve.disagg.manager import KVManager, buffer_allocator, get_kv_class
from pdserve.disagg.messages import (
    AuthError,
    BufferDesc,
    MessageCodec,
    Register,
    TransferRequest,
    encode_message,
)
from pdserve.disagg.metadata import MetadataBuffers
from pdserve.disagg.poll import KVPoll
from pdserve.engine.kv_pool import KVPool
from pdserve.kv_region import Region
from tests.helpers.cluster import wait_for
from tests.unit.test_disagg_bootstrap import rank_info

torch.set_num_threads(1)
SECRET = "s3cret"
NUM_PAGES = 16


# ---- codec ---------------------------------------------------------------------------------


def test_codec_signs_and_rejects_unsigned_tampered_and_foreign_messages():
    msg = TransferRequest(session_id="s", room=7, generation=1, dst_pages=[[3, 4]], aux_slot=0)
    signed = MessageCodec(SECRET.encode()).encode(msg)
    assert MessageCodec(SECRET.encode()).decode(signed).dst_pages == [[3, 4]]
    with pytest.raises(AuthError, match="unauthenticated"):
        MessageCodec(SECRET.encode()).decode(encode_message(msg))
    with pytest.raises(AuthError, match="bad HMAC"):
        MessageCodec(b"other").decode(signed)
    tampered = msgspec.msgpack.decode(signed)
    tampered["dst_pages"] = [[9, 10]]
    with pytest.raises(AuthError, match="bad HMAC"):
        MessageCodec(SECRET.encode()).decode(msgspec.msgpack.encode(tampered))
    assert MessageCodec().decode(signed).room == 7  # a side without a secret ignores the tag


# ---- bootstrap registration ----------------------------------------------------------------


def test_bootstrap_registration_needs_the_secret():
    server = BootstrapServer("127.0.0.1", 0, expected_ranks=1, secret=SECRET)
    try:
        with pytest.raises(BootstrapError, match="401.*not authenticated|not authenticated"):
            register_rank("127.0.0.1", server.port, rank_info(0, tp_size=1))
        with pytest.raises(BootstrapError, match="bad HMAC"):
            register_rank("127.0.0.1", server.port, rank_info(0, tp_size=1), secret="wrong")
        stale = urllib.request.Request(
            f"http://127.0.0.1:{server.port}/route",
            data=b"{}",
            method="PUT",
            headers={TIME_HEADER: "1000", AUTH_HEADER: "00", "Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.build_opener(urllib.request.ProxyHandler({})).open(stale, timeout=5)
        assert e.value.code == 401 and b"clock" in e.value.read()
        assert server.num_registered == 0
        register_rank("127.0.0.1", server.port, rank_info(0, tp_size=1), secret=SECRET)
        assert server.num_registered == 1
    finally:
        server.shutdown()


# ---- control messages and destinations, prefill and decode managers in one process ----------


class Managers:
    def __init__(self, secret=None):
        self.server = BootstrapServer("127.0.0.1", 0, expected_ranks=1, secret=secret)
        self.addr = f"127.0.0.1:{self.server.port}"
        base = dict(
            model_path="m",
            device="cpu",
            page_size=4,
            disaggregation_bootstrap_port=self.server.port,
            disaggregation_secret=secret,
        )
        p_args = ServerArgs(**base, disaggregation_mode="prefill")
        d_args = ServerArgs(**base, disaggregation_mode="decode")
        self.p_pool = KVPool(2, NUM_PAGES, 4, 2, 8, torch.bfloat16, "cpu")
        self.p_pool.buffer.fill_(1)
        alloc = buffer_allocator("local", "decode")
        self.d_pool = KVPool(2, NUM_PAGES, 4, 2, 8, torch.bfloat16, "cpu", alloc)
        self.d_pool.buffer.zero_()
        self.p_meta, self.d_meta = MetadataBuffers(4), MetadataBuffers(4, allocator=alloc)
        self.P = KVManager(
            KVArgs.from_buffers(self.p_pool, self.p_meta, model_fingerprint="t"),
            "prefill",
            p_args,
            "local",
        )
        self.D = KVManager(
            KVArgs.from_buffers(self.d_pool, self.d_meta, model_fingerprint="t"),
            "decode",
            d_args,
            "local",
        )

    def pair(self, room: int):
        sender = get_kv_class("local", "sender")(self.P, self.addr, room)
        receiver = get_kv_class("local", "receiver")(self.D, self.addr, room)
        wait_for(lambda: receiver.poll() == KVPoll.WaitingForInput)
        return sender, receiver

    def decode_untouched(self) -> bool:
        return bool((self.d_pool.buffer == 0).all())

    def close(self):
        self.P.close()
        self.D.close()
        self.server.shutdown()


@pytest.fixture
def authed():
    m = Managers(secret=SECRET)
    yield m
    m.close()


def test_unauthenticated_register_and_forged_transfer_request_are_rejected(authed):
    m = authed
    sender, receiver = m.pair(room=1)  # a properly signed registration works
    assert m.P.counts()["kv_peer_sessions"] == 1
    session = receiver._rs.conn.session_id
    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(m.P.endpoint())
    try:
        a = KVArgs.from_buffers(m.d_pool, m.d_meta, model_fingerprint="t")
        reg = Register(
            session_id="intruder",
            decode_rank=0,
            decode_tp_size=1,
            reply_endpoint=f"tcp://127.0.0.1:{port}",
            buffers=BufferDesc.from_kv_args(a),
            compat=a.compat_info(),
            backend="local",
        )
        push.send(encode_message(reg))  # no HMAC
        push.send(MessageCodec(b"guess").encode(reg))  # wrong key
        forged = TransferRequest(
            session_id=session,
            room=1,
            generation=1,
            dst_pages=[[1, 2]],
            aux_slot=0,
            reply_endpoint=f"tcp://127.0.0.1:{port}",
        )
        push.send(MessageCodec(b"guess").encode(forged))
        wait_for(lambda: m.P.rejected_messages >= 3)
        assert pull.poll(300) == 0  # no answer to any of them
        assert m.P.counts()["kv_peer_sessions"] == 1
        assert sender.poll() == KVPoll.Bootstrapping  # the forged request did not reach the room
        sender.init([2], 0)
        sender.send([[1, 2]], last_chunk=True)  # not WaitingForInput: nothing may be written
        time.sleep(0.2)
        assert m.decode_untouched()
    finally:
        push.close(0)
        pull.close(0)


@pytest.fixture
def plain():
    m = Managers()
    yield m
    m.close()


def test_destination_outside_the_registered_pool_is_refused(plain):
    m = plain
    sender, receiver = m.pair(room=5)
    receiver.send_metadata([[2, NUM_PAGES + 40]], aux_slot=0)
    wait_for(lambda: receiver.poll() == KVPoll.Failed)
    assert "outside decode's registered KV pool" in receiver.failure_reason()
    assert sender.poll() == KVPoll.Failed
    sender.init([2], 0)
    sender.send([[1, 2]], last_chunk=True)
    time.sleep(0.2)
    assert m.decode_untouched()
    # a metadata row outside the buffers, too
    sender, receiver = m.pair(room=6)
    receiver.send_metadata([[2, 3]], aux_slot=99)
    wait_for(lambda: receiver.poll() == KVPoll.Failed)
    assert "metadata row 99 is outside" in receiver.failure_reason()


def test_pages_of_a_room_in_flight_are_not_given_to_another_room(plain):
    m = plain
    s1, r1 = m.pair(room=11)
    s2, r2 = m.pair(room=12)
    r1.send_metadata([[3, 4]], aux_slot=0)
    wait_for(lambda: s1.poll() == KVPoll.WaitingForInput)
    r2.send_metadata([[4, 5]], aux_slot=1)
    wait_for(lambda: r2.poll() == KVPoll.Failed)
    assert "overlap those of room 11" in r2.failure_reason()
    # once room 11 is done, its pages may serve another room
    s1.init([2], 0)
    m.p_meta.set_row(0, 11, 42)
    s1.send([[1, 2]], last_chunk=True)
    wait_for(lambda: r1.poll() == KVPoll.Success)
    assert not m.decode_untouched()
    s3, r3 = m.pair(room=13)
    r3.send_metadata([[4, 5]], aux_slot=0)
    wait_for(lambda: s3.poll() == KVPoll.WaitingForInput)


def test_guard_bounds_and_release():
    buffers = BufferDesc(
        regions=[Region(ptr=0, nbytes=800, item_bytes=100, group=0, layer=0, part=p) for p in "kv"],
        aux_data_ptrs=[0],
        aux_data_lens=[256],
        aux_item_lens=[64],
    )
    g = DestinationGuard(buffers, buffers.regions, 1)
    assert (g.num_pages, g.num_aux_rows) == ([8], 4)
    ok = TransferRequest(session_id="s", room=1, generation=1, dst_pages=[[0, 7]], aux_slot=3)
    assert g.check(ok) == ""
    g.claim(ok)
    assert "repeat" in g.check(
        TransferRequest(session_id="s", room=2, generation=1, dst_pages=[[1, 1]], aux_slot=0)
    )
    # 0 names no page (a logical page on which the group holds no item): it neither repeats nor
    # collides with another room's 0
    assert (
        g.check(
            TransferRequest(
                session_id="s", room=2, generation=1, dst_pages=[[0, 5, 0, 6]], aux_slot=0
            )
        )
        == ""
    )
    assert "outside" in g.check(
        TransferRequest(session_id="s", room=2, generation=1, dst_pages=[[-1]], aux_slot=0)
    )
    assert "room 1" in g.check(
        TransferRequest(session_id="s", room=2, generation=1, dst_pages=[[1]], aux_slot=3)
    )
    assert (
        g.check(TransferRequest(session_id="s", room=1, generation=2, dst_pages=[[7]], aux_slot=3))
        == ""
    )
    g.release(1)
    assert g.rooms == 0
    assert (
        g.check(TransferRequest(session_id="s", room=2, generation=1, dst_pages=[[7]], aux_slot=3))
        == ""
    )
