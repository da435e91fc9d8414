"""Radix prefix cache at page granularity: requests sharing a prompt prefix reuse KV pages.

Every node holds a run of token ids whose length is a multiple of ``page_size`` and the pages
holding their KV (one page per ``page_size`` tokens). A node's children are keyed by the tuple of
their first page's token ids, so a lookup steps one page at a time (``page_size`` 1 included).

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
from typing import Iterator, Optional

from pdserve.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, chain_hashes
from pdserve.engine.kv_pool import PageAllocator


class Node:
    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_access", "hashes")

    def __init__(self, key: tuple, pages: list[int], parent: Optional["Node"], last_access: int = 0):
        self.key = key  # token ids, len(key) == len(pages) * page_size
        self.pages = pages
        self.children: dict[tuple, Node] = {}  # first page's token ids -> child
        self.parent = parent
        # Number of locks on this node or any descendant (a lock pins the whole path to root).
        self.lock_ref = 0
        self.last_access = last_access
        self.hashes: list[int] = []  # its pages' chained block hashes (only with KV events on)

    def __repr__(self) -> str:
        return f"Node(tokens={len(self.key)}, pages={self.pages}, lock_ref={self.lock_ref})"


class RadixCache:
    def __init__(self, allocator: PageAllocator, page_size: int, disable: bool = False):
        if page_size < 1:
            raise ValueError(f"page_size: must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.disable = disable
        self.root = Node((), [], None)
        self._clock = 0  # logical time for LRU; ticks on every match/insert
        self._total_pages = 0
        self._protected_pages = 0  # pages in nodes with lock_ref > 0
        # KV events (``kv_events.py``): a list that collects them, None when off
        self.events: Optional[list] = None

    # ----- counters (O(1); the scheduler reads them every step) -----

    def total_pages(self) -> int:
        return self._total_pages

    def protected_pages(self) -> int:
        return self._protected_pages

    def evictable_pages(self) -> int:
        return self._total_pages - self._protected_pages

    # ----- lookup and insertion -----

    def match_prefix(self, token_ids: list[int], *, max_pages: Optional[int] = None) -> tuple[list[int], Node]:
        """Longest cached prefix of ``token_ids`` in full pages (at most ``max_pages``).

        Returns its pages in order and the node ending exactly at the match (root if none). The
        caller caps ``max_pages`` when it needs at least one token left to compute.
        """
        if self.disable:
            return [], self.root
        ps = self.page_size
        n_pages = len(token_ids) // ps
        if max_pages is not None:
            n_pages = max(0, min(n_pages, max_pages))
        tokens = tuple(token_ids[: n_pages * ps])
        node, pos, pages = self.root, 0, []
        while pos < len(tokens):
            child = node.children.get(tokens[pos : pos + ps])
            if child is None:
                break
            n = self._common_pages(child.key, tokens, pos)
            if n < len(child.pages):
                child = self._split(child, n)
            pages.extend(child.pages)
            pos += n * ps
            node = child
        self._touch(node)
        return pages, node

    def insert(self, token_ids: list[int], pages: list[int]) -> tuple[list[int], Node]:
        """Add ``token_ids`` (full pages only) to the tree; the tree takes ownership of ``pages``.

        Where the tree already holds a prefix, its pages win and each passed page that differs
        from the tree's page at that position is freed as a duplicate. Returns the canonical
        pages for the whole sequence and the node ending exactly at it.
        """
        ps = self.page_size
        assert len(token_ids) == len(pages) * ps, (
            f"insert: {len(token_ids)} tokens but {len(pages)} pages of {ps} tokens"
        )
        if self.disable:
            self.allocator.free(pages)
            return [], self.root
        tokens = tuple(token_ids)
        node, pos, canonical, duplicates = self.root, 0, [], []
        while pos < len(tokens):
            first = tokens[pos : pos + ps]
            child = node.children.get(first)
            if child is None:
                child = Node(tokens[pos:], list(pages[pos // ps :]), node)
                node.children[first] = child
                self._total_pages += len(child.pages)
                if self.events is not None:
                    parent = node.hashes[-1] if node.hashes else None
                    child.hashes = chain_hashes(parent, child.key, ps)
                    self.events.append(BlockStored(block_hashes=list(child.hashes), parent_block_hash=parent,
                                                   token_ids=list(child.key), block_size=ps))
                canonical.extend(child.pages)
                node = child
                break
            n = self._common_pages(child.key, tokens, pos)
            if n < len(child.pages):
                child = self._split(child, n)
            base = pos // ps
            for i, tree_page in enumerate(child.pages):
                if pages[base + i] != tree_page:
                    duplicates.append(pages[base + i])
            canonical.extend(child.pages)
            pos += n * ps
            node = child
        if duplicates:
            self.allocator.free(duplicates)
        self._touch(node)
        return canonical, node

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
        prefix = Node(node.key[:cut], node.pages[:n_pages], parent, node.last_access)
        prefix.lock_ref = node.lock_ref
        prefix.hashes, node.hashes = node.hashes[:n_pages], node.hashes[n_pages:]
        node.key = node.key[cut:]
        node.pages = node.pages[n_pages:]
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
                self._protected_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def dec_lock(self, node: Node) -> None:
        # Ancestors' lock_ref >= a descendant's, so checking the start node covers the path.
        assert node.lock_ref > 0, f"dec_lock below zero on {node!r}"
        while node is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected_pages -= len(node.pages)
            node = node.parent

    # ----- eviction -----

    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` pages if possible, least recently used unlocked leaves
        first (a leaf larger than needed loses only its tail pages). Returns pages freed."""
        if num_pages <= 0:
            return 0
        seq = 0  # tie-breaker so the heap never compares nodes
        heap = []
        for node in self._iter_nodes():
            if node is not self.root and not node.children and node.lock_ref == 0:
                heap.append((node.last_access, seq, node))
                seq += 1
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            need = num_pages - freed
            if len(leaf.pages) > need:
                # Keep the head of the leaf: its prefix is the part most likely to be reused.
                tail = leaf.pages[-need:]
                leaf.pages = leaf.pages[:-need]
                leaf.key = leaf.key[: len(leaf.pages) * self.page_size]
                if self.events is not None:
                    self.events.append(BlockRemoved(block_hashes=leaf.hashes[-need:]))
                    leaf.hashes = leaf.hashes[:-need]
                self.allocator.free(tail)
                self._total_pages -= need
                freed += need
                break
            self.allocator.free(leaf.pages)
            self._total_pages -= len(leaf.pages)
            freed += len(leaf.pages)
            if self.events is not None:
                self.events.append(BlockRemoved(block_hashes=list(leaf.hashes)))
            parent = leaf.parent
            del parent.children[leaf.key[: self.page_size]]
            leaf.parent = None
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, seq, parent))
                seq += 1
        return freed

    def reset(self) -> bool:
        """Drop the whole tree, freeing its pages. Returns False (and changes nothing) if any
        node is locked."""
        if self.root.lock_ref > 0:
            return False
        pages = [p for node in self._iter_nodes() for p in node.pages]
        if pages:
            self.allocator.free(pages)
        self.root = Node((), [], None)
        self._total_pages = 0
        self._protected_pages = 0
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True

    def stored_events(self) -> list[BlockStored]:
        """The whole tree as ``BlockStored`` events, parents first (a KV-events snapshot)."""
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root and node.hashes:
                parent = node.parent.hashes[-1] if node.parent.hashes else None
                out.append(BlockStored(block_hashes=list(node.hashes), parent_block_hash=parent,
                                       token_ids=list(node.key), block_size=self.page_size))
            stack.extend(node.children.values())
        return out

    # ----- debugging -----

    def _iter_nodes(self) -> Iterator[Node]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_integrity(self, in_use_pages: int) -> None:
        """Assert the tree is well formed and ``free + cached + in_use == capacity``.

        ``in_use_pages``: pages held by requests and not (yet) in the tree; pages a request
        matched from the tree count as cached, not in use.
        """
        ps = self.page_size
        seen: set[int] = set()
        total = protected = 0
        for node in self._iter_nodes():
            assert len(node.key) == len(node.pages) * ps, f"{node!r}: {len(node.key)} tokens"
            assert node is self.root or node.pages, f"empty non-root node {node!r}"
            assert node.lock_ref >= 0, f"negative lock_ref on {node!r}"
            child_locks = 0
            for first, child in node.children.items():
                assert child.parent is node, f"{child!r} has a wrong parent"
                assert child.key[:ps] == first, f"{child!r} filed under the wrong first page"
                child_locks += child.lock_ref
            assert node.lock_ref >= child_locks, (
                f"{node!r}: lock_ref below its children's total {child_locks}"
            )
            for p in node.pages:
                assert p not in seen, f"page {p} appears twice in the tree"
                assert not self.allocator.is_free(p), f"page {p} is in the tree but free in the allocator"
                seen.add(p)
            total += len(node.pages)
            if node.lock_ref > 0:
                protected += len(node.pages)
        assert total == self._total_pages, f"total_pages counter {self._total_pages}, tree holds {total}"
        assert protected == self._protected_pages, (
            f"protected_pages counter {self._protected_pages}, tree has {protected} locked"
        )
        free = self.allocator.num_free()
        cap = self.allocator.capacity
        assert free + total + in_use_pages == cap, (
            f"page leak: free {free} + cached {total} + in use {in_use_pages} "
            f"= {free + total + in_use_pages} != capacity {cap}"
        )
