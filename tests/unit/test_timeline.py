"""The handoff timeline's pieces: the scheduler's events on the wire, the stages a server derives,
and the router's merge of prefill's, decode's and its own events."""

from __future__ import annotations

import json

import pytest

from pdserve.engine.request import Req, SamplingParams
from pdserve.router import timeline as router_timeline
from pdserve.server import timeline as server_timeline
from pdserve.server.messages import BatchOut, TokenOut, decode_from_scheduler, encode

ROUTER = {"received": 1.0, "dispatched": 1.5}
PREFILL = {"prefill_queued": 2.0, "prefill_forward_end": 4.0}
DECODE = {"decode_queued": 2.5, "decode_kv_received": 5.0, "decode_finished": 6.0}


def test_events_cross_the_scheduler_hop():
    req = Req(rid="r", input_ids=[1, 2], sampling=SamplingParams())
    req.mark("queued")
    first = req.timeline["queued"]
    req.mark("queued")  # the first time counts (a retracted request is admitted again)
    assert req.timeline == {"queued": first}
    out = TokenOut(rid="r", new_ids=[3], timeline=dict(req.timeline))
    assert decode_from_scheduler(encode(BatchOut(outs=[out]))).outs[0].timeline == {"queued": first}


def test_server_stages_and_public_names():
    events = {
        "received": 10.0,
        "queued": 10.5,
        "preallocated": 11.0,
        "kv_received": 13.0,
        "first_token": 12.9999,
        "finished": 15.0,
    }
    stages = dict(server_timeline.stages("decode", events))
    assert stages == pytest.approx(
        {
            "to_scheduler": 0.5,
            "decode_prealloc": 0.5,
            "decode_transfer": 2.0,
            "decode_first_token": 0.0,
            "decode_generate": 2.0001,
        }
    )
    assert "prefill_forward" not in dict(
        server_timeline.stages("prefill", events)
    )  # its events are missing
    assert list(server_timeline.public("decode", events)) == [
        "decode_received",
        "decode_queued",
        "decode_preallocated",
        "decode_first_token",
        "decode_kv_received",
        "decode_finished",
    ]
    assert list(server_timeline.public("null", {"queued": 1.0})) == ["server_queued"]


def test_header():
    assert server_timeline.requested({"x-pdserve-timeline": "1"})
    assert router_timeline.requested({"x-pdserve-timeline": "true"})
    assert not server_timeline.requested(
        {"x-pdserve-timeline": "0"}
    ) and not router_timeline.requested({})


def merged(item: dict) -> list[str]:
    return list(item["meta_info"]["timeline"])


def test_router_merges_generate_answers():
    decode = {"text": "x", "meta_info": {"id": "a", "timeline": DECODE}}
    prefill = [{"text": "", "meta_info": {"id": "a", "timeline": PREFILL}}]
    out = json.loads(router_timeline.merge_json(json.dumps(decode).encode(), prefill, 1, ROUTER))
    assert merged(out) == [
        "router_received",
        "router_dispatched",
        "prefill_queued",
        "decode_queued",
        "prefill_forward_end",
        "decode_kv_received",
        "decode_finished",
    ]
    # a batch of two inputs with n = 2: outputs 0, 1 belong to input 0
    batch = [{"meta_info": {"timeline": {"decode_finished": 9.0 + i}}} for i in range(4)]
    p_items = [{"meta_info": {"timeline": {"prefill_queued": float(i)}}} for i in range(2)]
    out = json.loads(router_timeline.merge_json(json.dumps(batch).encode(), p_items, 4, ROUTER))
    assert [o["meta_info"]["timeline"]["prefill_queued"] for o in out] == [0.0, 0.0, 1.0, 1.0]
    # no timeline in the answer (not asked, or an old worker): left as it is
    raw = json.dumps({"meta_info": {"id": "a"}}).encode()
    assert router_timeline.merge_json(raw, prefill, 1, ROUTER) is raw


def test_router_merges_openai_choices_and_events():
    answer = {
        "choices": [
            {"index": 1, "timeline": {"decode_finished": 7.0}},
            {"index": 0, "timeline": {"decode_finished": 6.0}},
        ]
    }
    p_items = [
        {
            "choices": [
                {"index": 0, "timeline": {"prefill_queued": 2.0}},
                {"index": 1, "timeline": {"prefill_queued": 3.0}},
            ]
        }
    ]
    out = json.loads(router_timeline.merge_json(json.dumps(answer).encode(), p_items, 2, ROUTER))
    by_index = {c["index"]: c["timeline"] for c in out["choices"]}
    assert by_index[0]["prefill_queued"] == 2.0 and by_index[1]["prefill_queued"] == 3.0
    assert by_index[1]["router_dispatched"] == 1.5
    # a streamed chunk: only the finishing choice has a timeline; other events pass unchanged
    chunk = (
        b'data: {"choices": [{"index": 1, "delta": {}, "timeline": {"decode_finished": 7.0}}]}\n\n'
    )
    event = router_timeline.merge_event(chunk, p_items, 2, ROUTER)
    data = json.loads(event.split(b"\n")[0][len(b"data: ") :])
    assert list(data["choices"][0]["timeline"]) == [
        "router_received",
        "router_dispatched",
        "prefill_queued",
        "decode_finished",
    ]
    plain = b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n'
    assert router_timeline.merge_event(plain, p_items, 2, ROUTER) is plain
    assert (
        router_timeline.merge_event(b"data: [DONE]\n\n", p_items, 2, ROUTER) == b"data: [DONE]\n\n"
    )


def test_router_stages():
    events = {"received": 1.0, "dispatched": 1.25, "first_byte": 2.0, "last_byte": 3.5}
    assert dict(router_timeline.stages(events)) == {
        "router_dispatch": 0.25,
        "router_first_byte": 0.75,
        "router_last_byte": 1.5,
    }
