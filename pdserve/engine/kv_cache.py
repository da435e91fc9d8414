"""``KVCacheManager``: the one owner of every page of every cache group, and of the prefix cache.

The scheduler and the PD queues change a request's KV only through it: ``admit`` (match the
prefix cache, take pages for the first chunk), ``grow`` (pages for the next chunk or token),
``release`` (full pages into the prefix cache, the rest freed), ``park`` / ``free`` (decode PD:
pages that a prefill may still write are held until it cannot), ``prealloc`` (decode PD: pages for
a prompt whose KV comes from prefill) and ``send_pages`` (prefill PD: what to send after a chunk).

Cache groups (``kv_spec``): each group has its own pool and allocator, and a request holds one
page id per group for every logical page (``Req.kv``, a ``KVSlots``). Every group advances
together; a sliding-window group frees, before each forward, the pages its next query can no
longer see (``CacheSpec.first_live_page``), so a long request holds only its window there. In PD
a full-attention group's pages travel with every chunk; a windowed group's travel once, after
the last chunk, and only those its window covers at the end of the prompt (``transfer_start``).

Only the scheduler loop calls it; not thread-safe.
"""

from __future__ import annotations

from typing import Iterable, Optional

from pdserve.engine.kv_pool import KVPool
from pdserve.engine.radix_cache import RadixCache
from pdserve.engine.request import KVSlots, Req
from pdserve.kv_spec import CacheGroup


class KVCacheManager:
    def __init__(
        self,
        groups: list[CacheGroup],
        pools: list[KVPool],
        page_size: int,
        disable_radix_cache: bool = False,
    ):
        self.groups = groups
        self.pools = pools
        self.page_size = page_size
        self.specs = [g.spec for g in groups]
        self.allocators = [p.allocator for p in pools]
        self.tree = RadixCache(
            self.allocators, page_size, disable=disable_radix_cache, specs=self.specs
        )
        # groups that drop pages: their first live page moves with the sequence
        self.windowed = [g.id for g in groups if g.spec.drops_pages]

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def _pages(self, tokens: int) -> int:
        return (tokens + self.page_size - 1) // self.page_size

    # ---- capacity ------------------------------------------------------------------------------
    def available(self, group: int) -> int:
        """Pages of ``group`` that can be had now (free, or evictable from the prefix cache)."""
        return self.allocators[group].num_free() + self.tree.evictable_pages(group)

    def capacity_error(self, seq_len: int, chunk: int) -> str:
        """Why a request of ``seq_len`` tokens can never fit ("" when it can)."""
        for g, alloc in enumerate(self.allocators):
            need = self.specs[g].peak_pages(seq_len, chunk, self.page_size)
            if need > alloc.capacity:
                what = f" of cache group {g} ({self.groups[g].kind})" if self.num_groups > 1 else ""
                return f"needs {need} KV pages{what}, the pool has {alloc.capacity}"
        return ""

    # ---- allocation ----------------------------------------------------------------------------
    def _alloc(self, group: int, n: int) -> Optional[list[int]]:
        alloc = self.allocators[group]
        pages = alloc.alloc(n)
        if pages is None and n > 0:
            self.tree.evict(n - alloc.num_free(), group)
            pages = alloc.alloc(n)
        return pages

    def _take(self, counts: list[int]) -> Optional[list[list[int]]]:
        """``counts[g]`` pages of each group, all or nothing."""
        got: list[list[int]] = []
        for g, n in enumerate(counts):
            pages = self._alloc(g, n)
            if pages is None:
                self.free(got)
                return None
            got.append(pages)
        return got

    def free(self, pages: Iterable[list[int]]) -> None:
        """Give pages back, per group (0s are skipped)."""
        for alloc, ids in zip(self.allocators, pages):
            held = [p for p in ids if p]
            if held:
                alloc.free(held)

    def slide(self, req: Req) -> None:
        """Drop the pages of windowed groups that ``req``'s next query cannot see; pages of the
        prefix cache are only let go of (the tree keeps them)."""
        kv = req.kv
        for g in self.windowed:
            lo = min(self.specs[g].first_live_page(req.kv_len, self.page_size), kv.num_pages)
            ids, own = kv.pages[g], []
            for i in range(kv.live_from[g], lo):
                if ids[i] and i >= kv.cached:
                    own.append(ids[i])
                ids[i] = 0
            kv.live_from[g] = max(kv.live_from[g], lo)
            if own:
                self.allocators[g].free(own)

    def grow(self, req: Req, ext: int) -> bool:
        """Pages for tokens ``kv_len .. kv_len + ext`` of ``req`` in every group; False (nothing
        taken) when a group is out of pages."""
        self.slide(req)
        new = self._pages(req.kv_len + ext) - req.kv.num_pages
        if new <= 0:
            return True
        got = self._take([new] * self.num_groups)
        if got is None:
            return False
        for ids, pages in zip(req.kv.pages, got):
            ids.extend(pages)
        return True

    def admit(self, req: Req, budget: int, reserve: int, max_pages: int) -> bool:
        """Match ``req``'s prefix (at most ``max_pages`` pages) and take pages for up to
        ``budget`` tokens past it, keeping ``reserve`` pages of each group for running requests.
        False (nothing held) when it does not fit now."""
        pages, node = self.tree.match_groups(req.all_ids, max_pages=max_pages)
        self.tree.inc_lock(node)
        cached = len(pages[0])
        req.kv = KVSlots([list(p) for p in pages], cached, node, [0] * self.num_groups)
        req.kv_len = cached * self.page_size
        ext = min(req.extend_len, budget)
        need = self._pages(req.kv_len + ext) - cached
        if any(self.available(g) < need + reserve for g in range(self.num_groups)) or not self.grow(
            req, ext
        ):
            self.tree.dec_lock(node)
            req.kv, req.kv_len = None, 0
            return False
        return True

    def release(self, req: Req) -> None:
        """``req`` is done with its KV (finished or retracted): its full pages go into the prefix
        cache (tombstones where a window dropped them), the rest back to the pools."""
        kv = req.kv
        if kv is None:
            return
        full = min(req.kv_len // self.page_size, kv.num_pages)
        if full > 0 and not self.tree.disable:
            self.tree.insert(
                req.all_ids[: full * self.page_size],
                kv.pages[0][:full],
                [ids[:full] for ids in kv.pages[1:]],
            )
            self.free(ids[max(full, kv.cached) :] for ids in kv.pages)
        else:
            self.free(ids[kv.cached :] for ids in kv.pages)
        if kv.node is not None:
            self.tree.dec_lock(kv.node)
        req.kv, req.kv_len = None, 0

    def park(self, req: Req) -> list[list[int]]:
        """Let go of ``req``'s KV without caching it and return the pages it owned, which the
        caller frees (``free``) once nothing can write into them any more."""
        kv = req.kv
        if kv is None:
            return [[] for _ in range(self.num_groups)]
        own = [[p for p in ids[kv.cached :] if p] for ids in kv.pages]
        if kv.node is not None:
            self.tree.dec_lock(kv.node)
        req.kv, req.kv_len = None, 0
        return own

    # ---- disaggregation ------------------------------------------------------------------------
    def transfer_start(self, group: int, prompt_len: int, decode_prefix: int) -> int:
        """The first logical page of ``group`` that prefill sends for a prompt of ``prompt_len``
        tokens when decode already holds ``decode_prefix`` pages."""
        return max(decode_prefix, self.specs[group].first_live_page(prompt_len, self.page_size))

    def sent_with_chunks(self, group: int) -> bool:
        """Whether ``group``'s pages are final after each chunk (full attention) or only after
        the last one (a window still drops pages while the prompt is computed)."""
        return group not in self.windowed

    def prealloc(self, req: Req, reserve: int) -> Optional[tuple[list[list[int]], int]]:
        """Decode: pages for ``req``'s whole prompt, whose KV prefill will write. The leading
        pages this server's prefix cache holds are kept (locked) and not sent; windowed groups
        get pages only where their window at the end of the prompt reaches. Returns (the new
        pages per group, in logical order from ``transfer_start``; the cached prefix in pages),
        or None (nothing held) when a group lacks room beyond ``reserve``."""
        n = req.prompt_len
        pages, node = self.tree.match_groups(req.input_ids, max_pages=(n - 1) // self.page_size)
        cached = len(pages[0])
        node = node if cached else None
        total = self._pages(n)
        starts = [self.transfer_start(g, n, cached) for g in range(self.num_groups)]
        counts = [total - s for s in starts]
        if any(self.available(g) < c + reserve for g, c in enumerate(counts)):
            return None
        if node is not None:
            self.tree.inc_lock(node)  # before taking pages: taking may evict
        got = self._take(counts)
        if got is None:
            if node is not None:
                self.tree.dec_lock(node)
            return None
        req.kv = KVSlots(
            [list(p) + [0] * (s - cached) + new for p, s, new in zip(pages, starts, got)],
            cached,
            node,
            [0] * self.num_groups,
        )
        return got, cached

    def send_pages(self, req: Req, group: int, start: int, end: Optional[int] = None) -> list[int]:
        """``req``'s pages of ``group`` at logical pages ``start .. end``."""
        return req.kv.pages[group][start:end]

    # ---- accounting ----------------------------------------------------------------------------
    def in_use(self, reqs: Iterable[Req]) -> list[int]:
        """Pages per group that ``reqs`` own (not the prefix cache's)."""
        out = [0] * self.num_groups
        for r in reqs:
            if r.kv is not None:
                for g, ids in enumerate(r.kv.pages):
                    out[g] += sum(1 for p in ids[r.kv.cached :] if p)
        return out

    def held(self, req: Req) -> list[int]:
        """Pages per group ``req`` holds (its own and the cached prefix's), 0s not counted."""
        if req.kv is None:
            return [0] * self.num_groups
        return [sum(1 for p in ids if p) for ids in req.kv.pages]

    def check_integrity(self, in_use: list[int]) -> dict:
        """Assert free + cached + in use == capacity in every group; the counts of group 0 (and
        per group when there are several)."""
        self.tree.check_integrity(in_use)
        info = {
            "total_pages": self.allocators[0].capacity,
            "free_pages": self.allocators[0].num_free(),
            "cached_pages": self.tree.total_pages(0),
            "in_use_pages": in_use[0],
        }
        if self.num_groups > 1:
            info["groups"] = [
                {
                    "kind": g.kind,
                    "layers": len(g.layers),
                    "total_pages": a.capacity,
                    "free_pages": a.num_free(),
                    "cached_pages": self.tree.total_pages(g.id),
                    "in_use_pages": in_use[g.id],
                }
                for g, a in zip(self.groups, self.allocators)
            ]
        return info
