import msgspec
import pytest

from pdserve.disagg.kv_args import KVArgs, compat_mismatches
from pdserve.disagg.messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Abort,
    AbortAck,
    BufferDesc,
    Heartbeat,
    ProtocolError,
    Register,
    RegisterAck,
    TransferRequest,
    TransferStatus,
    decode_message,
    encode_message,
)
from pdserve.disagg.poll import KVPoll
from pdserve.kv_region import Region


def _regions():
    return [
        Region(ptr=4096, nbytes=4096, item_bytes=256, group=0, layer=0, part="k"),
        Region(ptr=8192, nbytes=4096, item_bytes=256, group=0, layer=0, part="v"),
        Region(
            ptr=1 << 20,
            nbytes=640,
            item_bytes=64,
            group=0,
            part="routed_experts",
            split="replicated",
        ),
        Region(
            ptr=1 << 21,
            nbytes=1280,
            item_bytes=128,
            group=1,
            layer=0,
            part="conv",
            split="segments",
            final="last_chunk",
            segments=(32, 64, 32),
        ),
    ]


def _kv_args(**kw):
    return KVArgs(
        engine_rank=1,
        regions=_regions(),
        aux_data_ptrs=[1 << 40],
        aux_data_lens=[640],
        aux_item_lens=[64],
        kv_head_num=2,
        total_kv_head_num=4,
        page_size=16,
        model_fingerprint="fp",
        num_layers=1,
        kv_dtype="bfloat16",
        **kw,
    )


SAMPLES = [
    Register(
        session_id="abc-0",
        decode_rank=1,
        decode_tp_size=2,
        reply_endpoint="tcp://10.0.0.2:5555",
        buffers=BufferDesc.from_kv_args(_kv_args()),
        compat=_kv_args().compat_info(),
        backend="local",
        backend_info={
            "segments": [{"kind": "shm", "name": "x", "base": 1 << 45, "size": 10}],
            "pid": 7,
        },
    ),
    RegisterAck(session_id="abc-0", prefill_rank=3),
    RegisterAck(
        session_id="abc-0",
        prefill_rank=0,
        ok=False,
        error="page_size mismatch: prefill 16, decode 1",
    ),
    TransferRequest(
        session_id="abc-0",
        room=2**63 - 1,
        generation=4,
        dst_pages=[[1, 2, 3, 100000]],
        aux_slot=7,
        required_dst_info_num=2,
        decode_prefix_pages=3,
    ),
    TransferRequest(session_id="s", room=0, generation=1, dst_pages=[[]], aux_slot=-1),
    TransferStatus(room=99, generation=1, state=int(KVPoll.Success), prefill_rank=0),
    TransferStatus(room=99, generation=1, state=int(KVPoll.Failed), prefill_rank=1, reason="boom"),
    TransferStatus(
        room=99,
        generation=1,
        state=int(KVPoll.Failed),
        prefill_rank=1,
        reason="write failed",
        unsettled=True,
    ),
    Abort(session_id="s", room=5, generation=2, reason="client went away"),
    AbortAck(room=5, generation=2, prefill_rank=0),
    Heartbeat(session_id="s", seq=10, reply_endpoint="tcp://127.0.0.1:1"),
    Heartbeat(session_id="s", seq=10, ack=True, prefill_rank=2),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    data = encode_message(msg)
    raw = msgspec.msgpack.decode(data)
    assert raw["v"] == PROTOCOL_VERSION and raw["type"] == type(msg).__struct_config__.tag
    assert decode_message(data) == msg


def test_every_message_type_has_a_sample():
    assert {type(m) for m in SAMPLES} == set(MESSAGE_TYPES.values())


def test_unknown_version_rejected():
    raw = msgspec.msgpack.decode(encode_message(SAMPLES[1]))
    raw["v"] = PROTOCOL_VERSION + 1
    with pytest.raises(
        ProtocolError, match=f"unsupported control protocol version {PROTOCOL_VERSION + 1}"
    ):
        decode_message(msgspec.msgpack.encode(raw))
    del raw["v"]
    with pytest.raises(ProtocolError, match="version None"):
        decode_message(msgspec.msgpack.encode(raw))


def test_unknown_type_and_garbage_rejected():
    with pytest.raises(ProtocolError, match="unknown control message type 'teleport'"):
        decode_message(msgspec.msgpack.encode({"v": PROTOCOL_VERSION, "type": "teleport"}))
    with pytest.raises(ProtocolError, match="malformed"):
        decode_message(b"\xc1not msgpack")
    with pytest.raises(ProtocolError, match="invalid transfer_status"):
        decode_message(
            msgspec.msgpack.encode({"v": PROTOCOL_VERSION, "type": "transfer_status", "room": "x"})
        )


def test_compat_mismatch_names_both_sides():
    p = _kv_args().compat_info()
    d = dict(p, page_size=1, kv_dtype="float32")
    assert compat_mismatches(p, d) == [
        "kv_dtype mismatch: prefill bfloat16, decode float32 (give both servers the same "
        "--kv-cache-dtype or --dtype: --dtype auto measures on each server)",
        "page_size mismatch: prefill 16, decode 1",
    ]
    assert (
        compat_mismatches(p, dict(p, model_fingerprint="")) == []
    )  # unknown fingerprint is not compared
    assert compat_mismatches(p, dict(p, model_fingerprint="other")) == [
        "model_fingerprint mismatch: prefill fp, decode other"
    ]


def test_kv_args_validation():
    def region(**kw):
        return Region(
            **{"ptr": 1, "nbytes": 64, "item_bytes": 8, "group": 0, "layer": 0, "part": "k", **kw}
        )

    with pytest.raises(ValueError, match="split 'rows' is not one of"):
        KVArgs(regions=[region(split="rows")])
    with pytest.raises(ValueError, match="final 'never' is not one of"):
        KVArgs(regions=[region(final="never")])
    with pytest.raises(ValueError, match="segments of 6 bytes in items of 8"):
        KVArgs(regions=[region(split="segments", segments=(2, 4))])
    with pytest.raises(ValueError, match="two regions of cache group 0, layer 0, part 'k'"):
        KVArgs(regions=[region(), region(ptr=100)])
    with pytest.raises(ValueError, match="aux_data_ptrs/lens/item_lens"):
        KVArgs(aux_data_ptrs=[1], aux_data_lens=[], aux_item_lens=[1])
    a = _kv_args()
    assert a.buffers() == [
        (4096, 4096),
        (8192, 4096),
        (1 << 20, 640),
        (1 << 21, 1280),
        (1 << 40, 640),
    ]
    assert a.num_local_layers == 1 and a.num_groups == 2
    assert a.splits == ("heads", "replicated", "segments")
    assert a.final_after_last_chunk(1) and not a.final_after_last_chunk(0)
    assert KVArgs(**a.to_dict()) == a  # regions survive a round trip through plain dicts
