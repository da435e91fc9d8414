"""Radix prefix cache at page granularity: requests sharing a prompt prefix reuse KV pages.

Every node holds a run of token ids whose length is a multiple of ``page_size`` and the pages
holding their KV (one page per ``page_size`` tokens). A node's children are keyed by the tuple of
their first page's token ids, so a lookup steps one page at a time (``page_size`` 1 included).

Cache groups (``kv_spec``): a model whose layers keep different caches (full attention, sliding
window) has one page id per group for every page of tokens. ``node.pages`` holds group 0's ids
and ``node.extra`` one list per further group, all of the node's length. An id of 0 is a
tombstone: that group no longer keeps the page (it slid out of a window before the sequence was
cached). A prefix is a hit only up to a page boundary at which every group still holds the pages
its next query can see (``CacheSpec.first_live_page``): for full attention that is every page,
for a window the pages of its last ``window`` tokens (vLLM's rule for sliding-window groups).
A per-request group (a recurrent state) holds a slot only on the pages at whose end the tree
keeps a snapshot of the state, so a hit ends on such a page (SGLang's Mamba radix cache); every
leaf ends on one (the cache manager inserts nothing without it, eviction takes such leaves
whole), so every block that KV events report stored lies on a path a prompt can hit through.

Namespaces: requests whose KV of the same tokens differs (LongRoPE computes a prompt longer than
the original context with other frequencies: ``CausalLM.prefix_namespace``) match and insert in
a tree of their own, under a root per namespace; their blocks' hashes chain from the
namespace's (``kv_events.namespace_hash``), so an event never claims a hit across namespaces.

Ownership: a page is either free in the allocator, held by the tree, or held by a running
request (its "in use" pages, not yet inserted). ``insert`` hands pages to the tree; the tree
gives them back to the allocator only through ``evict``/``reset`` or as duplicates on insert.

Locking: ``inc_lock(node)`` pins the path node -> root; locked nodes are never evicted or reset.
A node object returned by ``match_prefix``/``insert`` stays valid across later splits (a split
creates the new node for the prefix half, above it), but an unlocked node may be evicted, so lock
it before anything else can evict. Only the scheduler loop calls this class; not thread-safe.
"""

from __future__ import annotations

import heapq
from typing import Callable, Iterator, Optional, Sequence, Union

from pdserve.engine.kv_pool import PageAllocator
from pdserve.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    chain_hashes,
    lora_namespace_of,
    namespace_hash,
)


class Node:
    __slots__ = ("key", "pages", "extra", "children", "parent", "lock_ref", "last_access", "hashes")

    def __init__(
        self,
        key: tuple,
        pages: list[int],
        parent: Optional["Node"],
        last_access: int = 0,
        extra: Optional[list[list[int]]] = None,
    ):
        self.key = key  # token ids, len(key) == len(pages) * page_size
        self.pages = pages  # group 0's page ids
        self.extra = extra or []  # the other groups' page ids (0: tombstone), each len(pages) long
        self.children: dict[tuple, Node] = {}  # first page's token ids -> child
        self.parent = parent
        # Number of locks on this node or any descendant (a lock pins the whole path to root).
        self.lock_ref = 0
        self.last_access = last_access
        self.hashes: list[int] = []  # its pages' chained block hashes (only with KV events on)

    def __repr__(self) -> str:
        return (
            f"Node(tokens={len(self.key)}, pages={self.pages}, extra={self.extra}, "
            f"lock_ref={self.lock_ref})"
        )

    def groups(self) -> list[list[int]]:
        return [self.pages, *self.extra]

    def held(self) -> list[int]:
        """Pages (not tombstones) the node holds, per group."""
        return [sum(1 for p in ids if p) for ids in self.groups()]


class RadixCache:
    def __init__(
        self,
        allocator: Union[PageAllocator, Sequence[PageAllocator]],
        page_size: int,
        disable: bool = False,
        specs: Optional[Sequence] = None,
    ):
        """``allocator``: one per cache group (or one); ``specs``: the groups' ``CacheSpec``s, for
        the window rule of ``match_prefix`` (None: every group keeps every page)."""
        if page_size < 1:
            raise ValueError(f"page_size: must be >= 1, got {page_size}")
        self.allocators = [allocator] if isinstance(allocator, PageAllocator) else list(allocator)
        self.allocator = self.allocators[0]
        self.num_groups = len(self.allocators)
        self.specs = list(specs) if specs is not None else [None] * self.num_groups
        self._windowed = [
            g for g, spec in enumerate(self.specs) if spec is not None and spec.drops_pages
        ]
        self._stateful = [
            g for g, spec in enumerate(self.specs) if spec is not None and spec.per_request
        ]
        self.page_size = page_size
        self.disable = disable
        self.roots: dict[int, Node] = {0: self._node((), [], None)}  # namespace -> root
        self._clock = 0  # logical time for LRU; ticks on every match/insert
        self._total = [0] * self.num_groups  # pages held per group
        self._protected = [0] * self.num_groups  # ... in nodes with lock_ref > 0
        # KV events (``kv_events.py``): a list that collects them, None when off
        self.events: Optional[list] = None
        # the LoRA adapters' names by namespace key (their events name them; pdserve/lora/)
        self.lora_names: dict[int, str] = {}
        # the tiers below the pool (``engine/kv_tier``): nodes keep their block hashes, and
        # ``on_evict(node, start)`` / ``on_insert(node, 0)`` see pages ``start..`` of a node
        # leave the pool / enter the tree, before anything changes
        self.hashing = False
        self.on_evict: Optional[Callable[[Node, int], None]] = None
        self.on_insert: Optional[Callable[[Node, int], None]] = None

    @property
    def root(self) -> Node:
        """The default namespace's root."""
        return self.roots[0]

    def _root(self, namespace: int) -> Node:
        root = self.roots.get(namespace)
        if root is None:
            root = self.roots[namespace] = self._node((), [], None)
            seed = namespace_hash(namespace)
            root.hashes = [] if seed is None else [seed]
        return root

    # ----- counters (O(1); the scheduler reads them every step) -----
    def total_pages(self, group: int = 0) -> int:
        return self._total[group]

    def protected_pages(self, group: int = 0) -> int:
        return self._protected[group]

    def evictable_pages(self, group: int = 0) -> int:
        return self._total[group] - self._protected[group]

    def _node(
        self, key: tuple, pages: list[list[int]], parent: Optional[Node], last_access: int = 0
    ) -> Node:
        pages = pages or [[] for _ in range(self.num_groups)]
        return Node(key, list(pages[0]), parent, last_access, [list(p) for p in pages[1:]])

    def _count(self, node: Node, sign: int, protected: bool = False) -> None:
        counters = self._protected if protected else self._total
        for g, n in enumerate(node.held()):
            counters[g] += sign * n

    # ----- lookup and insertion -----
    def match_prefix(
        self, token_ids: list[int], *, max_pages: Optional[int] = None, namespace: int = 0
    ) -> tuple[list[int], Node]:
        """Longest cached prefix of ``token_ids`` in full pages (at most ``max_pages``): group 0's
        pages in order and the node ending exactly at the match (root if none). The caller caps
        ``max_pages`` when it needs at least one token left to compute."""
        pages, node = self.match_groups(token_ids, max_pages=max_pages, namespace=namespace)
        return pages[0], node

    def match_groups(
        self, token_ids: list[int], *, max_pages: Optional[int] = None, namespace: int = 0
    ) -> tuple[list[list[int]], Node]:
        """``match_prefix`` for every group: the pages per group (tombstones as 0) of the longest
        prefix at whose end every group holds what its next query sees."""
        if self.disable:
            return [[] for _ in range(self.num_groups)], self.root
        if self._windowed or self._stateful:
            max_pages = self._usable_pages(token_ids, max_pages, namespace)
        return self._walk(token_ids, max_pages, namespace=namespace)

    def _usable_pages(self, token_ids: list[int], max_pages: Optional[int], namespace: int) -> int:
        """The longest match (in pages) whose windowed groups are whole at its end and whose
        per-request groups keep a snapshot there."""
        ps = self.page_size
        found, _ = self._walk(token_ids, max_pages, split=False, namespace=namespace)
        k = len(found[0])
        while k > 0:
            if all(found[g][k - 1] for g in self._stateful) and all(
                all(found[g][self.specs[g].first_live_page(k * ps, ps) : k]) for g in self._windowed
            ):
                return k
            k -= 1
        return 0

    def _walk(
        self,
        token_ids: list[int],
        max_pages: Optional[int],
        split: bool = True,
        namespace: int = 0,
    ):
        ps = self.page_size
        n_pages = len(token_ids) // ps
        if max_pages is not None:
            n_pages = max(0, min(n_pages, max_pages))
        tokens = tuple(token_ids[: n_pages * ps])
        node, pos, pages = self._root(namespace), 0, [[] for _ in range(self.num_groups)]
        while pos < len(tokens):
            child = node.children.get(tokens[pos : pos + ps])
            if child is None:
                break
            n = self._common_pages(child.key, tokens, pos)
            if not split:
                for g, ids in enumerate(child.groups()):
                    pages[g].extend(ids[:n])
                if n < len(child.pages):
                    break
            else:
                if n < len(child.pages):
                    child = self._split(child, n)
                for g, ids in enumerate(child.groups()):
                    pages[g].extend(ids)
            pos += n * ps
            node = child
        if split:
            self._touch(node)
        return pages, node

    def insert(
        self,
        token_ids: list[int],
        pages: list[int],
        extra: Optional[list[list[int]]] = None,
        namespace: int = 0,
    ) -> tuple[list[int], Node]:
        """Add ``token_ids`` (full pages only) to the tree; the tree takes ownership of ``pages``
        (group 0's ids) and ``extra`` (the other groups', 0 where a group holds none).

        Where the tree already holds a prefix, its pages win and each passed page that differs
        from the tree's page at that position is freed as a duplicate; a tombstone in the tree
        takes the passed page instead. Returns group 0's canonical pages for the whole sequence
        and the node ending exactly at it.
        """
        ps = self.page_size
        groups = [list(pages), *(extra or [])]
        assert len(groups) == self.num_groups, (
            f"insert: {len(groups)} page lists for {self.num_groups} groups"
        )
        assert all(len(token_ids) == len(ids) * ps for ids in groups), (
            f"insert: {len(token_ids)} tokens but {[len(ids) for ids in groups]} pages of {ps} "
            "tokens"
        )
        if self.disable:
            self._free(groups)
            return [], self.root
        tokens = tuple(token_ids)
        node, pos, canonical = self._root(namespace), 0, []
        duplicates: list[list[int]] = [[] for _ in range(self.num_groups)]
        while pos < len(tokens):
            first = tokens[pos : pos + ps]
            child = node.children.get(first)
            if child is None:
                child = self._node(tokens[pos:], [ids[pos // ps :] for ids in groups], node)
                node.children[first] = child
                self._count(child, +1)
                if self.events is not None or self.hashing:
                    parent = node.hashes[-1] if node.hashes else None
                    child.hashes = chain_hashes(parent, child.key, ps)
                if self.on_insert is not None:
                    self.on_insert(child, 0)
                if self.events is not None:
                    self.events.append(
                        BlockStored(
                            block_hashes=list(child.hashes),
                            parent_block_hash=parent,
                            token_ids=list(child.key),
                            block_size=ps,
                            lora_name=self.lora_names.get(lora_namespace_of(namespace)),
                        )
                    )
                canonical.extend(child.pages)
                node = child
                break
            n = self._common_pages(child.key, tokens, pos)
            if n < len(child.pages):
                child = self._split(child, n)
            base = pos // ps
            for g, tree_ids in enumerate(child.groups()):
                for i, tree_page in enumerate(tree_ids):
                    page = groups[g][base + i]
                    if page == tree_page or not page:
                        continue
                    if tree_page:
                        duplicates[g].append(page)
                    else:  # a tombstone: the tree takes the page
                        tree_ids[i] = page
                        self._total[g] += 1
                        if child.lock_ref > 0:
                            self._protected[g] += 1
            canonical.extend(child.pages)
            pos += n * ps
            node = child
        self._free(duplicates)
        self._touch(node)
        return canonical, node

    def _free(self, groups: list[list[int]]) -> None:
        for alloc, ids in zip(self.allocators, groups):
            held = [p for p in ids if p]
            if held:
                alloc.free(held)

    def _common_pages(self, key: tuple, tokens: tuple, start: int) -> int:
        """Number of leading full pages of ``key`` equal to ``tokens[start:]``."""
        ps = self.page_size
        n = min(len(key), len(tokens) - start)  # both multiples of page_size
        if key[:n] == tokens[start : start + n]:
            return n // ps
        i = ps  # the first page matched through the children dict
        while i < n and key[i : i + ps] == tokens[start + i : start + i + ps]:
            i += ps
        return i // ps

    def _split(self, node: Node, n_pages: int) -> Node:
        """Split ``node`` after ``n_pages``; returns the new prefix node (``node`` keeps the tail).

        The original object stays the deeper half so references held by requests keep pointing
        at the end of their path. Lock counts are unchanged: the prefix inherits ``lock_ref``.
        """
        ps = self.page_size
        cut = n_pages * ps
        parent = node.parent
        prefix = self._node(
            node.key[:cut], [ids[:n_pages] for ids in node.groups()], parent, node.last_access
        )
        prefix.lock_ref = node.lock_ref
        prefix.hashes, node.hashes = node.hashes[:n_pages], node.hashes[n_pages:]
        node.key = node.key[cut:]
        node.pages = node.pages[n_pages:]
        node.extra = [ids[n_pages:] for ids in node.extra]
        node.parent = prefix
        prefix.children[node.key[:ps]] = node
        parent.children[prefix.key[:ps]] = prefix
        return prefix

    def _touch(self, node: Node) -> None:
        self._clock += 1
        while node is not None:
            node.last_access = self._clock
            node = node.parent

    # ----- locking -----

    def inc_lock(self, node: Node) -> None:
        while node is not None:
            if node.lock_ref == 0:
                self._count(node, +1, protected=True)
            node.lock_ref += 1
            node = node.parent

    def dec_lock(self, node: Node) -> None:
        # Ancestors' lock_ref >= a descendant's, so checking the start node covers the path.
        assert node.lock_ref > 0, f"dec_lock below zero on {node!r}"
        while node is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._count(node, -1, protected=True)
            node = node.parent

    # ----- eviction -----

    def evict(self, num_pages: int, group: int = 0) -> int:
        """Free at least ``num_pages`` pages of ``group`` if possible, least recently used unlocked
        leaves first (a leaf larger than needed loses only its tail pages; every group's pages of
        what is evicted are freed). Returns the pages of ``group`` freed."""
        if num_pages <= 0:
            return 0
        seq = 0  # tie-breaker so the heap never compares nodes
        heap = []
        for node in self._iter_nodes():
            if node.parent is not None and not node.children and node.lock_ref == 0:
                heap.append((node.last_access, seq, node))
                seq += 1
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            need = num_pages - freed
            held = leaf.held()[group]
            # a leaf ends on a state snapshot where a group keeps states: evicted whole, never
            # cut below it (the rest could not be hit)
            if held > need and not self._stateful:
                # Keep the head of the leaf: its prefix is the part most likely to be reused.
                ids, cut = leaf.groups()[group], len(leaf.pages)
                got = 0
                while got < need:
                    cut -= 1
                    got += ids[cut] != 0
                if self.on_evict is not None:
                    self.on_evict(leaf, cut)
                tail = [g_ids[cut:] for g_ids in leaf.groups()]
                self._count(leaf, -1)
                leaf.pages, leaf.extra = leaf.pages[:cut], [g_ids[:cut] for g_ids in leaf.extra]
                leaf.key = leaf.key[: cut * self.page_size]
                self._count(leaf, +1)
                if self.events is not None:
                    self.events.append(BlockRemoved(block_hashes=leaf.hashes[cut:]))
                leaf.hashes = leaf.hashes[:cut]
                self._free(tail)
                freed += got
                break
            if self.on_evict is not None:
                self.on_evict(leaf, 0)
            self._free(leaf.groups())
            self._count(leaf, -1)
            freed += held
            if self.events is not None:
                self.events.append(BlockRemoved(block_hashes=list(leaf.hashes)))
            parent = leaf.parent
            del parent.children[leaf.key[: self.page_size]]
            leaf.parent = None
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, seq, parent))
                seq += 1
        return freed

    def reset(self) -> bool:
        """Drop the whole tree, freeing its pages; False (nothing changed) if a node is locked."""
        if any(root.lock_ref > 0 for root in self.roots.values()):
            return False
        for node in self._iter_nodes():
            self._free(node.groups())
        self.roots = {0: self._node((), [], None)}
        self._total = [0] * self.num_groups
        self._protected = [0] * self.num_groups
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True

    def stored_events(self) -> list[BlockStored]:
        """The whole tree as ``BlockStored`` events, parents first (a KV-events snapshot)."""
        out, stack = [], [(root, ns) for ns, root in self.roots.items()]
        while stack:
            node, ns = stack.pop()
            if node.parent is not None and node.hashes:
                parent = node.parent.hashes[-1] if node.parent.hashes else None
                out.append(
                    BlockStored(
                        block_hashes=list(node.hashes),
                        parent_block_hash=parent,
                        token_ids=list(node.key),
                        block_size=self.page_size,
                        lora_name=self.lora_names.get(lora_namespace_of(ns)),
                    )
                )
            stack.extend((child, ns) for child in node.children.values())
        return out

    # ----- debugging -----
    def _iter_nodes(self) -> Iterator[Node]:
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_integrity(self, in_use_pages, groups: Optional[Sequence[int]] = None) -> None:
        """Assert the tree is well formed and ``free + cached + in_use == capacity`` per group.

        ``in_use_pages``: pages held by requests and not (yet) in the tree, one count per group
        (or one int: group 0's); pages a request matched from the tree count as cached.
        """
        ps = self.page_size
        in_use = [in_use_pages] if isinstance(in_use_pages, int) else list(in_use_pages)
        seen: list[set[int]] = [set() for _ in range(self.num_groups)]
        total, protected = [0] * self.num_groups, [0] * self.num_groups
        for node in self._iter_nodes():
            assert all(len(node.key) == len(ids) * ps for ids in node.groups()), (
                f"{node!r}: {len(node.key)} tokens"
            )
            assert node.parent is None or node.pages, f"empty non-root node {node!r}"
            assert node.lock_ref >= 0, f"negative lock_ref on {node!r}"
            child_locks = 0
            for first, child in node.children.items():
                assert child.parent is node, f"{child!r} has a wrong parent"
                assert child.key[:ps] == first, f"{child!r} filed under the wrong first page"
                child_locks += child.lock_ref
            assert node.lock_ref >= child_locks, (
                f"{node!r}: lock_ref below its children's total {child_locks}"
            )
            for g, ids in enumerate(node.groups()):
                for p in ids:
                    if not p:
                        continue
                    assert p not in seen[g], f"page {p} of group {g} appears twice in the tree"
                    assert not self.allocators[g].is_free(p), (
                        f"page {p} of group {g} is in the tree but free in the allocator"
                    )
                    seen[g].add(p)
                    total[g] += 1
                    protected[g] += node.lock_ref > 0
        assert total == self._total, f"total_pages counters {self._total}, tree holds {total}"
        assert protected == self._protected, (
            f"protected_pages counters {self._protected}, tree has {protected} locked"
        )
        for g in range(len(in_use)):
            free, cap = self.allocators[g].num_free(), self.allocators[g].capacity
            assert free + total[g] + in_use[g] == cap, (
                f"page leak{f' in cache group {g}' if self.num_groups > 1 else ''}: free {free} + "
                f"cached {total[g]} + in use {in_use[g]} = {free + total[g] + in_use[g]} != "
                f"capacity {cap}"
            )
