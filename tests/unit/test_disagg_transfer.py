"""In-process checks of the prefill-side registration check, the sender's bootstrap timeout and
the fake classes (the full-protocol scenarios run per backend in tests/conformance)."""

import pytest
import torch
import zmq

from pdserve.config import ServerArgs  # noqa: E402
from pdserve.disagg.bootstrap import BootstrapServer  # noqa: E402
from pdserve.disagg.kv_args import KVArgs  # noqa: E402
from pdserve.disagg.manager import KVManager, get_kv_class  # noqa: E402
from pdserve.disagg.messages import (  # noqa: E402
    Abort,
    AbortAck,
    BufferDesc,
    Heartbeat,
    Register,
    RegisterAck,
    TransferRequest,
    TransferStatus,
    decode_message,
    encode_message,
)
from pdserve.disagg.metadata import MetadataBuffers  # noqa: E402
from pdserve.disagg.poll import KVPoll  # noqa: E402
from pdserve.engine.kv_pool import KVPool  # noqa: E402
from tests.helpers.cluster import wait_for  # noqa: E402

torch.set_num_threads(1)


# ---- in-process ----------------------------------------------------------------------------


@pytest.fixture
def prefill_mgr():
    server = BootstrapServer("127.0.0.1", 0, expected_ranks=1)
    args = ServerArgs(
        model_path="m", device="cpu", page_size=4, disaggregation_bootstrap_port=server.port
    )
    pool = KVPool(2, 8, 4, 2, 8, torch.bfloat16, "cpu")
    meta = MetadataBuffers(4)
    mgr = KVManager(
        KVArgs.from_buffers(pool, meta, model_fingerprint="tiny"), "prefill", args, "local"
    )
    yield mgr, pool, meta
    mgr.close()
    server.shutdown()


def test_prefill_rejects_incompatible_register(prefill_mgr):
    mgr, pool, meta = prefill_mgr
    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(mgr.endpoint())
    try:
        bad = KVArgs.from_buffers(
            KVPool(2, 8, 4, 2, 16, torch.bfloat16, "cpu"),
            MetadataBuffers(4),
            model_fingerprint="tiny",
        )
        push.send(b"\x81\xa1v\x63")  # garbage / wrong version: dropped, the loop keeps running
        push.send(
            encode_message(
                Register(
                    session_id="s1",
                    decode_rank=0,
                    decode_tp_size=1,
                    reply_endpoint=f"tcp://127.0.0.1:{port}",
                    buffers=BufferDesc.from_kv_args(bad),
                    compat=bad.compat_info(),
                    backend="local",
                )
            )
        )
        ack = decode_message(pull.recv())
        assert isinstance(ack, RegisterAck) and not ack.ok
        assert (
            "layer 0 cache mismatch: prefill full_attention (head_dim 8) in group 0, decode "
            "full_attention (head_dim 16)" in ack.error
        )
        # a sender for the room fails at once, and decode is told why
        sender = get_kv_class("local", "sender")(mgr, "x:1", 99)
        push.send(
            encode_message(
                TransferRequest(session_id="s1", room=99, generation=1, dst_pages=[[1]], aux_slot=0)
            )
        )
        status = decode_message(pull.recv())
        assert isinstance(status, TransferStatus) and status.state == KVPoll.Failed
        assert "prefill full_attention (head_dim 8)" in status.reason
        assert wait_for(lambda: sender.poll() == KVPoll.Failed)
        assert "layer 0 cache mismatch" in sender.failure_reason()
        push.send(
            encode_message(
                Heartbeat(session_id="s1", seq=5, reply_endpoint=f"tcp://127.0.0.1:{port}")
            )
        )
        hb = decode_message(pull.recv())
        assert isinstance(hb, Heartbeat) and hb.ack and hb.seq == 5 and hb.known
        # a prefill that does not know the session (e.g. restarted) says so, and fails its rooms
        push.send(
            encode_message(
                Heartbeat(session_id="nope", seq=1, reply_endpoint=f"tcp://127.0.0.1:{port}")
            )
        )
        assert not decode_message(pull.recv()).known
        push.send(
            encode_message(
                TransferRequest(
                    session_id="nope",
                    room=100,
                    generation=1,
                    dst_pages=[[1]],
                    aux_slot=0,
                    reply_endpoint=f"tcp://127.0.0.1:{port}",
                )
            )
        )
        status = decode_message(pull.recv())
        assert (
            status.room == 100
            and status.state == KVPoll.Failed
            and "not registered" in status.reason
        )
        # an abort for a room prefill has not seen yet: acknowledged, and a later sender fails at
        # once
        push.send(
            encode_message(
                Abort(
                    session_id="nope",
                    room=101,
                    generation=3,
                    reason="client left",
                    reply_endpoint=f"tcp://127.0.0.1:{port}",
                )
            )
        )
        ack = decode_message(pull.recv())
        assert isinstance(ack, AbortAck) and ack.room == 101 and ack.generation == 3
        late = get_kv_class("local", "sender")(mgr, "x:1", 101)
        assert (
            late.poll() == KVPoll.Failed
            and late.failure_reason() == "aborted by decode: client left"
        )
    finally:
        push.close(0)
        pull.close(0)


def test_sender_bootstrap_timeout():
    server = BootstrapServer("127.0.0.1", 0, expected_ranks=1)
    args = ServerArgs(
        model_path="m",
        device="cpu",
        page_size=4,
        disaggregation_bootstrap_port=server.port,
        disaggregation_bootstrap_timeout=0.2,
    )
    pool, meta = KVPool(1, 4, 4, 1, 8, torch.float32, "cpu"), MetadataBuffers(2)
    mgr = KVManager(KVArgs.from_buffers(pool, meta), "prefill", args, "local")
    try:
        sender = get_kv_class("local", "sender")(mgr, f"127.0.0.1:{server.port}", 5)
        assert sender.poll() == KVPoll.Bootstrapping
        wait_for(lambda: sender.poll() == KVPoll.Failed)
        assert (
            "timed out after" in sender.failure_reason()
            and "Bootstrapping" in sender.failure_reason()
        )
        sender.clear()
        assert mgr.get_status(5) is None
    finally:
        mgr.close()
        server.shutdown()


def test_fake_sender_receiver_state_machine():
    Sender, Receiver = get_kv_class("fake", "sender"), get_kv_class("fake", "receiver")
    mgr = get_kv_class("fake", "manager")(None, "decode", None, "fake")
    s = Sender(mgr, "2.2.2.2:8998", 1)
    assert s.poll() == KVPoll.WaitingForInput
    s.init([3], 0)
    assert s.poll() == KVPoll.WaitingForInput
    s.send([[1, 2, 3]], last_chunk=True)
    assert s.poll() == KVPoll.Success
    r = Receiver(mgr, "2.2.2.2:8998", 1)
    assert r.poll() == KVPoll.Bootstrapping
    r.init()
    assert r.poll() == KVPoll.WaitingForInput
    r.send_metadata([[4, 5, 6]], 0)
    assert r.poll() == KVPoll.Success
    r2 = Receiver(mgr, "2.2.2.2:8998", 2)
    r2.abort("gone")
    assert r2.poll() == KVPoll.Failed and r2.failure_reason() == "gone" and r2.writes_drained()


def test_get_kv_class():
    from pdserve.disagg.receiver import KVReceiver
    from pdserve.disagg.sender import KVSender

    assert get_kv_class("local", "kv_args") is KVArgs
    assert get_kv_class("local", "manager") is KVManager
    assert get_kv_class("mooncake", "sender") is KVSender
    assert get_kv_class("nixl", "receiver") is KVReceiver
    assert get_kv_class("fake", "bootstrap_server") is BootstrapServer
    with pytest.raises(ValueError, match="unknown transfer backend"):
        get_kv_class("carrier-pigeon", "sender")
    with pytest.raises(ValueError, match="kind"):
        get_kv_class("local", "router")
