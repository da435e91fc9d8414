"""The router's view of the tiers below a worker's pool: KV events with a medium ("CPU",
"STORAGE") land in the index apart from the pool's, the snapshot carries them too, and
cache_aware weighs a prefix in a tier between one in the pool and none."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.kv_events import BlockRemoved, BlockStored, chain_hashes
from pdserve.router.args import RouterArgs
from pdserve.router.kv_index import KVIndex, PromptBlocks
from pdserve.router.policy import make_policy
from pdserve.router.workers import Worker
from tests.unit.test_kv_index import PAGE, FakeServer, metrics, until

WEIGHTS = {"CPU": 0.8, "STORAGE": 0.5}


class TieredServer(FakeServer):
    """A publisher whose blocks may sit in the pool (no medium) or a tier below it."""

    def store_in(self, medium, tokens: list[int]) -> list[int]:
        hashes = chain_hashes(None, tokens, PAGE)
        for i, h in enumerate(hashes):
            self.blocks[h] = (hashes[i - 1] if i else None, tokens[i * PAGE : (i + 1) * PAGE])
            self.mediums[h] = medium
        self.pub.publish(
            [
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=None,
                    token_ids=tokens,
                    block_size=PAGE,
                    medium=medium,
                )
            ]
        )
        return hashes

    async def snapshot(self, worker) -> dict:
        snap = await super().snapshot(worker)
        for e in snap["groups"][0]["events"]:
            medium = self.mediums.get(e["block_hashes"][0])
            if medium:
                e["medium"] = medium
        return snap


def _server() -> TieredServer:
    s = TieredServer()
    s.mediums = {}
    return s


def test_cache_aware_prefers_a_pool_hit_to_a_tier_hit_to_none():
    prompt_ids = list(range(100, 100 + 8 * PAGE))
    prompt = PromptBlocks(prompt_ids)

    async def run():
        servers = {name: _server() for name in ("pool", "host", "disk", "none")}
        workers = {  # distinct URLs on this host, where the publishers are
            name: Worker(f"http://127.0.0.1:{i + 1}", "prefill") for i, name in enumerate(servers)
        }
        index = KVIndex(metrics(), client_factory=None, tier_weights=WEIGHTS)
        snapshots = {w.url: servers[n].snapshot for n, w in workers.items()}

        async def snapshot(worker):
            return await snapshots[worker.url](worker)

        index.snapshot = snapshot
        for name, w in workers.items():
            w.polled_load, w.in_flight_at_poll = (0, 0), 0
            index.attach(w, servers[name].info())
        await until(lambda: all(index.known(w) for w in workers.values()))
        await asyncio.sleep(0.2)  # the subscriptions reach the publishers
        servers["pool"].store_in(None, prompt_ids)
        servers["host"].store_in("CPU", prompt_ids)
        disk = servers["disk"].store_in("STORAGE", prompt_ids)
        n = len(prompt_ids)

        def weighs(name, tokens):
            return lambda: abs(index.weighted_tokens(workers[name], prompt) - tokens) < 1e-6

        await until(weighs("disk", 0.5 * n))
        await until(weighs("host", 0.8 * n))
        await until(weighs("pool", n))
        # a tier's blocks are not the pool's: the exact pool match stays 0 there
        assert index.matched_tokens(workers["host"], prompt)[0] == 0
        policy = make_policy("cache_aware", index, balance=1.0)
        w = workers
        assert policy.select([w["none"], w["disk"], w["host"], w["pool"]], prompt) is w["pool"]
        assert policy.select([w["none"], w["disk"], w["host"]], prompt) is w["host"]
        assert policy.select([w["none"], w["disk"]], prompt) is w["disk"]
        # a tier hit is still worth less than the same prefix in the pool when load is equal,
        # and a loaded pool loses to an idle tier once the load outweighs the difference
        w["pool"].polled_load = (1, int(0.3 * n))
        assert policy.select([w["host"], w["pool"]], prompt) is w["host"]
        # dropped from the tier: gone from the index, nothing left there
        servers["disk"].pub.publish([BlockRemoved(block_hashes=disk[2:], medium="STORAGE")])
        await until(weighs("disk", 0.5 * 2 * PAGE))
        # a resync rebuilds the tiers' blocks from the snapshot, with their medium
        feed, host = index.feeds[w["host"].url][0], servers["host"]
        before = host.snapshots
        feed.drop()
        feed._resync_needed = "test"
        host.pub.publish([BlockRemoved(block_hashes=[1], medium="CPU")])  # wakes the feed up
        await until(lambda: host.snapshots > before and feed.synced)
        assert weighs("host", 0.8 * n)()
        assert feed.describe()["tier_blocks"] == {"CPU": 8}
        await index.stop()
        for s in servers.values():
            s.pub.close()

    asyncio.run(run())


def test_tier_weights_are_validated():
    base = dict(prefill=[("http://p:1", None)], decode=["http://d:1"])
    with pytest.raises(ValueError, match="cache_aware_host_weight"):
        RouterArgs(**base, cache_aware_host_weight=1.5)
    with pytest.raises(ValueError, match="cache_aware_storage_weight"):
        RouterArgs(**base, cache_aware_storage_weight=-0.1)
