"""The KV cache manager with a full-attention and a sliding-window group: pages held per group,
pages freed as the window slides, admission counted per group, prefix-cache hits only where every
window is whole, PD preallocation of the window only, and the accounting after all of it."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.kv_pool import KVPool
from pdserve.engine.request import Req, SamplingParams
from pdserve.kv_spec import ChunkedAttention, FullAttention, SlidingWindow, group_layers

WINDOW = 8


def manager(
    page_size: int, full_pages: int = 64, swa_pages: int = 64, disable: bool = False
) -> KVCacheManager:
    specs = [FullAttention(2, 4), SlidingWindow(2, 4, WINDOW), SlidingWindow(2, 4, WINDOW)]
    groups = group_layers(specs)
    pools = [
        KVPool(len(g.layers), n, page_size, 2, 4, torch.float32, "cpu")
        for g, n in zip(groups, (full_pages, swa_pages))
    ]
    return KVCacheManager(groups, pools, page_size, disable_radix_cache=disable)


def req(ids: list[int], rid: str = "r") -> Req:
    return Req(rid, ids, SamplingParams(max_new_tokens=100))


def run(m: KVCacheManager, r: Req, chunk: int) -> None:
    """Prefill ``r`` in chunks of ``chunk`` tokens as the scheduler does, without a model."""
    assert m.admit(r, chunk, 0, (len(r.all_ids) - 1) // m.page_size)
    while True:
        r.kv_len += min(chunk, r.seq_len - r.kv_len)
        if r.kv_len == r.seq_len:
            return
        assert m.grow(r, min(chunk, r.seq_len - r.kv_len))


def integrity(m: KVCacheManager, *running: Req) -> None:
    m.check_integrity(m.in_use(running))


@pytest.mark.parametrize("page_size", [1, 4])
def test_window_group_holds_only_the_window(page_size):
    m = manager(page_size)
    r = req(list(range(100, 140)))  # 40 tokens, window 8
    run(m, r, chunk=8)
    full, swa = m.held(r)
    assert full == -(-40 // page_size)
    # the window group kept what the last chunk (tokens 32..39) saw: keys from 25 on
    assert swa == -(-40 // page_size) - m.specs[1].first_live_page(32, page_size)
    # decode steps keep it bounded: the pages sliding out are freed
    for _ in range(13):
        r.output_ids.append(7)
        assert m.grow(r, 1)
        r.kv_len += 1
        full, swa = m.held(r)
        assert swa == m.specs[1].pages_kept(r.kv_len - 1, page_size)
        assert full == r.kv_len // page_size + (r.kv_len % page_size > 0)
    integrity(m, r)
    m.release(r)
    integrity(m)


def test_admission_counts_the_window_group():
    # full-attention pages are plenty; the window group's 5 pages hold one request's window
    m = manager(page_size=4, full_pages=64, swa_pages=6, disable=True)
    a, b = req(list(range(100, 140)), "a"), req(list(range(200, 240)), "b")
    run(m, a, chunk=8)
    assert m.held(a)[1] == 4  # what the last chunk saw: keys 25..39 on pages 6..9
    assert not m.admit(b, 8, 0, 9)  # b's first chunk needs 2 window pages, 1 is free
    assert b.kv is None
    integrity(m, a)
    m.release(a)
    assert m.admit(b, 8, 0, 9)
    m.release(b)
    integrity(m)


def test_prefix_hit_needs_the_whole_window():
    ps = 4
    m = manager(ps)
    first = req(list(range(100, 140)))
    run(m, first, chunk=16)
    m.release(first)  # 10 full pages cached; the window group kept pages 8..9 (tokens 32..39)
    integrity(m)
    # a follow-up of the whole sequence hits all of it: its window is cached
    follow = req(list(range(100, 140)) + [5, 6, 7])
    assert m.admit(follow, 16, 0, (len(follow.all_ids) - 1) // ps)
    assert follow.kv.cached == 10 and follow.kv_len == 40
    m.release(follow)
    # a prompt that leaves after 24 tokens cannot use that prefix: its window (tokens 17..23) is
    # gone
    branch = req(list(range(100, 124)) + [9] * 10)
    assert m.admit(branch, 16, 0, (len(branch.all_ids) - 1) // ps)
    assert branch.kv.cached == 0
    m.release(branch)
    integrity(m)


def test_decode_prealloc_takes_the_window_only():
    ps = 4
    m = manager(ps)
    r = req(list(range(100, 150)))  # 50 tokens: 13 pages; the window at the end covers keys 43..50
    pages, cached = m.prealloc(r, reserve=0)
    assert cached == 0
    assert len(pages[0]) == 13
    start = m.transfer_start(1, 50, 0)
    assert start == (50 - WINDOW + 1) // ps and len(pages[1]) == 13 - start
    assert r.kv.pages[1][:start] == [0] * start
    integrity(m, r)
    m.free(m.park(r))
    integrity(m)


def test_decode_server_admits_the_predicted_number_of_long_requests():
    """A decode server (tiny Gemma 3: S,S,F,S,S,F, window 16) preallocates a long prompt's full
    pages in the full-attention pool and only its window's in the sliding-window pool. 1200
    full-attention tokens and a window pool of a tenth of that (2 x 1200 + 4 x 120 = 2880
    layer-tokens): 6 prompts of 90 tokens fit at once (5 window pages each, 30 in that pool),
    against 5 when every layer keeps every page (--disable-hybrid-swa-memory) in the same
    memory (2880 / 6 = 480 tokens: 120 pages of 23 per prompt)."""
    from pdserve.config import ServerArgs
    from pdserve.disagg.setup import attach_disaggregation
    from tests.helpers.checkpoints import build_tiny_checkpoint

    def admitted(max_total_tokens: int, **kw) -> tuple[int, list]:
        args = ServerArgs(
            model_path=build_tiny_checkpoint("gemma3"),
            max_total_tokens=max_total_tokens,
            page_size=4,
            chunked_prefill_size=128,
            torch_num_threads=1,
            disaggregation_mode="decode",
            disaggregation_transfer_backend="fake",
            dtype="float32",
            **kw,
        )
        s = attach_disaggregation(args)
        for i in range(20):
            s.add_request(
                Req(
                    f"r{i}",
                    [100 + i] * 90,
                    SamplingParams(max_new_tokens=4),
                    bootstrap_host="127.0.0.1",
                    bootstrap_port=1,
                    bootstrap_room=i,
                )
            )
        s.pd._process_prealloc()
        held = [s.kv.held(r) for r in s.pd.transfer]
        return len(s.pd.transfer), held

    n, held = admitted(1200, swa_full_tokens_ratio=0.1)
    assert n == 6 and all(h == [5, 23] for h in held), (n, held)  # [window group, full group] pages
    n, held = admitted(480, disable_hybrid_swa_memory=True)
    assert n == 5 and all(h == [23] for h in held), (n, held)


# ---- a hybrid: attention layers and recurrent-state layers (a state slot per request) ---------


def hybrid(page_size: int = 4, pages: int = 64, slots: int = 4, disable: bool = False):
    """Layers state, attention, state, attention (layer 0 keeps a state, as on Bamba)."""
    from pdserve.engine.kv_pool import StatePool
    from pdserve.kv_spec import RecurrentState

    state = RecurrentState(("conv", "ssm"), ((6, 3), (2, 4, 5)), ("float32", "float32"))
    groups = group_layers([state, FullAttention(2, 4), state, FullAttention(2, 4)])
    pools = [
        KVPool(2, pages, page_size, 2, 4, torch.float32, "cpu"),
        StatePool(state, 2, slots + 1, "cpu"),
    ]
    return KVCacheManager(groups, pools, page_size, disable_radix_cache=disable)


def test_groups_put_per_request_state_last_and_anchor_on_the_first_paged_group():
    from pdserve.kv_spec import RecurrentState, anchor_group

    m = hybrid()
    assert [g.kind for g in m.groups] == ["full_attention", "recurrent_state"]
    assert [g.layers for g in m.groups] == [(1, 3), (0, 2)]
    assert m.anchor == anchor_group(m.groups) == 0
    # a layer may keep no cache (Nemotron-H's MLP layers) or two (a latent and an indexer's keys)
    groups = group_layers(
        [FullAttention(2, 4), None, (), (FullAttention(2, 4), FullAttention(1, 8))]
    )
    assert [g.layers for g in groups] == [(0, 3), (3,)]
    only_state = group_layers([RecurrentState(("ssm",), ((2,),), ("float32",))])
    with pytest.raises(ValueError, match="keeps no per-token cache .*recurrent_state"):
        anchor_group(only_state)


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_state_slot_per_request_from_admission_to_release(page_size):
    m = hybrid(page_size, pages=128, slots=2, disable=True)  # no prefix cache: no snapshots
    a, b, c = (req(list(range(100 + 50 * i, 140 + 50 * i)), n) for i, n in enumerate("abc"))
    run(m, a, chunk=8)
    pages, slot = m.held(a)
    assert pages == -(-40 // page_size) and slot == 1  # one slot, however many chunks
    assert len(a.kv.pages[1]) == 1 and a.kv.pages[1][0] > 0 and a.kv.num_pages == pages
    for _ in range(5):  # decode steps take pages, never another slot
        a.output_ids.append(7)
        assert m.grow(a, 1)
        a.kv_len += 1
    assert m.held(a)[1] == 1 and m.in_use([a]) == [m.held(a)[0], 1]
    run(m, b, chunk=8)
    # out of slots: c is not admitted and holds nothing; pages are plenty
    assert not m.admit(c, 8, 0, 9) and c.kv is None
    integrity(m, a, b)
    m.release(a)
    integrity(m, b)
    assert m.admit(c, 8, 0, 9)
    m.release(b)
    m.release(c)
    integrity(m)
    assert m.allocators[1].num_free() == 2


def test_a_state_model_without_the_prefix_cache_keeps_one_slot_and_no_prefix():
    m = hybrid(disable=True)
    assert m.tree.disable and m.cached_groups == [0]
    first = req(list(range(100, 140)))
    run(m, first, chunk=16)
    m.release(first)
    assert m.tree.total_pages() == 0
    again = req(list(range(100, 140)) + [5])
    assert m.admit(again, 64, 0, 10) and again.kv.cached == 0
    m.release(again)
    integrity(m)


def test_the_page_reserve_does_not_apply_to_state_slots():
    m = hybrid(slots=2)
    r = req(list(range(100, 110)))
    # 63 pages free, 3 needed + a reserve of 50 for running requests: fits; the one slot is enough
    assert m.admit(r, 16, 50, 2)
    m.release(r)
    assert not m.admit(r, 16, 61, 2)  # the reserve does apply to pages
    integrity(m)


def test_pd_moves_the_state_slot_once_after_the_last_chunk():
    ps = 4
    m = hybrid(ps)
    assert m.transfer_counts(50, 0) == [13, 1] and m.transfer_counts(50, 3) == [10, 1]
    assert m.sent_with_chunks(0) and not m.sent_with_chunks(1)
    # decode: pages for the whole prompt and the slot that the state is written into
    r = req(list(range(100, 150)))
    pages, cached = m.prealloc(r, reserve=0)
    # prefill writes the live slot; decode keeps its own snapshot slot beside it
    assert cached == 0 and len(pages[0]) == 13 and pages[1] == r.kv.pages[1][:1]
    assert len(r.kv.pages[1]) == 2 and r.kv.computed_from == 50
    r_state = r.kv.pages[1]
    assert m.send_pages(r, 1, m.transfer_start(1, 50, 0)) == pages[1]
    integrity(m, r)
    own = m.park(r)
    assert own == [pages[0], r_state] and r.kv is None
    m.free(own)
    integrity(m)
    # prefill: the state goes with the last chunk's send, from item 0
    p = req(list(range(100, 150)))
    run(m, p, chunk=16)
    assert m.send_pages(p, 1, 0) == p.kv.pages[1][:1] and m.send_pages(p, 1, 1) == []
    m.release(p)
    integrity(m)


def test_a_hit_restores_the_state_snapshot_at_the_end_of_the_match():
    """With the prefix cache on, a request holds a live slot and a snapshot slot; when it ends
    the tree takes its full pages with the snapshot on the last one (the state at the last page
    boundary), and a prompt sharing those pages restores its live slot from it. A prompt that
    shares fewer pages has no snapshot at its match's end: no hit."""
    ps = 4
    m = hybrid(ps, slots=6)
    assert not m.tree.disable and m.cached_groups == [0, 1]
    pool = m.pools[1]
    first = req(list(range(100, 142)))  # 42 tokens: 10 full pages
    run(m, first, chunk=16)
    assert m.held(first) == [11, 2]
    live, snap = first.kv.pages[1]
    pool.state("ssm", 0)[snap] = 3.0  # the mixers' part (layers/state_snapshots.py)
    pool.state("conv", 1)[snap] = -2.0
    m.release(first)
    assert m.tree.total_pages(0) == 10 and m.tree.total_pages(1) == 1
    assert m.allocators[1].num_free() == 5  # the live slot came back
    again = req(list(range(100, 142)) + [7, 8])
    assert m.admit(again, 64, 0, (len(again.all_ids) - 1) // ps)
    assert again.kv.cached == 10 and again.kv_len == 40 and m.restored == 1
    new_live = again.kv.pages[1][0]
    assert new_live != snap and again.kv.computed_from == 40  # the tree keeps the snapshot
    assert torch.all(pool.state("ssm", 0)[new_live] == 3.0)
    assert torch.all(pool.state("conv", 1)[new_live] == -2.0)
    shorter = req(list(range(100, 136)) + [1, 2, 3, 4, 5, 6])  # 9 pages shared
    assert m.admit(shorter, 64, 0, 10) and shorter.kv.cached == 0
    integrity(m, again, shorter)
    # again computed nothing past its hit's page: its snapshot is not the sequence's, the tree
    # keeps the one it has
    again.kv_len, shorter.kv_len = 43, 42
    m.release(again)
    m.release(shorter)
    assert m.tree.total_pages(1) == 2  # shorter's own, on its 10th page
    integrity(m)


def test_new_requests_evict_cached_snapshots_for_slots():
    ps = 4
    m = hybrid(ps, slots=4)
    first = req(list(range(100, 142)))
    run(m, first, chunk=64)
    m.release(first)
    assert m.tree.total_pages(1) == 1 and m.available(1) == 4  # 3 free, 1 evictable
    a, b = req(list(range(200, 210)), "a"), req(list(range(300, 310)), "b")
    assert m.admit(a, 64, 0, 2) and m.admit(b, 64, 0, 2)
    assert m.tree.total_pages(1) == 0 and m.tree.total_pages(0) == 0  # the leaf went whole
    integrity(m, a, b)
    m.release(a)
    m.release(b)
    integrity(m)


def test_a_hybrid_tree_reports_only_blocks_a_prompt_can_hit_through():
    """Every leaf of a hybrid's tree ends on a state snapshot: a request that ends without one
    past where it began inserts nothing (and no BlockStored), and eviction takes a leaf whole
    rather than cut it below its snapshot (BlockRemoved for all of its blocks)."""
    from pdserve.kv_events import BlockRemoved, BlockStored

    ps = 4
    m = hybrid(ps, slots=6)
    m.tree.events = []
    # decode PD: computing began at the prompt's end (41 tokens) and ended at 43, inside the
    # same page: the snapshot is not the sequence's, the tree takes nothing
    r = req(list(range(100, 141)))
    pages, _ = m.prealloc(r, reserve=0)
    r.kv_len = 43
    m.release(r)
    assert m.tree.total_pages(0) == 0 and m.tree.events == []
    integrity(m)
    done = req(list(range(100, 142)))
    run(m, done, chunk=64)
    m.release(done)
    stored = [e for e in m.tree.events if isinstance(e, BlockStored)]
    assert len(stored) == 1 and len(stored[0].block_hashes) == 10
    m.tree.events.clear()
    assert m.tree.evict(1, 0) == 10  # one page asked for, the whole leaf given
    removed = [e for e in m.tree.events if isinstance(e, BlockRemoved)]
    assert len(removed) == 1 and len(removed[0].block_hashes) == 10
    integrity(m)


CHUNK = 16


def chunked_manager(page_size: int) -> KVCacheManager:
    specs = [FullAttention(2, 4), ChunkedAttention(2, 4, chunk=CHUNK)]
    groups = group_layers(specs)
    pools = [KVPool(len(g.layers), 128, page_size, 2, 4, torch.float32, "cpu") for g in groups]
    return KVCacheManager(groups, pools, page_size)


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunk_group_lets_go_of_each_finished_chunk(page_size):
    """An attention chunk is not a sliding window: within a chunk every page stays, at its
    boundary all of them go at once."""
    m = chunked_manager(page_size)
    r = req(list(range(100, 140)))  # 40 tokens: chunks 0..15, 16..31, 32..39
    run(m, r, chunk=8)
    full, chunked = m.held(r)
    assert full == -(-40 // page_size)
    # the next query (position 40) sees 32..40: the pages from 32 on
    assert chunked == -(-40 // page_size) - 32 // page_size
    held = []
    for _ in range(30):
        r.output_ids.append(7)
        assert m.grow(r, 1)
        r.kv_len += 1
        held.append(m.held(r)[1])
        # the chunk of the token being computed (at kv_len - 1), from its first page
        first = (r.kv_len - 1) // CHUNK * CHUNK // page_size
        assert held[-1] == (r.kv_len - 1) // page_size + 1 - first
    # grows within a chunk, falls to one page at each boundary (positions 48 and 64)
    assert held[48 - 40] == 1 and held[64 - 40] == 1 and max(held) == CHUNK // page_size
    integrity(m, r)
    m.release(r)
    integrity(m)


def test_chunk_prefix_hit_and_decode_prealloc_start_at_the_chunk():
    ps = 4
    m = chunked_manager(ps)
    first = req(list(range(100, 140)))
    run(m, first, chunk=16)
    m.release(first)  # 10 full pages cached; the chunk group kept pages 8..9 (tokens 32..39)
    follow = req(list(range(100, 140)) + [5, 6, 7])
    assert m.admit(follow, 16, 0, (len(follow.all_ids) - 1) // ps)
    assert follow.kv.cached == 10 and follow.kv_len == 40
    m.release(follow)
    # leaving after 36 tokens: its chunk (32..) is cached whole, the hit stands
    branch = req(list(range(100, 136)) + [9] * 10)
    assert m.admit(branch, 16, 0, (len(branch.all_ids) - 1) // ps)
    assert branch.kv.cached == 9
    m.release(branch)
    # leaving after 28 tokens: its chunk's pages (16..27) were let go, but the boundary at 16
    # needs nothing before it: the hit stops there
    early = req(list(range(100, 128)) + [9] * 10)
    assert m.admit(early, 16, 0, (len(early.all_ids) - 1) // ps)
    assert early.kv.cached == 16 // ps
    m.release(early)
    integrity(m)
    r = req(list(range(200, 250)))  # 50 tokens: decode needs the chunk from 48 on
    pages, cached = m.prealloc(r, reserve=0)
    start = m.transfer_start(1, 50, 0)
    assert start == 48 // ps and len(pages[1]) == 13 - start
    integrity(m, r)
    m.free(m.park(r))
    integrity(m)
