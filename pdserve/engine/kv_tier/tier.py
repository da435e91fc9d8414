"""``KVTier``: the tiers below the pool (SGLang's hierarchical cache): host memory, then a
storage backend (disk, or a store registered in ``kv_tier.base``).

- Writing: a page leaves the pool (``write_back``: when the prefix cache evicts it) or enters the
  prefix cache (``write_through``: when it is inserted); its bytes (``PageCodec``) are framed
  (``entry``), put into the host tier at once and queued for the storage backend's writer thread
  (``TierWriter``). The copy out of the pool is synchronous (a memcpy on a CPU server; on a GPU a
  device-to-host copy the scheduler waits for).
- Reading (``fetch``): after the pool's match, a prompt's next pages are looked up by block hash,
  host first, then storage; an entry is checked (checksum, layout, the page's tokens and parent)
  and one that fails is counted, logged, removed and treated as a miss. The cache manager puts
  what is found into pool pages and the prefix tree (a synchronous load).
- KV events: an entry stored into a tier is a ``BlockStored`` with that tier's medium ("CPU",
  "STORAGE"), one dropped from it a ``BlockRemoved`` with it; the pool's own events keep no
  medium (vLLM's "GPU"), as before. A storage entry is announced when its write has finished,
  and those found at start are announced then.

Only the scheduler loop calls it (the writer thread only touches its backend and queues).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from pdserve.engine.cache_policy import FullAttentionPolicy
from pdserve.engine.kv_budget import available_host_bytes
from pdserve.engine.kv_tier import entry
from pdserve.engine.kv_tier.base import TierBackend, create_backend
from pdserve.engine.kv_tier.host import HostTierBackend
from pdserve.engine.kv_tier.pages import PageCodec, layout_key
from pdserve.engine.kv_tier.writer import TierWriter
from pdserve.kv_events import BlockRemoved, BlockStored, chain_hashes

logger = logging.getLogger(__name__)

STAT_KEYS = (
    "hits",  # pages found, per medium
    "hit_tokens",
    "writes",  # entries stored, per medium
    "corrupt",  # entries that failed their check, per medium
)


class KVTier:
    """The tiers of one rank. Under TP and DP attention each rank keeps its own (its share of a
    page's heads, under a layout key of its rank); the ranks that share a scheduler load as many
    pages as the one that found fewest (``group``), so they take the same decisions."""

    def __init__(self, args, groups, pools, layout_key: str, group=None):
        self.group = group  # the ranks running this scheduler (a TPGroup), None: one
        self.page_size = args.page_size
        self.layout_key = layout_key
        self.codec = PageCodec(pools)
        self.write_through = args.hicache_write_policy == "write_through"
        nbytes = self.codec.page_nbytes
        slot = nbytes + entry.header_nbytes(layout_key, self.page_size)
        if args.hicache_size:
            capacity = int(args.hicache_size * 2**30) // slot
        else:
            capacity = int(args.hicache_ratio * pools[0].allocator.capacity)
        flag = "hicache_size" if args.hicache_size else "hicache_ratio"
        if capacity < 1:
            raise ValueError(
                f"{flag}: the host tier would hold {capacity} pages of {slot} bytes; give it "
                "room for at least one"
            )
        available = available_host_bytes()
        if capacity * slot > available:
            raise ValueError(
                f"{flag}: a host tier of {capacity} pages ({capacity * slot / 2**30:.1f} GiB) "
                f"exceeds this host's available memory ({available / 2**30:.1f} GiB); lower "
                "--hicache-ratio or give --hicache-size in GB"
            )
        self.host = HostTierBackend(args, layout_key, nbytes, capacity=capacity)
        self.storage: Optional[TierBackend] = None
        self.writer: Optional[TierWriter] = None
        if args.hicache_storage_backend:
            self.storage = create_backend(args.hicache_storage_backend, args, layout_key, nbytes)
            self.writer = TierWriter(self.storage, args.hicache_storage_write_queue)
        self.tiers = [b for b in (self.host, self.storage) if b is not None]
        self.stats = {f"hicache_{k}_{b.medium.lower()}": 0 for k in STAT_KEYS for b in self.tiers}
        if self.storage is not None:  # entries dropped past its bound
            self.stats[f"hicache_evictions_{self.storage.medium.lower()}"] = 0
        # block hash -> (parent, tokens) of what each medium holds (the snapshot's blocks)
        self.blocks: dict[str, dict[int, tuple[Optional[int], list[int]]]] = {
            b.medium: {} for b in self.tiers
        }
        self._pending: set[int] = set()  # queued for storage
        self.events: list = []  # collected until the prefix tree's list takes them
        if self.storage is not None:
            self._announce_existing()
        logger.info(
            "hierarchical cache: host tier of %d pages (%.1f MiB), %s, storage %s, layout %s",
            capacity,
            capacity * slot / 2**20,
            args.hicache_write_policy,
            args.hicache_storage_backend or "none",
            layout_key,
        )

    def key(self, h: int) -> str:
        return f"{self.layout_key}/{h:016x}"

    def _hash_of(self, key: str) -> int:
        return int(key.rpartition("/")[2], 16)

    def _announce_existing(self) -> None:
        size = entry.header_nbytes(self.layout_key, self.page_size)
        for key, header in self.storage.startup_entries(size):
            block = entry.read_block(self.layout_key, header)
            if block is not None:
                self._stored(self.storage.medium, self._hash_of(key), block[0], block[1])

    # ---- events and bookkeeping -----------------------------------------------------------------
    def _stored(self, medium: str, h: int, parent: Optional[int], tokens: list[int]) -> None:
        self.blocks[medium][h] = (parent, tokens)
        self.events.append(
            BlockStored(
                block_hashes=[h],
                parent_block_hash=parent,
                token_ids=list(tokens),
                block_size=self.page_size,
                medium=medium,
            )
        )

    def _removed(self, medium: str, hashes: list[int]) -> None:
        gone = [h for h in hashes if self.blocks[medium].pop(h, None) is not None]
        if gone:
            self.events.append(BlockRemoved(block_hashes=gone, medium=medium))

    def _sync(self) -> None:
        """Take in what happened off the scheduler's path: host entries dropped for room,
        finished storage writes, storage entries dropped past its bound (taken before the
        writes: an entry's write is done before a later write can drop it)."""
        dropped = self.host.drain_removed()
        if dropped:
            self._removed(self.host.medium, [self._hash_of(k) for k in dropped])
        if self.writer is not None:
            medium = self.storage.medium
            evicted = self.storage.drain_removed()
            while self.writer.done:
                key, (h, parent, tokens), ok = self.writer.done.popleft()
                self._pending.discard(h)
                if ok:
                    self.stats[f"hicache_writes_{medium.lower()}"] += 1
                    self._stored(medium, h, parent, tokens)
            if evicted:
                self.stats[f"hicache_evictions_{medium.lower()}"] += len(evicted)
                self._removed(medium, [self._hash_of(k) for k in evicted])

    def poll(self) -> list:
        """The events collected since the last call."""
        self._sync()
        events, self.events = self.events, []
        return events

    def snapshot(self) -> list[BlockStored]:
        return [
            BlockStored(
                block_hashes=[h],
                parent_block_hash=parent,
                token_ids=list(tokens),
                block_size=self.page_size,
                medium=medium,
            )
            for medium, blocks in self.blocks.items()
            for h, (parent, tokens) in blocks.items()
        ]

    def counters(self) -> dict:
        out = dict(self.stats)
        out["hicache_entries_cpu"] = len(self.host)
        if self.writer is not None:
            medium = self.storage.medium.lower()
            out[f"hicache_entries_{medium}"] = len(self.blocks[self.storage.medium])
            out[f"hicache_write_drops_{medium}"] = self.writer.dropped
            out[f"hicache_write_failures_{medium}"] = self.writer.failed
        return out

    # ---- writing --------------------------------------------------------------------------------
    def store(self, parent: Optional[int], hashes, tokens, pages: list[list[int]]) -> None:
        """Pages of one run (block ``hashes[i]``, its ``tokens[i*ps:(i+1)*ps]``, its page id
        ``pages[g][i]`` in each group; ``parent``: the hash before the first) go to the tiers."""
        ps = self.page_size
        self._sync()
        todo = []
        for i, h in enumerate(hashes):
            fresh_host = h not in self.blocks["CPU"]
            fresh_storage = self.writer is not None and not (
                h in self.blocks[self.storage.medium] or h in self._pending
            )
            if fresh_host or fresh_storage:
                todo.append((i, fresh_host, fresh_storage))
        if not todo:
            return
        rows = self.codec.read([[ids[i] for i, _, _ in todo] for ids in pages]).numpy()
        for row, (i, fresh_host, fresh_storage) in zip(rows, todo):
            h, prev = hashes[i], hashes[i - 1] if i else parent
            page_tokens = list(tokens[i * ps : (i + 1) * ps])
            data = entry.pack(self.layout_key, prev, page_tokens, row.data)
            if fresh_host and self.host.put(self.key(h), data):
                self.stats["hicache_writes_cpu"] += 1
                self._stored("CPU", h, prev, page_tokens)
            if fresh_storage and self.writer.submit(self.key(h), data, (h, prev, page_tokens)):
                self._pending.add(h)

    # ---- reading --------------------------------------------------------------------------------
    def fetch(self, parent: Optional[int], tokens, max_pages: int) -> tuple[list, torch.Tensor]:
        """The leading pages of ``tokens`` (chained from ``parent``) that a tier holds, at most
        ``max_pages``: their mediums and their bytes (``[n, page_nbytes]``). The storage
        backend is asked once how far its run of those pages goes (``exists``), then read
        page by page where the host tier misses."""
        ps = self.page_size
        hashes = chain_hashes(parent, tokens[: max_pages * ps], ps)
        keys = [self.key(h) for h in hashes]
        stored_until = None  # pages [.., stored_until) are in storage, by its ``exists``
        found, payloads = [], []
        for i, h in enumerate(hashes):
            above = hashes[i - 1] if i else parent
            page_tokens = list(tokens[i * ps : (i + 1) * ps])
            got = self._lookup(self.host, h, above, page_tokens)
            if got is None and self.storage is not None:
                if stored_until is None:
                    stored_until = i + self._exists(keys[i:])
                if i < stored_until:
                    got = self._lookup(self.storage, h, above, page_tokens)
            if got is None:
                break
            found.append(got[0])
            payloads.append(got[1])
        rows = torch.empty((len(payloads), self.codec.page_nbytes), dtype=torch.uint8)
        for row, payload in zip(rows.numpy(), payloads):
            row[:] = payload
        return found, rows

    def _exists(self, keys: list[str]) -> int:
        try:
            return self.storage.exists(keys)
        except Exception:  # a backend must not raise; one that does is taken as empty
            logger.exception("%s tier: exists failed", self.storage.medium)
            return 0

    def count_hits(self, found: list[str]) -> None:
        """Pages of ``fetch`` that went into the pool, by medium."""
        for medium in found:
            self.stats[f"hicache_hits_{medium.lower()}"] += 1
            self.stats[f"hicache_hit_tokens_{medium.lower()}"] += self.page_size

    def _lookup(self, backend: TierBackend, h: int, parent: Optional[int], tokens: list[int]):
        """(medium, payload) of block ``h`` in ``backend`` if it holds an intact entry of it; a
        corrupt one (or another block's) is counted, logged, removed and a miss."""
        key = self.key(h)
        try:
            data = backend.get(key)
        except Exception:  # a backend must not raise; one that does misses
            logger.exception("%s tier: get %s failed", backend.medium, key)
            return None
        if data is None:
            return None
        e = entry.unpack(self.layout_key, data)
        if (
            e is not None
            and e.tokens == tokens
            and e.parent == parent
            and len(e.payload) == self.codec.page_nbytes
        ):
            return backend.medium, e.payload
        medium = backend.medium
        self.stats[f"hicache_corrupt_{medium.lower()}"] += 1
        logger.warning("%s tier: entry %s is corrupt or not this block's; dropped", medium, key)
        backend.remove(key)
        self._removed(medium, [h])
        return None

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait for queued storage writes (tests, shutdown)."""
        return self.writer is None or self.writer.flush(timeout)

    def clear(self) -> None:
        """Drop every entry of every tier (``/flush_cache``): the host tier's, and once the
        queued writes have landed, the storage entries this tier knows (its own and those it
        found at start); each announced as removed."""
        self.flush()
        self._sync()
        for backend in self.tiers:
            hashes = list(self.blocks[backend.medium])
            for h in hashes:
                backend.remove(self.key(h))
            self._removed(backend.medium, hashes)

    # ---- the cache manager's side ---------------------------------------------------------------
    def attach(self, kv) -> None:
        """Pages ``kv``'s prefix tree evicts (and with write_through, those it takes) come here;
        its matches continue here (``fill``). Called again with a new manager when the pools
        are reallocated (a role switch): the pages are read from and written to its pools."""
        codec = PageCodec([kv.pools[g] for g in kv.cached_groups])
        assert codec.page_nbytes == self.codec.page_nbytes, "the pools' page layout changed"
        self.codec = codec
        kv.tier = self
        kv.tree.hashing = True
        kv.tree.on_evict = self._from_tree
        if self.write_through:
            kv.tree.on_insert = self._from_tree

    def _from_tree(self, node, start: int) -> None:
        """Pages ``start..`` of tree node ``node`` (every group's ids) leave the pool or enter
        the tree."""
        above = node.hashes[start - 1] if start else (node.parent.hashes or [None])[-1]
        tokens = node.key[start * self.page_size :]
        pages = [ids[start:] for ids in node.groups()]
        try:
            assert len(node.hashes) - start == len(pages[0]), f"{node!r}: {node.hashes}"
            self.store(above, node.hashes[start:], tokens, pages)
        except Exception:  # the tiers are a cache: a failed copy loses it, never the server
            self.stats["hicache_store_errors"] = self.stats.get("hicache_store_errors", 0) + 1
            logger.exception("writing %d pages to the tiers failed", len(pages[0]))

    def fill(self, kv, token_ids: list[int], max_pages: int, namespace: int) -> None:
        """Continue ``kv``'s tree match of ``token_ids`` (at most ``max_pages``) into the tiers:
        the pages found are loaded into new pool pages (synchronously) and inserted into the
        tree, where the caller's match finds them."""
        tree, ps = kv.tree, self.page_size
        limit = min(len(token_ids) // ps, max_pages)
        if tree.disable or limit <= 0:
            return
        found, node = tree.match_groups(token_ids, max_pages=limit, namespace=namespace)
        k = len(found[0])
        if k >= limit:
            return
        above = node.hashes[-1] if node.hashes else None
        mediums, rows = self.fetch(above, token_ids[k * ps :], limit - k)
        n = self._agree(len(mediums))
        mediums, rows = mediums[:n], rows[:n]
        if not mediums:
            return
        tree.inc_lock(node)  # taking pages may evict: not the prefix being extended
        got = kv.take([len(mediums) if g in kv.cached_groups else 0 for g in range(kv.num_groups)])
        tree.dec_lock(node)
        if got is None:
            return
        new = [got[g] for g in kv.cached_groups]
        try:
            self.codec.write(new, rows)
        except Exception:  # the pages go back; the prompt is computed as if nothing was found
            kv.free(got)
            logger.exception("loading %d pages from the tiers failed", len(mediums))
            return
        pages = [old + ids for old, ids in zip(found, new)]
        tree.insert(token_ids[: (k + len(mediums)) * ps], pages[0], pages[1:], namespace=namespace)
        self.count_hits(mediums)

    def _agree(self, n: int) -> int:
        """The pages every rank of the scheduler's group found (a tier's contents may differ
        between ranks: a dropped or failed write, a corrupt entry): the fewest."""
        if self.group is None or self.group.size == 1:
            return n
        import torch.distributed as dist

        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group.cpu_group)
        return int(t.item())

    def close(self) -> None:
        """Finish the queued storage writes (at most a few seconds), then release the tiers."""
        if self.writer is not None:
            self.writer.close()
        for b in self.tiers:
            b.close()


def make_tier(args, kv, par) -> Optional[KVTier]:
    """The tiers of ``args`` (``--enable-hierarchical-cache``) attached to cache manager ``kv``;
    None when off. Only models whose every cache group keeps every page (full attention, a
    latent, an indexer's keys) are served: a window's or a recurrent state's cache is not a
    function of a page's tokens alone, so those models are refused."""
    if not args.enable_hierarchical_cache:
        return None
    if kv.tree.disable:
        logger.warning("hierarchical cache off: this server keeps no prefix cache")
        return None
    others = sorted(
        {g.kind for g, p in zip(kv.groups, kv.policies) if type(p) is not FullAttentionPolicy}
    )
    if others:
        raise ValueError(
            "enable_hierarchical_cache: the tiers keep pages of full-attention caches only; "
            f"this model also has {', '.join(others)} cache groups"
        )
    groups = [kv.groups[g] for g in kv.cached_groups]
    pools = [kv.pools[g] for g in kv.cached_groups]
    key = layout_key(args, groups, pools, par.attn.rank, par.attn.size)
    tier = KVTier(args, groups, pools, key, par.sched)
    tier.attach(kv)
    return tier
