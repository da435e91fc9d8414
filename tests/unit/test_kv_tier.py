"""The KV tiers below the pool (``engine/kv_tier``) under a cache manager without a model: a
latent + indexer-keys model's pages (two groups) evicted from the pool come back byte for byte,
from host memory and (past the host tier's bound) from disk, and from disk alone after a
restart; KV events name each block's tier; a corrupt entry is a miss; what the tiers refuse."""

from __future__ import annotations

import os
import time

import pytest
import torch

from pdserve.config import ServerArgs
from pdserve.distributed import SINGLE_RANK
from pdserve.engine.cache_kinds import make_pool
from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.kv_pool import KVPool
from pdserve.engine.kv_quant import kv_quant_for
from pdserve.engine.kv_tier import base, entry
from pdserve.engine.kv_tier.tier import make_tier
from pdserve.engine.request import Req, SamplingParams
from pdserve.kv_events import BlockRemoved, BlockStored, chain_hashes
from pdserve.kv_spec import FullAttention, IndexKeys, LatentAttention, SlidingWindow, group_layers

PAGE = 4


def args(tmp_path, **kw) -> ServerArgs:
    kw = {"hicache_storage_backend": "file", **kw}
    return ServerArgs(
        model_path="/models/tiny",
        device="cpu",
        page_size=PAGE,
        enable_hierarchical_cache=True,
        hicache_file_backend_storage_dir=str(tmp_path),
        **kw,
    )


def latent_manager(pages: int = 16) -> KVCacheManager:
    groups = group_layers([(LatentAttention(12, 4), IndexKeys(8))] * 2)
    pools = [make_pool(g, pages, PAGE, torch.bfloat16, "cpu") for g in groups]
    return KVCacheManager(groups, pools, PAGE)


def req(ids: list[int]) -> Req:
    return Req("r", ids, SamplingParams(max_new_tokens=4))


def prefill(m: KVCacheManager, r: Req) -> None:
    assert m.admit(r, len(r.all_ids), 0, (len(r.all_ids) - 1) // PAGE)
    r.kv_len = r.seq_len


def scribble(m: KVCacheManager, r: Req, seed: int) -> torch.Tensor:
    """Random bytes in ``r``'s pages (what a forward would write); returns them per page."""
    gen = torch.Generator().manual_seed(seed)
    for pool, ids in zip(m.pools, r.kv.pages):
        raw = pool.buffer.view(torch.uint8)
        for p in ids:
            page = raw[:, p]
            page.copy_(torch.randint(0, 256, page.shape, dtype=torch.uint8, generator=gen))
    return m.tier.codec.read([list(ids) for ids in r.kv.pages])


def test_pages_come_back_byte_for_byte_from_host_then_disk_and_after_a_restart(tmp_path):
    ids = list(range(100, 140))  # 10 full pages
    m = latent_manager()
    tier = make_tier(
        args(tmp_path, hicache_ratio=0.5, hicache_write_policy="write_back"), m, SINGLE_RANK
    )
    assert tier.host.capacity == 7  # half of the 15 usable pages
    m.tree.events = []
    r = req(ids)
    prefill(m, r)
    want = scribble(m, r, seed=1)
    m.release(r)
    assert m.tree.evict(100) == 10  # written back: 10 pages into a 7-page host tier, and disk
    assert tier.flush()
    for pool in m.pools:
        pool.buffer.zero_()  # nothing left in the pool to find by accident
    events = tier.poll()
    hashes = chain_hashes(None, ids, PAGE)
    stored = {}
    for e in events:
        if isinstance(e, BlockStored):
            stored.setdefault(e.medium, []).extend(e.block_hashes)
    assert stored == {"CPU": hashes, "STORAGE": hashes}
    dropped = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert dropped == hashes[:3] and all(
        e.medium == "CPU" for e in events if isinstance(e, BlockRemoved)
    )

    r2 = req(ids + [7])
    prefill(m, r2)
    assert r2.kv.cached == 10
    assert torch.equal(m.tier.codec.read([ids_[:10] for ids_ in r2.kv.pages]), want)
    assert (tier.stats["hicache_hits_storage"], tier.stats["hicache_hits_cpu"]) == (3, 7)
    assert tier.stats["hicache_hit_tokens_cpu"] == 7 * PAGE
    m.release(r2)
    m.check_integrity([0, 0])

    # a restarted server (empty pool and host tier) finds every page on disk
    m2 = latent_manager()
    tier2 = make_tier(args(tmp_path), m2, SINGLE_RANK)
    assert {h for e in tier2.poll() for h in e.block_hashes} == set(hashes)  # announced
    r3 = req(ids + [7])
    prefill(m2, r3)
    assert r3.kv.cached == 10 and tier2.stats["hicache_hits_storage"] == 10
    assert torch.equal(tier2.codec.read([ids_[:10] for ids_ in r3.kv.pages]), want)
    m2.release(r3)
    m2.check_integrity([0, 0])
    tier.close()
    tier2.close()


def test_a_corrupt_or_foreign_entry_is_a_miss_and_is_dropped(tmp_path):
    ids = list(range(500, 520))  # 5 pages
    m = latent_manager()
    tier = make_tier(args(tmp_path, hicache_write_policy="write_through"), m, SINGLE_RANK)
    r = req(ids)
    prefill(m, r)
    scribble(m, r, seed=2)
    m.release(r)  # write_through: into the tiers as the tree takes them
    assert tier.flush()
    tier.poll()
    hashes = chain_hashes(None, ids, PAGE)
    key = tier.key(hashes[2])
    good = tier.host.get(key)
    bad = bytearray(good)
    bad[-5] ^= 0x01
    tier.host.put(key, bytes(bad))
    path = os.path.join(tmp_path, tier.layout_key, f"{hashes[2]:016x}.kv")
    with open(path, "wb") as f:  # an entry of another layout under this key
        f.write(
            entry.pack(
                "other-layout", hashes[1], ids[8:12], entry.unpack(tier.layout_key, good).payload
            )
        )
    assert m.tree.reset()
    r2 = req(ids + [1])
    prefill(m, r2)
    assert r2.kv.cached == 2  # pages 0 and 1 from host; page 2 is corrupt in both tiers
    assert tier.stats["hicache_corrupt_cpu"] == tier.stats["hicache_corrupt_storage"] == 1
    assert not os.path.exists(path) and tier.host.get(key) is None
    removed = {
        (e.medium, h) for e in tier.poll() if isinstance(e, BlockRemoved) for h in e.block_hashes
    }
    assert removed == {("CPU", hashes[2]), ("STORAGE", hashes[2])}
    m.release(r2)
    m.check_integrity([0, 0])
    tier.close()


def test_models_with_windowed_or_state_groups_are_refused(tmp_path):
    specs = [FullAttention(2, 4), SlidingWindow(2, 4, 8)]
    groups = group_layers(specs)
    pools = [KVPool(1, 16, PAGE, 2, 4, torch.float32, "cpu") for _ in groups]
    m = KVCacheManager(groups, pools, PAGE)
    with pytest.raises(ValueError, match="enable_hierarchical_cache: .*sliding_window"):
        make_tier(args(tmp_path), m, SINGLE_RANK)


@pytest.mark.parametrize(
    "kw, match",
    [
        (
            dict(hicache_write_policy="write_through_selective"),
            "hicache_write_policy: .*not supported",
        ),
        (dict(hicache_write_policy="write_around"), "hicache_write_policy: must be one of"),
        (dict(hicache_storage_backend="nfs"), "hicache_storage_backend: unknown 'nfs'"),
        (dict(hicache_ratio=0), "hicache_ratio"),
        (dict(hicache_size=-1), "hicache_size"),
        (dict(pp_size=2), "enable_hierarchical_cache: pipeline stages"),
        (dict(hicache_file_backend_max_gb=-1), "hicache_file_backend_max_gb"),
        (dict(disable_radix_cache=True), "enable_hierarchical_cache: .*disable-radix-cache"),
        (dict(disaggregation_mode="decode"), "disaggregation-decode-enable-radix-cache"),
        (dict(speculative_algorithm="STANDALONE", speculative_draft_model_path="/d"), "NGRAM"),
    ],
)
def test_bad_flags_are_refused_by_name(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        args(tmp_path, **kw)


def test_storage_backend_needs_the_hierarchical_cache():
    with pytest.raises(
        ValueError, match="hicache_storage_backend: needs --enable-hierarchical-cache"
    ):
        ServerArgs(model_path="/m", device="cpu", hicache_storage_backend="file")


def test_backend_registry_imports_lazily_and_names_what_fails(tmp_path):
    assert base.backend_class("file").__name__ == "FileTierBackend"
    with pytest.raises(ValueError, match="not 'module:Class'"):
        base.register_backend("broken", "no_colon")
    base.register_backend("missing", "pdserve.engine.kv_tier.no_such_module:Store")
    try:
        with pytest.raises(ValueError, match="'missing' cannot be loaded"):
            base.backend_class("missing")
    finally:
        base._REGISTRY.pop("missing")
    with pytest.raises(ValueError, match="unknown 'nope'"):
        base.backend_class("nope")


def test_a_leaf_evicted_in_parts_goes_to_the_tier_whole_without_kv_events(tmp_path):
    ids = list(range(900, 940))  # 10 pages
    m = latent_manager()  # no KV events: the tree keeps block hashes for the tiers alone
    tier = make_tier(args(tmp_path, hicache_write_policy="write_back"), m, SINGLE_RANK)
    r = req(ids)
    prefill(m, r)
    want = scribble(m, r, seed=3)
    m.release(r)
    assert m.tree.evict(3) == 3  # the leaf's tail
    assert m.tree.evict(100) == 7  # the rest of it
    r2 = req(ids + [5])
    prefill(m, r2)
    assert r2.kv.cached == 10 and tier.stats["hicache_hits_cpu"] == 10
    assert torch.equal(tier.codec.read([p[:10] for p in r2.kv.pages]), want)
    m.release(r2)
    m.check_integrity([0, 0])
    tier.close()


class _SlowBackend(base.TierBackend):
    """Holds every put until released, so the writer's queue fills."""

    medium = "STORAGE"

    def __init__(self):
        import threading

        self.release = threading.Event()
        self.stored: dict[str, bytes] = {}

    def put(self, key, data):
        self.release.wait(10)
        self.stored[key] = data
        return True

    def get(self, key):
        return self.stored.get(key)

    def exists(self, keys):
        return next((i for i, k in enumerate(keys) if k not in self.stored), len(keys))


def test_a_full_write_queue_drops_and_counts_instead_of_waiting():
    from pdserve.engine.kv_tier.writer import TierWriter

    slow = _SlowBackend()
    w = TierWriter(slow, max_queued=2)
    accepted = [w.submit(f"k/{i:016x}", b"x", i) for i in range(6)]
    # one in the backend's hands, two queued: the rest dropped at once
    assert accepted.count(False) >= 3 and w.dropped == accepted.count(False)
    slow.release.set()
    assert w.flush(10)
    assert sorted(block for _, block, ok in w.done if ok) == [
        i for i, ok in enumerate(accepted) if ok
    ]
    w.close()


def test_a_host_tier_larger_than_the_host_is_refused(tmp_path):
    m = latent_manager()
    with pytest.raises(ValueError, match="hicache_size: a host tier of .* exceeds"):
        make_tier(args(tmp_path, hicache_size=1 << 20), m, SINGLE_RANK)  # a petabyte


def test_an_int8_cache_s_pages_come_back_with_their_scales(tmp_path):
    """The tier's entry of an int8 page holds its per-token scales too: a page back from the
    host tier without them would be dequantized with whatever scales its new page held."""
    groups = group_layers([(FullAttention(2, 8),)] * 2)
    pools = [
        make_pool(g, 16, PAGE, torch.bfloat16, "cpu", quant=kv_quant_for("int8")) for g in groups
    ]
    m = KVCacheManager(groups, pools, PAGE)
    tier = make_tier(args(tmp_path, hicache_storage_backend=None), m, SINGLE_RANK)
    ids = list(range(200, 220))  # 5 full pages
    r = req(ids)
    prefill(m, r)
    gen = torch.Generator().manual_seed(3)
    pool = pools[0]
    pages = torch.tensor(r.kv.pages[0])
    pool.buffer[:, :, pages] = torch.randint(
        -127, 128, pool.buffer[:, :, pages].shape, generator=gen, dtype=torch.int8
    )
    pool.scales[:, :, pages] = torch.rand(pool.scales[:, :, pages].shape, generator=gen) + 0.5
    want = (pool.buffer[:, :, pages].clone(), pool.scales[:, :, pages].clone())
    m.release(r)
    assert m.tree.evict(100) == 5
    pool.buffer.zero_()
    pool.scales.fill_(1.0)
    r2 = req(ids + [7])
    prefill(m, r2)
    assert r2.kv.cached == 5 and tier.stats["hicache_hits_cpu"] == 5
    back = torch.tensor(r2.kv.pages[0][:5])
    assert torch.equal(pool.buffer[:, :, back], want[0])
    assert torch.equal(pool.scales[:, :, back], want[1])
    m.release(r2)
    m.check_integrity([0])
    tier.close()


def test_the_disk_tier_drops_its_least_recently_used_entries_past_its_bound(tmp_path):
    """``--hicache-file-backend-max-gb``: past the bound the entry read or written longest ago
    goes (file and index), reported for KV events; a restarted backend with a lower bound drops
    its oldest files first."""
    from pdserve.engine.kv_tier.file_store import FileTierBackend

    def backend(entries: float) -> FileTierBackend:
        a = args(tmp_path, hicache_file_backend_max_gb=entries * 1000 / 2**30)
        return FileTierBackend(a, "layout", 1000)

    keys = [f"layout/{k:016x}" for k in range(5)]
    b = backend(2.5)  # room for two entries of 1000 bytes
    for k in keys[:3]:
        assert b.put(k, bytes(1000))
        time.sleep(0.01)  # distinct modification times
    assert b.drain_removed() == [keys[0]] and b.exists(keys[1:3]) == 2
    assert not os.path.exists(tmp_path / "layout" / f"{0:016x}.kv")
    assert b.get(keys[1]) is not None  # read: now the most recent
    assert b.put(keys[3], bytes(1000))
    assert b.drain_removed() == [keys[2]] and len(b) == 2 and b.nbytes == 2000
    assert sorted(os.listdir(tmp_path / "layout")) == [f"{1:016x}.kv", f"{3:016x}.kv"]
    b.close()
    b2 = backend(1.5)  # restarted with room for one: the older file goes
    assert b2.drain_removed() == [keys[1]] and b2.exists([keys[3]]) == 1 and len(b2) == 1
    b2.close()


def test_clear_empties_every_tier_and_announces_it(tmp_path):
    """``/flush_cache``'s tier part: the host tier and the disk entries are dropped (each one a
    BlockRemoved of its medium), and the prompt is found nowhere afterwards."""
    ids = list(range(200, 232))  # 8 full pages
    m = latent_manager()
    tier = make_tier(args(tmp_path, hicache_write_policy="write_through"), m, SINGLE_RANK)
    r = req(ids)
    prefill(m, r)
    scribble(m, r, seed=3)
    m.release(r)
    assert tier.flush()
    tier.poll()
    assert m.tree.reset()
    tier.clear()
    hashes = chain_hashes(None, ids, PAGE)
    removed = {}
    for e in tier.poll():
        assert isinstance(e, BlockRemoved), e
        removed.setdefault(e.medium, set()).update(e.block_hashes)
    assert removed == {"CPU": set(hashes), "STORAGE": set(hashes)}
    assert not [f for d in os.listdir(tmp_path) for f in os.listdir(tmp_path / d)]
    r2 = req(ids + [1])
    prefill(m, r2)
    assert r2.kv.cached == 0 and tier.stats["hicache_hits_cpu"] == 0
    m.release(r2)
    tier.close()
