"""``KVCacheManager``: the one owner of every page and slot of every cache group, and of the
prefix cache.

The scheduler and the PD queues change a request's KV only through it: ``admit`` (match the
prefix cache, take what the first chunk needs), ``grow`` (pages for the next chunk or token),
``release`` (full pages into the prefix cache, the rest freed), ``park`` / ``free`` (decode PD:
items that a prefill may still write are held until it cannot), ``prealloc`` (decode PD: items
for a prompt whose KV comes from prefill), ``send_pages`` and ``transfer_counts`` (prefill PD:
what to send, and how much in all).

Cache groups (``kv_spec``): each group has its own pool and allocator, and a request holds its
items of each group in ``Req.kv`` (a ``KVSlots``). How a group's items behave is its kind's policy
(``engine/cache_policy.py``): a full-attention group keeps a page per logical page; a
sliding-window group frees, before each forward, the pages its next query can no longer see; a
per-request group (a recurrent state) holds a slot from admission to the end, and with the
prefix cache on a second one, the snapshot of its state at the last page boundary it crossed,
which goes into the tree on the last full page when the request ends; a hit restores the live
slot from the snapshot at the end of the match (``restore``); a group of compressed entries holds
an item only on the logical pages where a window closes (0 on the others, laid out by its policy's
``extend``). The anchor group, the first paged one with an item on every page, counts a request's
logical pages and is group 0 of the prefix tree; the tree keys the cacheable groups only.

Namespaces: KV computed for a sequence of n tokens belongs to the prefix tree's namespace of n
(``namespace``, the model's ``prefix_namespace``: 0 for every length but past LongRoPE's original
context). A request matches in the namespace of the sequence it computes (its prompt, or prompt
and output when recomputed) and its pages go back into the one they were computed in
(``KVSlots.namespace``); a request whose sequence grows into another namespace is ``stale``.

Only the scheduler loop calls it; not thread-safe.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

from pdserve.engine.cache_kinds import policy_for
from pdserve.engine.cache_policy import CachePolicy
from pdserve.engine.kv_pool import BaseKVPool
from pdserve.engine.radix_cache import RadixCache
from pdserve.engine.request import KVSlots, Req
from pdserve.kv_spec import CacheGroup, anchor_group


class KVCacheManager:
    def __init__(
        self,
        groups: list[CacheGroup],
        pools: list[BaseKVPool],
        page_size: int,
        disable_radix_cache: bool = False,
        namespace: Optional[Callable[[int], int]] = None,
    ):
        self.groups = groups
        self.namespace = namespace or (lambda seq_len: 0)
        self.page_size = page_size
        self.specs = [g.spec for g in groups]
        self.allocators = [p.allocator for p in pools]
        self.pools = pools
        self.policies: list[CachePolicy] = [
            policy_for(s, page_size, prefix_cache=not disable_radix_cache) for s in self.specs
        ]
        self.anchor = anchor_group(groups)  # counts a request's logical pages
        # the prefix tree keys the cacheable groups (anchor first); a prefix is of no use while a
        # group cannot keep what a hit needs, so then it caches nothing
        cacheable = [g for g, p in enumerate(self.policies) if p.cacheable]
        self.cached_groups = sorted(cacheable, key=lambda g: g != self.anchor)
        self._tree_index = {g: i for i, g in enumerate(self.cached_groups)}
        assert self.cached_groups[0] == self.anchor, "the anchor is the prefix tree's group 0"
        usable = all(p.cacheable for p in self.policies)
        self.restored = 0  # hits that restored a request's state from a snapshot
        self.tree = RadixCache(
            [self.allocators[g] for g in self.cached_groups],
            page_size,
            disable=disable_radix_cache or not usable,
            specs=[self.specs[g] for g in self.cached_groups],
        )
        # groups that drop pages: their first live page moves with the sequence
        self.windowed = [g for g, p in enumerate(self.policies) if p.drops_pages]
        self.tier = None  # the tiers below the pool (``kv_tier.KVTier.attach``)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def _pages(self, tokens: int) -> int:
        return (tokens + self.page_size - 1) // self.page_size

    def _group_name(self, g: int) -> str:
        return f" of cache group {g} ({self.groups[g].kind})" if self.num_groups > 1 else ""

    # ---- capacity ------------------------------------------------------------------------------
    def available(self, group: Optional[int] = None) -> int:
        """Items of ``group`` (default: the anchor) that can be had now (free, or evictable from
        the prefix cache)."""
        g = self.anchor if group is None else group
        t = self._tree_index.get(g)
        return self.allocators[g].num_free() + (0 if t is None else self.tree.evictable_pages(t))

    def reserve_of(self, group: int, pages: int) -> int:
        """What a reserve of ``pages`` pages for running requests means in ``group``: those pages
        in a paged group, nothing in a per-request one (a running request has its slot)."""
        return pages if self.policies[group].paged else 0

    def capacity_error(self, seq_len: int, chunk: int) -> str:
        """Why a request of ``seq_len`` tokens can never fit ("" when it can)."""
        for g, alloc in enumerate(self.allocators):
            need = self.policies[g].peak(seq_len, chunk)
            if need > alloc.capacity:
                unit = "KV pages" if self.policies[g].paged else "state slots"
                return f"needs {need} {unit}{self._group_name(g)}, the pool has {alloc.capacity}"
        return ""

    # ---- allocation ----------------------------------------------------------------------------
    def _alloc(self, group: int, n: int) -> Optional[list[int]]:
        alloc = self.allocators[group]
        items = alloc.alloc(n)
        t = self._tree_index.get(group)
        if items is None and n > 0 and t is not None:
            self.tree.evict(n - alloc.num_free(), t)
            items = alloc.alloc(n)
        return items

    def take(self, counts: list[int]) -> Optional[list[list[int]]]:
        """``counts[g]`` items of each group, all or nothing."""
        got: list[list[int]] = []
        for g, n in enumerate(counts):
            items = self._alloc(g, n)
            if items is None:
                self.free(got)
                return None
            got.append(items)
        return got

    def free(self, items: Iterable[list[int]]) -> None:
        """Give items back, per group (0s are skipped)."""
        for alloc, ids in zip(self.allocators, items):
            held = [p for p in ids if p]
            if held:
                alloc.free(held)

    def slide(self, req: Req) -> None:
        """Drop the pages of windowed groups that ``req``'s next query cannot see; pages of the
        prefix cache are only let go of (the tree keeps them)."""
        kv = req.kv
        for g in self.windowed:
            lo = min(self.policies[g].live_from(req.kv_len), kv.num_pages)
            ids, own = kv.pages[g], []
            for i in range(kv.live_from[g], lo):
                if ids[i] and i >= kv.cached:
                    own.append(ids[i])
                ids[i] = 0
            kv.live_from[g] = max(kv.live_from[g], lo)
            if own:
                self.allocators[g].free(own)

    def _needs(self, kv: KVSlots, tokens: int) -> list[int]:
        return [p.need(len(ids), tokens) for p, ids in zip(self.policies, kv.pages)]

    def grow(self, req: Req, ext: int) -> bool:
        """What tokens ``kv_len .. kv_len + ext`` of ``req`` need in every group; False (nothing
        taken) when a group is out of room."""
        self.slide(req)
        tokens = req.kv_len + ext
        counts = self._needs(req.kv, tokens)
        if not any(counts):  # the anchor takes a page whenever the logical pages grow
            return True
        got = self.take(counts)
        if got is None:
            return False
        for policy, ids, items in zip(self.policies, req.kv.pages, got):
            policy.extend(ids, items, tokens)
        return True

    def namespace_of(self, req: Req, seq_len: int) -> int:
        """The prefix tree's namespace of ``req``'s KV for a sequence of ``seq_len`` tokens: the
        model's for that length, within its LoRA adapter's (``Req.lora_key``; 0: the base
        model's)."""
        return self.namespace(seq_len) + req.lora_key

    def cached_pages(self, req: Req, max_pages: int) -> int:
        """Pages of ``req``'s prefix the tree holds (no lock taken; LRU times refreshed)."""
        pages, _ = self.tree.match_prefix(
            req.cache_ids, max_pages=max_pages, namespace=self.namespace_of(req, req.seq_len)
        )
        return len(pages)

    def stale(self, req: Req) -> bool:
        """Whether ``req``'s sequence has grown past what its KV was computed for (it must be
        computed again)."""
        return req.kv is not None and self.namespace_of(req, req.seq_len) != req.kv.namespace

    def _match(
        self, token_ids: list[int], max_pages: int, namespace: int
    ) -> tuple[list[list[int]], object, list[int]]:
        """The prefix tree's longest usable prefix: the pages per paged group (none for the
        groups the tree does not key), its node, and per group the tree's item a hit restores
        the request's own from (0: none)."""
        found, node = self.tree.match_groups(token_ids, max_pages=max_pages, namespace=namespace)
        pages, restore = [], []
        for g, policy in enumerate(self.policies):
            ids = list(found[self._tree_index[g]]) if g in self._tree_index else []
            pages.append(ids if policy.paged else [])
            restore.append(policy.restore_from(ids))
        return pages, node, restore

    def admit(self, req: Req, budget: int, reserve: int, max_pages: int) -> bool:
        """Match ``req``'s prefix (at most ``max_pages`` pages) and take what up to ``budget``
        tokens past it need, keeping ``reserve`` pages of each paged group for running requests.
        False (nothing held) when it does not fit now."""
        namespace = self.namespace_of(req, req.seq_len)
        if self.tier is not None:  # the match continues below the pool
            self.tier.fill(self, req.cache_ids, max_pages, namespace)
        pages, node, restore = self._match(req.cache_ids, max_pages, namespace)
        self.tree.inc_lock(node)
        cached = len(pages[self.anchor])
        req.kv = KVSlots(
            pages, cached, node, [0] * self.num_groups, self.anchor, namespace=namespace
        )
        req.kv_len = req.kv.computed_from = cached * self.page_size
        ext = min(req.extend_len, budget)
        needs = self._needs(req.kv, req.kv_len + ext)
        if any(
            self.available(g) < n + self.reserve_of(g, reserve) for g, n in enumerate(needs)
        ) or not self.grow(req, ext):
            self.tree.dec_lock(node)
            req.kv, req.kv_len = None, 0
            return False
        for g, src in enumerate(restore):
            if src and cached:  # the request continues from the state at the end of the hit
                self.pools[g].copy_slot(src, req.kv.pages[g][0])
                self.restored += 1
        return True

    def draft_computed(self, req: Req, upto: int) -> None:
        """A speculative draft's KV of ``req``, kept in its pages, now covers the positions
        before ``upto`` (``KVSlots.draft_len``; the prefix cache takes pages only up to it)."""
        if req.kv is not None:
            req.kv.draft_len = upto

    def release(self, req: Req) -> None:
        """``req`` is done with its KV (finished or retracted): its full pages go into the prefix
        cache (tombstones where a window dropped them), the rest back to the pools."""
        kv = req.kv
        if kv is None:
            return
        # a draft model's KV may lag the target's by a token or two (``KVSlots.draft_len``)
        length = req.kv_len if kv.draft_len is None else min(req.kv_len, kv.draft_len)
        full = min(length // self.page_size, kv.num_pages)
        full = min(
            [full]
            + [
                self.policies[g].insertable(full, length, kv.computed_from)
                for g in self.cached_groups
            ]
        )
        kept = 0  # logical pages the tree took, in every cacheable group
        given: list[list[int]] = [[] for _ in range(self.num_groups)]
        if full > 0 and not self.tree.disable:
            kept = full
            for g in self.cached_groups:
                given[g] = self.policies[g].tree_items(kv.pages[g], full, length, kv.computed_from)
            cached = [given[g] for g in self.cached_groups]
            self.tree.insert(
                req.cache_ids[: full * self.page_size],
                cached[0],
                cached[1:],
                namespace=kv.namespace,
            )
        self.free(
            self.policies[g].released(
                ids, max(kept, kv.cached) if g in self._tree_index else 0, given[g]
            )
            for g, ids in enumerate(kv.pages)
        )
        if kv.node is not None:
            self.tree.dec_lock(kv.node)
        req.kv, req.kv_len = None, 0

    def _owned(self, kv: KVSlots) -> list[list[int]]:
        return [p.owned(ids, kv.cached) for p, ids in zip(self.policies, kv.pages)]

    def park(self, req: Req) -> list[list[int]]:
        """Let go of ``req``'s KV without caching it and return the items it owned, which the
        caller frees (``free``) once nothing can write into them any more."""
        kv = req.kv
        if kv is None:
            return [[] for _ in range(self.num_groups)]
        own = self._owned(kv)
        if kv.node is not None:
            self.tree.dec_lock(kv.node)
        req.kv, req.kv_len = None, 0
        return own

    # ---- disaggregation ------------------------------------------------------------------------
    def transfer_start(self, group: int, prompt_len: int, decode_prefix: int) -> int:
        """The first item (logical page) of ``group`` that prefill sends for a prompt of
        ``prompt_len`` tokens when decode already holds ``decode_prefix`` pages."""
        return self.policies[group].transfer_start(prompt_len, decode_prefix)

    def transfer_counts(self, prompt_len: int, decode_prefix: int) -> list[int]:
        """Items per group that prefill sends, and decode preallocates, for that prompt."""
        return [p.transfer_count(prompt_len, decode_prefix) for p in self.policies]

    def sent_with_chunks(self, group: int) -> bool:
        """Whether ``group``'s items are final after each chunk (full attention) or only after
        the last one (a window still drops pages, a state still changes)."""
        return self.policies[group].sent_with_chunks

    def prealloc(self, req: Req, reserve: int) -> Optional[tuple[list[list[int]], int]]:
        """Decode: items for ``req``'s whole prompt, whose KV prefill will write. The leading
        pages this server's prefix cache holds are kept (locked) and not sent; windowed groups
        get pages only where their window at the end of the prompt reaches. Returns (the new
        items per group, in logical order from ``transfer_start``; the cached prefix in pages),
        or None (nothing held) when a group lacks room beyond ``reserve`` pages."""
        n = req.seq_len  # the prompt (and, for a request moved mid-generation, its output so far)
        namespace = self.namespace_of(req, n)  # prefill computes the prompt
        if self.tier is not None:
            self.tier.fill(self, req.cache_ids, (n - 1) // self.page_size, namespace)
        pages, node, _ = self._match(req.cache_ids, (n - 1) // self.page_size, namespace)
        cached = len(pages[self.anchor])
        node = node if cached else None
        counts = self.transfer_counts(n, cached)
        starts = [self.transfer_start(g, n, cached) for g in range(self.num_groups)]
        # items to take: those of the pages prefill writes (only the pages that hold one), and of
        # its own beyond them (a state's snapshot slot)
        takes = [
            p.need(start, n) if p.paged else c + p.need(c, n)
            for p, start, c in zip(self.policies, starts, counts)
        ]
        if any(self.available(g) < t + self.reserve_of(g, reserve) for g, t in enumerate(takes)):
            return None
        if node is not None:
            self.tree.inc_lock(node)  # before taking pages: taking may evict
        got = self.take(takes)
        if got is None:
            if node is not None:
                self.tree.dec_lock(node)
            return None
        items = []
        for p, ids, start, new in zip(self.policies, pages, starts, got):
            ids = ids + [0] * (start - cached) if p.paged else ids
            p.extend(ids, new, n)
            items.append(ids)
        req.kv = KVSlots(
            items,
            cached,
            node,
            [0] * self.num_groups,
            self.anchor,
            computed_from=n,  # decode computes from the end of the prompt on
            namespace=namespace,
        )
        return [
            p.sent(ids, start, None) for p, ids, start in zip(self.policies, items, starts)
        ], cached

    def send_pages(self, req: Req, group: int, start: int, end: Optional[int] = None) -> list[int]:
        """``req``'s items of ``group`` at ``start .. end`` that prefill sends (logical pages; a
        state's live slot is item 0)."""
        return self.policies[group].sent(req.kv.pages[group], start, end)

    # ---- accounting ----------------------------------------------------------------------------
    def in_use(self, reqs: Iterable[Req]) -> list[int]:
        """Items per group that ``reqs`` own (not the prefix cache's)."""
        out = [0] * self.num_groups
        for r in reqs:
            if r.kv is not None:
                for g, own in enumerate(self._owned(r.kv)):
                    out[g] += len(own)
        return out

    def held(self, req: Req) -> list[int]:
        """Items per group ``req`` holds (its own and the cached prefix's), 0s not counted."""
        if req.kv is None:
            return [0] * self.num_groups
        return [sum(1 for p in ids if p) for ids in req.kv.pages]

    def check_integrity(self, in_use: list[int]) -> dict:
        """Assert free + cached + in use == capacity in every group; the anchor group's counts
        (and per group when there are several)."""
        self.tree.check_integrity([in_use[g] for g in self.cached_groups])
        for g, alloc in enumerate(self.allocators):
            if g not in self._tree_index:
                free, cap = alloc.num_free(), alloc.capacity
                assert free + in_use[g] == cap, (
                    f"leak{self._group_name(g)}: free {free} + in use {in_use[g]} = "
                    f"{free + in_use[g]} != capacity {cap}"
                )

        def counts(g: int, alloc) -> dict:
            t = self._tree_index.get(g)
            return {
                "total_pages": alloc.capacity,
                "free_pages": alloc.num_free(),
                "cached_pages": 0 if t is None else self.tree.total_pages(t),
                "in_use_pages": in_use[g],
            }

        info = counts(self.anchor, self.allocators[self.anchor])
        if self.num_groups > 1:
            info["groups"] = [
                {"kind": grp.kind, "layers": len(grp.layers), **counts(grp.id, a)}
                for grp, a in zip(self.groups, self.allocators)
            ]
        return info
