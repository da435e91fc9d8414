import random

import pytest

from pdserve.engine.kv_pool import PageAllocator
from pdserve.engine.radix_cache import RadixCache


def make(num_pages=64, page_size=1, disable=False):
    alloc = PageAllocator(num_pages)
    return alloc, RadixCache(alloc, page_size, disable=disable)


def insert_fresh(cache, alloc, tokens):
    pages = alloc.alloc(len(tokens) // cache.page_size)
    return cache.insert(tokens, pages)


def test_match_and_insert_page_size_1():
    alloc, cache = make()
    pages_a, _ = insert_fresh(cache, alloc, [1, 2, 3])
    assert cache.total_pages() == 3

    got, node = cache.match_prefix([1, 2, 3, 4])
    assert got == pages_a
    assert node.key == (1, 2, 3)

    got, node = cache.match_prefix([1, 2, 9])
    assert got == pages_a[:2]
    assert node.key == (1, 2) and node.pages == pages_a[:2]

    got, node = cache.match_prefix([7, 8])
    assert got == [] and node is cache.root

    # Diverging sequence shares the cached prefix and adds only its own tail.
    pages_b, node_b = cache.insert([1, 2, 5, 6], pages_a[:2] + alloc.alloc(2))
    assert pages_b[:2] == pages_a[:2]
    assert cache.total_pages() == 5
    assert cache.match_prefix([1, 2, 5, 6, 7])[0] == pages_b
    assert cache.match_prefix([1, 2, 3])[0] == pages_a
    cache.check_integrity(in_use_pages=0)


def test_match_and_insert_page_size_4():
    alloc, cache = make(page_size=4)
    seq = list(range(100, 112))  # 3 pages
    pages, _ = insert_fresh(cache, alloc, seq)

    # Only full pages match: 11 tokens -> 2 pages.
    assert cache.match_prefix(seq[:11])[0] == pages[:2]
    # Divergence inside the second page -> only the first page matches.
    got, node = cache.match_prefix(seq[:5] + [0, 0, 0, 0])
    assert got == pages[:1] and len(node.key) == 4
    # Divergence inside the first page -> nothing.
    assert cache.match_prefix([100, 101, 0, 0])[0] == []
    assert cache.match_prefix(seq[:3])[0] == []

    other = seq[:4] + [7] * 8
    pages_o, _ = insert_fresh(cache, alloc, other)
    assert pages_o[0] == pages[0]
    assert cache.total_pages() == 5
    assert cache.match_prefix(other)[0] == pages_o
    cache.check_integrity(in_use_pages=0)

    with pytest.raises(AssertionError):
        cache.insert([1, 2, 3], alloc.alloc(1))


def test_max_pages_caps_match():
    alloc, cache = make(page_size=2)
    pages, _ = insert_fresh(cache, alloc, [1, 2, 3, 4, 5, 6])
    got, node = cache.match_prefix([1, 2, 3, 4, 5, 6], max_pages=2)
    assert got == pages[:2] and node.key == (1, 2, 3, 4)
    assert cache.match_prefix([1, 2, 3, 4, 5, 6], max_pages=0) == ([], cache.root)


def test_split_in_the_middle_keeps_held_node_and_locks():
    alloc, cache = make(page_size=2)
    pages, leaf = insert_fresh(cache, alloc, [1, 2, 3, 4, 5, 6, 7, 8])
    cache.inc_lock(leaf)
    assert cache.protected_pages() == 4

    got, mid = cache.match_prefix([1, 2, 3, 4, 9, 9])
    assert got == pages[:2]
    assert mid.key == (1, 2, 3, 4) and mid.pages == pages[:2]
    assert list(cache.root.children.values()) == [mid]
    # The node the request holds is still the end of its path.
    assert leaf.parent is mid and leaf.key == (5, 6, 7, 8) and leaf.pages == pages[2:]
    assert mid.lock_ref == leaf.lock_ref == 1
    assert cache.total_pages() == 4 and cache.protected_pages() == 4
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])[1] is leaf
    cache.check_integrity(in_use_pages=0)

    cache.dec_lock(leaf)
    assert cache.protected_pages() == 0 and cache.evictable_pages() == 4


def test_insert_frees_duplicate_pages_only():
    alloc, cache = make(page_size=2)
    tokens = [1, 2, 3, 4, 5, 6]
    pages, _ = insert_fresh(cache, alloc, tokens)
    free_before = alloc.num_free()

    extra = alloc.alloc(2)
    # First page is the tree's own (a matched prefix), the other two are recomputed copies.
    canonical, node = cache.insert(tokens, [pages[0]] + extra)
    assert canonical == pages
    assert node.key[-2:] == (5, 6)
    assert alloc.num_free() == free_before  # both copies went back, the shared page did not
    assert all(alloc.is_free(p) for p in extra)
    assert not alloc.is_free(pages[0])
    cache.check_integrity(in_use_pages=0)

    # Longer sequence over the same prefix: tree pages for the prefix, own page for the tail.
    more = alloc.alloc(4)
    canonical, _ = cache.insert(tokens + [7, 8], more)
    assert canonical == pages + [more[3]]
    assert all(alloc.is_free(p) for p in more[:3])
    cache.check_integrity(in_use_pages=0)


def test_insert_of_shorter_sequence_splits_and_returns_its_node():
    alloc, cache = make()
    pages, _ = insert_fresh(cache, alloc, [1, 2, 3, 4])
    canonical, node = cache.insert([1, 2], pages[:2])
    assert canonical == pages[:2] and node.key == (1, 2)
    assert cache.total_pages() == 4
    cache.check_integrity(in_use_pages=0)


def test_lock_prevents_eviction():
    alloc, cache = make()
    _, node = insert_fresh(cache, alloc, [1, 2, 3])
    cache.inc_lock(node)
    assert cache.evict(10) == 0
    assert cache.total_pages() == 3
    cache.dec_lock(node)
    assert cache.evict(10) == 3
    assert cache.total_pages() == 0
    assert alloc.num_free() == alloc.capacity
    with pytest.raises(AssertionError):
        cache.dec_lock(node)


def test_lock_on_shared_prefix_protects_prefix_only():
    alloc, cache = make()
    _, a = insert_fresh(cache, alloc, [1, 2, 3])
    _, b = cache.insert([1, 2, 4], cache.match_prefix([1, 2])[0] + alloc.alloc(1))
    cache.inc_lock(a)
    assert cache.protected_pages() == 3 and cache.evictable_pages() == 1
    assert cache.evict(10) == 1
    assert cache.match_prefix([1, 2, 4])[0] == cache.match_prefix([1, 2])[0]
    assert cache.match_prefix([1, 2, 3])[1] is a
    cache.check_integrity(in_use_pages=0)


def test_evict_in_lru_order():
    alloc, cache = make()
    pa, _ = insert_fresh(cache, alloc, [1, 1])
    pb, _ = insert_fresh(cache, alloc, [2, 2])
    pc, _ = insert_fresh(cache, alloc, [3, 3])
    cache.match_prefix([1, 1])  # A is now the most recent; B the least

    assert cache.evict(2) == 2
    assert all(alloc.is_free(p) for p in pb)
    assert cache.match_prefix([2, 2])[0] == []
    assert cache.evict(2) == 2
    assert all(alloc.is_free(p) for p in pc)
    assert cache.match_prefix([1, 1])[0] == pa


def test_evict_cascades_to_parents():
    alloc, cache = make()
    insert_fresh(cache, alloc, [1, 2])
    cache.insert([1, 2, 3, 4], cache.match_prefix([1, 2])[0] + alloc.alloc(2))
    cache.insert([1, 2, 5], cache.match_prefix([1, 2])[0] + alloc.alloc(1))
    assert cache.total_pages() == 5
    assert cache.evict(5) == 5
    assert cache.total_pages() == 0 and not cache.root.children
    assert alloc.num_free() == alloc.capacity


def test_partial_eviction_keeps_head_of_leaf():
    alloc, cache = make(page_size=2)
    pages, _ = insert_fresh(cache, alloc, [1, 2, 3, 4, 5, 6])
    assert cache.evict(1) == 1
    assert alloc.is_free(pages[2])
    got, node = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert got == pages[:2] and node.key == (1, 2, 3, 4)
    cache.check_integrity(in_use_pages=0)


def test_reset():
    alloc, cache = make()
    _, a = insert_fresh(cache, alloc, [1, 2, 3])
    insert_fresh(cache, alloc, [4, 5])
    cache.inc_lock(a)
    assert cache.reset() is False
    assert cache.total_pages() == 5
    cache.dec_lock(a)
    assert cache.reset() is True
    assert cache.total_pages() == 0 and cache.protected_pages() == 0
    assert alloc.num_free() == alloc.capacity
    assert cache.match_prefix([1, 2, 3]) == ([], cache.root)
    cache.check_integrity(in_use_pages=0)


def test_disable_mode():
    alloc, cache = make(disable=True)
    pages = alloc.alloc(3)
    assert cache.insert([1, 2, 3], pages) == ([], cache.root)
    assert all(alloc.is_free(p) for p in pages)
    assert cache.match_prefix([1, 2, 3]) == ([], cache.root)
    assert cache.total_pages() == 0 and cache.evict(5) == 0
    cache.inc_lock(cache.root)
    cache.dec_lock(cache.root)
    cache.check_integrity(in_use_pages=0)


def test_check_integrity_detects_leak_and_corruption():
    alloc, cache = make()
    _, a = insert_fresh(cache, alloc, [1, 2])
    _, b = insert_fresh(cache, alloc, [3, 4])
    leaked = alloc.alloc(1)
    with pytest.raises(AssertionError, match="in use 0"):
        cache.check_integrity(in_use_pages=0)
    cache.check_integrity(in_use_pages=len(leaked))

    b.pages[0] = a.pages[0]  # a page owned twice (its old page leaks)
    with pytest.raises(AssertionError, match="twice"):
        cache.check_integrity(in_use_pages=1)


def test_check_integrity_detects_tree_page_free_in_allocator():
    alloc, cache = make()
    pages, _ = insert_fresh(cache, alloc, [1, 2])
    alloc.free([pages[1]])
    with pytest.raises(AssertionError, match="free in the allocator"):
        cache.check_integrity(in_use_pages=0)


@pytest.mark.parametrize("page_size", [1, 4])
def test_randomized_integrity(page_size):
    rng = random.Random(1234 + page_size)
    alloc, cache = make(num_pages=48, page_size=page_size)
    prefixes = [[rng.randrange(6) for _ in range(rng.randrange(4, 24))] for _ in range(4)]
    running = []  # (tokens, matched pages, own pages, locked node)
    in_use = 0
    hits = 0
    for step in range(400):
        op = rng.random()
        if op < 0.5 and len(running) < 6:
            tokens = rng.choice(prefixes) + [rng.randrange(6) for _ in range(rng.randrange(0, 12))]
            tokens += [rng.randrange(6) for _ in range(rng.randrange(1, 6))]  # "generated" tokens
            # Leave at least one token to compute.
            matched, node = cache.match_prefix(tokens, max_pages=(len(tokens) - 1) // page_size)
            hits += len(matched)
            cache.inc_lock(node)
            need = -(-len(tokens) // page_size) - len(matched)
            own = alloc.alloc(need)
            if own is None:
                cache.evict(need - alloc.num_free())
                own = alloc.alloc(need)
            if own is None:
                cache.dec_lock(node)
            else:
                in_use += len(own)
                running.append((tokens, matched, own, node))
        elif op < 0.9 and running:
            tokens, matched, own, node = running.pop(rng.randrange(len(running)))
            full = len(tokens) // page_size
            all_pages = matched + own
            canonical, _ = cache.insert(tokens[: full * page_size], all_pages[:full])
            assert canonical[: len(matched)] == matched
            alloc.free(all_pages[full:])  # partial last page is not cached
            in_use -= len(own)
            cache.dec_lock(node)
        elif op < 0.97:
            cache.evict(rng.randrange(1, 8))
        elif not running:
            assert cache.reset()
        else:
            assert cache.reset() is False
        cache.check_integrity(in_use_pages=in_use)
        assert cache.evictable_pages() + cache.protected_pages() == cache.total_pages()
    assert hits > 0
    for tokens, matched, own, node in running:
        alloc.free(own)
        cache.dec_lock(node)
    assert cache.protected_pages() == 0
    assert cache.reset()
    assert alloc.num_free() == alloc.capacity


def test_namespaces_keep_apart_and_evict_reset_and_replay_alike():
    from pdserve.kv_events import BlockRemoved, BlockStored, chain_hashes, namespace_hash

    alloc, cache = make(page_size=2)
    cache.events = []
    tokens = [1, 2, 3, 4, 5, 6]
    insert_fresh(cache, alloc, tokens)  # namespace 0
    # the same tokens in namespace 1: no hit, pages of their own
    assert cache.match_prefix(tokens, namespace=1)[0] == []
    long_pages = alloc.alloc(3)
    got, node = cache.insert(tokens, long_pages, namespace=1)
    assert got == long_pages and cache.total_pages() == 6
    assert cache.match_prefix(tokens, namespace=1)[0] == long_pages
    assert cache.match_prefix(tokens)[0] != long_pages
    # events: the namespace's blocks chain from its own seed, not from the default root
    stored = [e for e in cache.events if isinstance(e, BlockStored)]
    assert stored[0].parent_block_hash is None
    assert stored[1].parent_block_hash == namespace_hash(1) is not None
    assert stored[1].block_hashes == chain_hashes(namespace_hash(1), tokens, 2)
    assert not set(stored[0].block_hashes) & set(stored[1].block_hashes)
    # a snapshot of the tree says the same
    assert sorted(e.block_hashes for e in cache.stored_events()) == sorted(
        e.block_hashes for e in stored
    )
    cache.check_integrity(in_use_pages=0)
    # a locked node of a namespace pins it; eviction reaches both namespaces
    cache.inc_lock(node)
    assert cache.reset() is False
    assert cache.evict(6) == 3 and cache.match_prefix(tokens)[0] == []
    assert cache.match_prefix(tokens, namespace=1)[0] == long_pages
    cache.dec_lock(node)
    assert cache.evict(6) == 3 and alloc.num_free() == alloc.capacity
    removed = [h for e in cache.events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(h for e in stored for h in e.block_hashes)
    cache.check_integrity(in_use_pages=0)
    insert_fresh(cache, alloc, tokens)
    cache.insert(tokens, alloc.alloc(3), namespace=1)
    assert cache.reset() is True and alloc.num_free() == alloc.capacity
    cache.check_integrity(in_use_pages=0)
