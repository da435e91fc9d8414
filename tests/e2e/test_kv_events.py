"""KV cache events over ZMQ, read by a subscriber written from the wire format alone (the shapes
vLLM and SGLang publish): stored blocks with chained hashes, evictions, a cache reset, replay of
missed batches, and the snapshot route."""

from __future__ import annotations

import hashlib
import struct
import time
from array import array
from typing import Optional, Union

import msgspec
import pytest
import zmq

from tests.helpers import cluster as c
from tests.helpers import localhttp

PAGE = 16


# ---- the consumer's side: its own types, decoded from the wire ------------------------------
class Event(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class BlockStored(Event):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = None


class BlockRemoved(Event):
    block_hashes: list[int]
    medium: Optional[str] = None


class AllBlocksCleared(Event):
    pass


class Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Optional[int] = None


DECODE = msgspec.msgpack.Decoder(Batch)


def expected_hash(parent: Optional[int], tokens: list[int]) -> int:
    """The documented chain: BLAKE2b-64 of the parent hash (8 bytes BE) and the int32
    tokens, >> 1."""
    h = hashlib.blake2b(digest_size=8)
    if parent is not None:
        h.update(parent.to_bytes(8, "big"))
    h.update(array("i", tokens).tobytes())
    return int.from_bytes(h.digest(), "big") >> 1


@pytest.fixture(scope="module")
def events_server(tmp_path_factory, tiny_llama_path):
    logs = tmp_path_factory.mktemp("kv_events")
    pub, replay = c.free_port(), c.free_port()
    s = c.server(
        "KVE",
        tiny_llama_path,
        logs,
        "--page-size",
        str(PAGE),
        "--max-total-tokens",
        "512",
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{pub}",
        "--kv-events-replay-endpoint",
        f"tcp://127.0.0.1:{replay}",
        "--kv-events-topic",
        "kv",
    )
    s.start()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{pub}")
    try:
        yield {"server": s, "sub": sub, "ctx": ctx, "replay": f"tcp://127.0.0.1:{replay}"}
    finally:
        sub.close(linger=0)
        ctx.term()
        s.stop()


def receive(sub, until, timeout_ms: int = 10_000) -> list[tuple[int, Batch]]:
    """Batches (with their seq) until ``until(events so far)`` holds."""
    got: list[tuple[int, Batch]] = []
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    while not until([e for _, b in got for e in b.events]):
        assert poller.poll(timeout_ms), f"no KV event within {timeout_ms} ms; got {got}"
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv"
        got.append((int.from_bytes(seq, "big"), DECODE.decode(payload)))
    return got


def generate(url: str, ids: list[int], n: int = 4) -> list[int]:
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True},
    }
    r = localhttp.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_stored_blocks_chain_and_removed_and_cleared(events_server):
    s, sub = events_server["server"], events_server["sub"]
    time.sleep(0.5)  # the subscription settles (PUB drops what no subscriber asked for yet)
    prompt = list(range(100, 100 + 3 * PAGE + 5))
    out = generate(s.url, prompt)
    full = (prompt + out)[
        : (len(prompt) + len(out) - 1) // PAGE * PAGE
    ]  # the last token has no KV yet
    got = receive(sub, lambda ev: any(isinstance(e, BlockStored) for e in ev))
    stored = [e for _, b in got for e in b.events if isinstance(e, BlockStored)]
    assert stored[0].parent_block_hash is None and stored[0].block_size == PAGE
    tokens = [t for e in stored for t in e.token_ids]
    assert tokens == full[: len(tokens)] and len(tokens) >= 3 * PAGE
    parent, hashes = None, []
    for i in range(0, len(tokens), PAGE):
        parent = expected_hash(parent, tokens[i : i + PAGE])
        hashes.append(parent)
    assert [h for e in stored for h in e.block_hashes] == hashes

    # a follow-up sharing the first two pages: its new blocks hang under the second page's hash
    follow = prompt[: 2 * PAGE] + list(range(7000, 7000 + PAGE + 3))
    generate(s.url, follow)
    got = receive(sub, lambda ev: any(isinstance(e, BlockStored) for e in ev))
    new = next(e for _, b in got for e in b.events if isinstance(e, BlockStored))
    assert (
        new.parent_block_hash == hashes[1] and new.token_ids[:PAGE] == follow[2 * PAGE : 3 * PAGE]
    )

    # a prompt that needs most of the 512-token pool evicts cached blocks
    big = list(range(20000, 20000 + 470))
    generate(s.url, big, n=2)
    got = receive(sub, lambda ev: any(isinstance(e, BlockRemoved) for e in ev))
    removed = {
        h for _, b in got for e in b.events if isinstance(e, BlockRemoved) for h in e.block_hashes
    }
    assert removed & set(hashes + [new.block_hashes[0]]), removed

    # the snapshot holds exactly what is cached now, parents before children
    snap = s.http.get("/kv_events/snapshot").json()
    (group,) = snap["groups"]
    snap_hashes = [h for e in group["events"] for h in e["block_hashes"]]
    assert snap["block_size"] == PAGE and snap_hashes and not removed & set(snap_hashes)
    known = {None}
    for e in group["events"]:
        assert e["parent_block_hash"] in known
        known.update(e["block_hashes"])

    s.wait_idle()
    assert s.http.post("/flush_cache").status_code == 200
    got = receive(sub, lambda ev: any(isinstance(e, AllBlocksCleared) for e in ev))
    assert s.http.get("/kv_events/snapshot").json()["groups"][0]["events"] == []


def test_replay_from_a_sequence_number(events_server):
    s = events_server["server"]
    generate(s.url, list(range(3000, 3000 + 2 * PAGE + 1)))
    seq = s.http.get("/kv_events/snapshot").json()["groups"][0]["seq"]
    assert seq >= 1
    req = events_server["ctx"].socket(zmq.DEALER)
    req.connect(events_server["replay"])
    try:
        req.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while True:
            assert req.poll(10_000), "no replay answer"
            _, topic, seq_bytes, payload = req.recv_multipart()
            if struct.unpack(">q", seq_bytes)[0] == -1:
                break
            assert topic == b"kv"
            DECODE.decode(payload)
            seqs.append(int.from_bytes(seq_bytes, "big"))
        assert seqs == list(range(0, seq + 1)), seqs  # every batch, in order, none missing
    finally:
        req.close(linger=0)


def test_bad_kv_events_flags_are_refused():
    from pdserve.config import ServerArgs

    with pytest.raises(ValueError, match="kv_events_endpoint"):
        ServerArgs(model_path="/m", kv_events_endpoint="5557")
    with pytest.raises(ValueError, match="kv_events_replay_endpoint"):
        ServerArgs(model_path="/m", kv_events_replay_endpoint="tcp://*:5558")
