"""The router's KV index against a real publisher (pdserve's own, over ZMQ): in-order batches,
a gap filled by replay, a gap replay cannot fill, a publisher restart, bad batches rejected and
counted; and the cache_aware policy's choice from it."""

from __future__ import annotations

import asyncio
import types

import msgspec
import pytest

from pdserve.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    chain_hashes,
)
from pdserve.router.kv_index import KVIndex, PromptBlocks
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policy import make_policy
from pdserve.router.workers import Worker
from tests.helpers.cluster import free_port

PAGE = 4


class FakeServer:
    """A publisher plus the cache content its snapshot route would serve."""

    def __init__(self, replay: bool = True):
        self.port, self.replay_port = free_port(), free_port()
        self.replay = replay
        self.blocks: dict[int, tuple] = {}  # hash -> (parent, tokens)
        self.snapshots = 0
        self.start()

    def start(self) -> None:
        self.pub = KVEventPublisher(
            f"tcp://127.0.0.1:{self.port}",
            f"tcp://127.0.0.1:{self.replay_port}" if self.replay else None,
        )

    def info(self) -> dict:
        return {
            "kv_events_endpoint": f"tcp://*:{self.port}",
            "dp_size": 1,
            "kv_events_replay_endpoint": f"tcp://*:{self.replay_port}" if self.replay else None,
        }

    def store(self, tokens: list[int], parent=None, publish: bool = True) -> list[int]:
        hashes = chain_hashes(parent, tokens, PAGE)
        for i, h in enumerate(hashes):
            self.blocks[h] = (hashes[i - 1] if i else parent, tokens[i * PAGE : (i + 1) * PAGE])
        event = BlockStored(
            block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=PAGE
        )
        if publish:
            self.pub.publish([event])
        else:  # lost on the way: counted and buffered for replay, never sent
            payload = msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=[event]))
            self.pub.buffer.append((self.pub.seq, payload))
            self.pub.seq += 1
        return hashes

    def remove(self, hashes: list[int]) -> None:
        for h in hashes:
            self.blocks.pop(h, None)
        self.pub.publish([BlockRemoved(block_hashes=hashes)])

    def send_raw(self, payload: bytes) -> None:
        seq = self.pub.seq
        self.pub.seq += 1
        self.pub.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    async def snapshot(self, worker) -> dict:
        self.snapshots += 1
        events = [
            {"block_hashes": [h], "parent_block_hash": p, "token_ids": t}
            for h, (p, t) in self.blocks.items()
        ]
        return {
            "block_size": PAGE,
            "groups": [{"dp_rank": 0, "seq": self.pub.seq - 1, "events": events}],
        }


def metrics() -> RouterMetrics:
    return RouterMetrics(types.SimpleNamespace(workers=[]))


def count(m: RouterMetrics, name: str, **labels) -> float:
    return m.registry.get_sample_value(name, labels) or 0.0


async def until(cond, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def follow(server: FakeServer, m: RouterMetrics):
    index = KVIndex(m, client_factory=None)
    index.snapshot = server.snapshot
    worker = Worker("http://127.0.0.1:1", "prefill")
    index.attach(worker, server.info())
    await until(lambda: index.known(worker))
    await asyncio.sleep(0.2)  # the subscription reaches the publisher
    return index, worker


def matched(index, worker, tokens) -> int:
    return index.matched_tokens(worker, PromptBlocks(tokens))[0]


def test_in_order_batches_then_a_gap_filled_by_replay():
    async def run():
        server, m = FakeServer(), metrics()
        server.store([1, 2, 3, 4])  # before the router: comes from the snapshot
        index, w = await follow(server, m)
        assert matched(index, w, [1, 2, 3, 4, 9]) == 4
        a = server.store(list(range(10, 22)))
        await until(lambda: matched(index, w, list(range(10, 22))) == 12)
        server.store(list(range(30, 34)), publish=False)  # lost
        server.store(list(range(40, 44)))  # its arrival shows the gap
        await until(lambda: matched(index, w, list(range(40, 44))) == 4)
        assert matched(index, w, list(range(30, 34))) == 4  # replayed
        assert (
            count(m, "pdserve_router_kv_index_resyncs_total", worker=w.url, reason="replayed") == 1
        )
        server.remove(a[1:])
        await until(lambda: matched(index, w, list(range(10, 22))) == 4)
        assert server.snapshots == 1
        await index.stop()
        server.pub.close()

    asyncio.run(run())


def test_gap_without_replay_and_restart_rebuild_from_snapshot():
    async def run():
        server, m = FakeServer(replay=False), metrics()
        index, w = await follow(server, m)
        server.store([5, 6, 7, 8], publish=False)
        server.store([9, 10, 11, 12])
        await until(
            lambda: matched(index, w, [5, 6, 7, 8]) == 4 and matched(index, w, [9, 10, 11, 12]) == 4
        )
        assert count(m, "pdserve_router_kv_index_resyncs_total", worker=w.url, reason="gap") == 1
        # the server restarts on the same port with an empty cache and seq from 0
        server.pub.close()
        await until(
            lambda: not index.known(w)
        )  # the index is dropped on disconnect, not left stale
        server.blocks.clear()
        server.start()
        await until(lambda: index.known(w))
        assert matched(index, w, [5, 6, 7, 8]) == 0
        assert (
            count(m, "pdserve_router_kv_index_resyncs_total", worker=w.url, reason="reconnected")
            == 1
        )
        await asyncio.sleep(0.2)
        server.store([13, 14, 15, 16])
        await until(lambda: matched(index, w, [13, 14, 15, 16]) == 4)
        await index.stop()
        server.pub.close()

    asyncio.run(run())


def test_bad_batches_are_rejected_counted_and_the_index_rebuilt():
    async def run():
        server, m = FakeServer(), metrics()
        index, w = await follow(server, m)
        server.store([1, 2, 3, 4])
        server.send_raw(b"\xc1 not msgpack")
        await until(
            lambda: count(
                m, "pdserve_router_kv_events_rejected_total", worker=w.url, reason="undecodable"
            )
        )
        forged = BlockStored(
            block_hashes=[123], parent_block_hash=None, token_ids=[7, 7, 7, 7], block_size=PAGE
        )
        server.send_raw(msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=[forged])))
        await until(
            lambda: count(
                m, "pdserve_router_kv_events_rejected_total", worker=w.url, reason="hash_chain"
            )
        )
        wrong_size = BlockStored(
            block_hashes=chain_hashes(None, [1, 2], 2),
            parent_block_hash=None,
            token_ids=[1, 2],
            block_size=2,
        )
        server.send_raw(msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=[wrong_size])))
        await until(
            lambda: count(
                m, "pdserve_router_kv_events_rejected_total", worker=w.url, reason="block_size"
            )
        )
        await until(
            lambda: (
                index.known(w)
                and count(
                    m, "pdserve_router_kv_index_resyncs_total", worker=w.url, reason="bad_event"
                )
                >= 3
            )
        )
        assert 123 not in index.feeds[w.url][0].hashes
        assert matched(index, w, [1, 2, 3, 4]) == 4  # the truth, from the snapshot
        server.store([5, 6, 7, 8], parent=chain_hashes(None, [1, 2, 3, 4], PAGE)[-1])
        await until(lambda: matched(index, w, [1, 2, 3, 4, 5, 6, 7, 8]) == 8)
        await index.stop()
        server.pub.close()

    asyncio.run(run())


class _Index:
    def __init__(self, held: dict):
        self.held = held

    def matched_tokens(self, worker, prompt):
        return (self.held.get(worker.url, 0), 0) if prompt is not None else (0, None)

    def weighted_tokens(self, worker, prompt):
        return self.matched_tokens(worker, prompt)[0]


def test_cache_aware_prefers_the_cache_until_load_outweighs_it():
    a, b = Worker("http://a:1", "prefill"), Worker("http://b:1", "prefill")
    for w in (a, b):
        w.polled_load, w.in_flight_at_poll = (0, 0), 0
    prompt = PromptBlocks(list(range(100)))
    policy = make_policy("cache_aware", _Index({a.url: 96}), balance=1.0)
    assert all(policy.select([a, b], prompt) is a for _ in range(10))
    a.polled_load = (3, 90)  # 90 tokens in hand < the 96 it would spare: still a
    assert policy.select([a, b], prompt) is a
    a.polled_load = (3, 200)  # overloaded: b, although it must prefill everything
    assert policy.select([a, b], prompt) is b
    assert make_policy("cache_aware", _Index({a.url: 96}), balance=0.0).select([a, b], prompt) is a
    # nothing cached anywhere (or no prompt): least load
    empty = make_policy("cache_aware", _Index({}))
    assert empty.select([a, b], prompt) is b and empty.last["fallback"] == "least_load"
    assert empty.select([a, b], None) is b
    with pytest.raises(ValueError, match="KV index"):
        make_policy("cache_aware")


class _GroupIndex(_Index):
    def __init__(self, groups: dict):
        super().__init__({})
        self.groups = groups

    def group_matches(self, worker, prompt):
        return self.groups

    group_weighted = group_matches


def test_cache_aware_picks_the_dp_group_holding_the_prefix_unless_it_is_loaded():
    w = Worker("http://a:1", "prefill")
    w.set_dp_size(4)
    w.group_loads = [(0, 0)] * 4
    prompt = PromptBlocks(list(range(100)))
    policy = make_policy("cache_aware", _GroupIndex({0: 0, 1: 0, 2: 96, 3: 0}), balance=1.0)
    assert all(policy.choose_group(w, prompt) == 2 for _ in range(5))
    w.group_loads = [
        (0, 0),
        (0, 0),
        (4, 500),
        (0, 0),
    ]  # the holder is busy: the least loaded instead
    assert policy.choose_group(w, prompt) in (0, 1, 3)
    nothing = make_policy("cache_aware", _GroupIndex({0: 0, 1: 0, 2: 0, 3: 0}))
    w.group_loads = [(3, 0), (1, 0), (2, 0), (5, 0)]
    assert nothing.choose_group(w, prompt) == 1  # least loaded, as without the cache
