"""The compressed cache kind (one entry per ``rate`` tokens, DeepSeek-V4's compressed attention)
and the compressor's per-request state, in the KV cache manager: where entries live for every
page size and rate, what a sequence holds as it grows in chunks, what the prefix cache keeps and
gives back, what a decode preallocates and a prefill sends (0 where a page holds no entry, on both
sides alike), the pools' regions, and the accounting after all of it."""

from __future__ import annotations

import pytest
import torch

from pdserve.disagg.descriptors import held_pairs
from pdserve.engine.cache_kinds import make_pool, policy_for
from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.kv_pool import CompressedPool, LatentPool, StatePool
from pdserve.engine.request import Req, SamplingParams
from pdserve.kv_spec import (
    CompressedEntries,
    CompressorState,
    LatentWindow,
    anchor_group,
    group_layers,
    transfer_bytes_per_token,
)

WINDOW = 8
# (page_size, rate): pages holding several windows, one, and one page in rate / page_size
SHAPES = [(1, 4), (2, 8), (4, 4), (16, 4), (16, 8), (4, 16), (1, 1)]


def state(rate: int, dim: int = 6) -> CompressorState:
    # the open window's projected tokens and the overlap slice of the last closed one
    return CompressorState(
        ("buffer_kv", "buffer_gate", "overlap_kv", "overlap_gate"),
        ((rate, 2 * dim), (rate, 2 * dim), (rate, dim), (rate, dim)),
        ("float32",) * 4,
    )


def layer_specs(rate: int) -> list:
    """A V4-like stack: every layer a sliding window; layers 1 and 3 compress at ``rate`` with
    an indexer's keys beside their entries (CSA), layer 2 at ``2 * rate`` without (HCA)."""
    win = LatentWindow(8, 0, WINDOW)  # one head, key and value alike
    csa = (
        win,
        CompressedEntries(8, rate),
        CompressedEntries(4, rate, part="index_k"),
        state(rate),
    )
    hca = (win, CompressedEntries(8, 2 * rate), state(2 * rate))
    return [win, csa, hca, csa]


def manager(page_size: int, rate: int, pages: int = 256, disable: bool = False) -> KVCacheManager:
    groups = group_layers(layer_specs(rate))
    pools = [
        make_pool(g, 9 if g.spec.per_request else pages, page_size, torch.float32, "cpu")
        for g in groups
    ]
    return KVCacheManager(groups, pools, page_size, disable_radix_cache=disable)


def req(ids: list[int], rid: str = "r") -> Req:
    return Req(rid, ids, SamplingParams(max_new_tokens=100))


def integrity(m: KVCacheManager, *running: Req) -> None:
    m.check_integrity(m.in_use(running))


def compressed(m: KVCacheManager) -> list[int]:
    return [g.id for g in m.groups if g.kind == "compressed"]


def assert_laid_out(m: KVCacheManager, r: Req, tokens: int) -> None:
    """Every compressed group holds an item exactly on the logical pages where a window of the
    first ``tokens`` tokens' pages closes, and every closed window's entry has one."""
    ps = m.page_size
    for g in compressed(m):
        spec, ids = m.specs[g], r.kv.pages[g]
        assert len(ids) == r.kv.num_pages
        for page, item in enumerate(ids):
            assert bool(item) == spec.holds_item(page, ps), (g, page, ids)
        for e in range(tokens // spec.rate):
            page, slot = spec.entry_location(e, ps)
            assert ids[page] and 0 <= slot < spec.entries_per_page(ps)


# ---- the spec ------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size,rate", SHAPES)
def test_every_entry_lands_on_the_page_of_its_last_token_in_a_slot_of_its_own(page_size, rate):
    spec = CompressedEntries(8, rate)
    seen = set()
    for e in range(40):
        page, slot = spec.entry_location(e, page_size)
        last = (e + 1) * rate - 1
        assert page == last // page_size and spec.holds_item(page, page_size)
        assert (page, slot) not in seen
        seen.add((page, slot))
    holding = [p for p in range(40 * rate) if spec.holds_item(p, page_size)]
    assert {p for p, _ in seen} <= set(holding)
    for first in range(0, 20):
        for end in range(first, 40):
            assert spec.items_between(first, end, page_size) == sum(
                1 for p in range(first, end) if spec.holds_item(p, page_size)
            )
    # pool pages per logical page, and bytes per token of a long sequence
    assert spec.page_share(page_size) == min(1.0, page_size / rate)
    assert spec.bytes_per_token(2) == 8 * 2 / rate
    assert spec.page_bytes(page_size, 2) == max(1, page_size // rate) * 8 * 2


def test_page_sizes_that_cut_a_window_across_pages_are_refused_naming_both():
    spec = CompressedEntries(8, 12)
    with pytest.raises(ValueError, match=r"page_size: 16 tokens and a compress rate of 12"):
        policy_for(spec, 16)
    group = group_layers([spec])[0]
    with pytest.raises(ValueError, match=r"page_size: 16 tokens and a compress rate of 12"):
        make_pool(group, 8, 16, torch.float32, "cpu")


def test_groups_anchor_and_transfer_bytes():
    m = manager(4, 4)
    assert [g.kind for g in m.groups] == [
        "latent_window",
        "compressed",
        "compressed",
        "compressed",
        "compressor_state",
        "compressor_state",
    ]
    # the indexer's keys are a group of their own even where dim and rate would agree
    assert len(group_layers([CompressedEntries(8, 4), CompressedEntries(8, 4, part="x")])) == 2
    assert m.anchor == anchor_group(m.groups) == 0
    # a model whose only paged groups are compressed has nothing to count its pages with
    with pytest.raises(ValueError, match="keeps no per-token cache"):
        anchor_group(group_layers([(CompressedEntries(8, 4), state(4))]))
    # what PD moves per token of a long prompt: the entries (the windows leave), each dim / rate
    per_token = transfer_bytes_per_token(m.groups, 1, 2)
    assert per_token == round(2 * (8 * 2 / 4 + 4 * 2 / 4) + 8 * 2 / 8)
    spec = m.specs[1]
    assert spec.describe() == {"kind": "compressed", "dim": 8, "rate": 4, "part": "kv"}


def test_the_pools_hold_entries_per_page_and_replicate_their_regions():
    groups = group_layers(layer_specs(4))
    pool = make_pool(groups[1], 10, 16, torch.bfloat16, "cpu")
    assert isinstance(pool, CompressedPool)
    assert pool.entries(0).shape == (10, 4, 8) and pool.item_bytes == 4 * 8 * 2
    regions = pool.regions(groups[1])
    assert [r.layer for r in regions] == [1, 3]
    assert {(r.split, r.part, r.final) for r in regions} == {("replicated", "kv", "per_chunk")}
    assert all(r.check() == "" for r in regions)
    index = make_pool(groups[2], 10, 1, torch.bfloat16, "cpu")
    assert index.entries(0).shape == (10, 1, 4)
    assert {r.part for r in index.regions(groups[2])} == {"index_k"}
    st = make_pool(groups[4], 5, 16, torch.bfloat16, "cpu")
    assert isinstance(st, StatePool)
    st_regions = st.regions(groups[4])
    assert {(r.split, r.final, r.segments) for r in st_regions} == {
        ("replicated", "last_chunk", ())
    }
    assert all(r.check() == "" for r in st_regions)
    window = make_pool(groups[0], 5, 16, torch.bfloat16, "cpu")
    assert isinstance(window, LatentPool) and window.buffer.shape == (4, 5, 16, 8)
    assert {r.final for r in window.regions(groups[0])} == {"last_chunk"}


# ---- the manager ---------------------------------------------------------------------------


@pytest.mark.parametrize("page_size,rate", SHAPES)
def test_a_sequence_holds_its_closed_windows_entries_as_it_grows(page_size, rate):
    m = manager(page_size, rate, disable=True)
    r = req(list(range(100, 171)))  # 71 tokens: windows cut at odd places by chunks of 5
    assert m.admit(r, 5, 0, 0)
    while True:
        assert_laid_out(m, r, r.kv_len)
        r.kv_len += min(5, r.seq_len - r.kv_len)
        if r.kv_len == r.seq_len:
            break
        assert m.grow(r, min(5, r.seq_len - r.kv_len))
    for _ in range(9):  # decode steps
        r.output_ids.append(7)
        assert m.grow(r, 1)
        r.kv_len += 1
        assert_laid_out(m, r, r.kv_len)
    held = m.held(r)
    for g in compressed(m):
        spec = m.specs[g]
        assert held[g] == spec.items_between(0, r.kv.num_pages, page_size)
    assert held[4:] == [1, 1]  # one state slot per compressor kind, no snapshot without the tree
    # the window over the single key-and-value head kept only what the next query sees
    assert r.kv.num_pages > held[0] and held[0] <= -(-WINDOW // page_size) + 2
    integrity(m, r)
    m.release(r)
    integrity(m)
    assert all(a.num_free() == a.capacity for a in m.allocators)


@pytest.mark.parametrize("page_size,rate", [(1, 4), (4, 4), (16, 4), (4, 16)])
def test_a_prefix_hit_shares_the_entries_and_restores_the_compressor_state(page_size, rate):
    m = manager(page_size, rate)
    prompt = list(range(100, 150))
    first = req(prompt, "a")
    assert m.admit(first, 64, 0, (len(prompt) - 1) // page_size)
    first.kv_len = len(prompt)
    full = len(prompt) // page_size
    entries = {g: list(first.kv.pages[g][:full]) for g in compressed(m)}
    m.release(first)
    integrity(m)
    again = req(prompt + [1, 2, 3], "b")
    assert m.admit(again, 64, 0, (again.seq_len - 1) // page_size)
    # the hit ends where the state snapshot was taken (the last full page) and shares the pages
    assert again.kv.cached == full and again.kv_len == full * page_size
    for g in compressed(m):
        assert again.kv.pages[g][:full] == entries[g]
    assert m.restored == 2  # both compressor states came back from their snapshots
    assert_laid_out(m, again, again.kv_len)
    integrity(m, again)
    m.release(again)
    integrity(m)


# ---- disaggregation ------------------------------------------------------------------------


@pytest.mark.parametrize("page_size,rate", SHAPES)
@pytest.mark.parametrize("decode_prefix", [False, True])
def test_decode_and_prefill_lay_out_the_entries_they_move_alike(page_size, rate, decode_prefix):
    n = 61
    prompt = list(range(200, 200 + n))
    prefill, decode = manager(page_size, rate), manager(page_size, rate)
    if decode_prefix:  # decode's prefix cache already holds the prompt's first pages
        warm = req(prompt[:40], "w")
        assert decode.admit(warm, 64, 0, 40 // page_size)
        warm.kv_len = 40
        decode.release(warm)
    d = req(prompt, "d")
    dst, cached = decode.prealloc(d, reserve=0)
    assert (cached > 0) == decode_prefix
    counts = decode.transfer_counts(n, cached)
    assert [len(x) for x in dst] == counts
    # prefill computes the prompt in chunks of 7 and sends each chunk's full pages of the groups
    # final with their chunk, the rest after the last chunk
    p = req(prompt, "p")
    assert prefill.admit(p, 7, 0, 0)
    starts = [prefill.transfer_start(g, n, cached) for g in range(prefill.num_groups)]
    sent = [[] for _ in starts]
    while True:
        p.kv_len += min(7, n - p.kv_len)
        last = p.kv_len == n
        for g, start in enumerate(starts):
            if last:
                sent[g] += prefill.send_pages(p, g, start + len(sent[g]))
            elif prefill.sent_with_chunks(g):
                end = p.kv_len // page_size
                first = start + len(sent[g])
                items = prefill.send_pages(p, g, first, end)
                # a page sent before the last chunk is whole, so every window closing on it is
                # closed: its entries are final
                assert all((first + i + 1) * page_size <= p.kv_len for i in range(len(items)))
                sent[g] += items
        if last:
            break
        assert prefill.grow(p, min(7, n - p.kv_len))
    assert [len(x) for x in sent] == counts
    for g, (src, d_items) in enumerate(zip(sent, dst)):
        s, t = held_pairs(src, d_items, g)
        assert len(s) == len(t) == sum(1 for x in d_items if x)
        spec = decode.specs[g]
        if spec.kind == "compressed":  # nothing taken for the pages without an entry
            assert len(t) == spec.items_between(starts[g], -(-n // page_size), page_size)
    integrity(prefill, p)
    integrity(decode, d)
    prefill.release(p)
    decode.release(d)
    integrity(prefill)
    integrity(decode)


def test_a_side_holding_an_item_where_the_other_holds_none_is_refused_naming_the_page():
    assert held_pairs([0, 5, 0, 6], [0, 9, 0, 10]) == ([5, 6], [9, 10])
    with pytest.raises(
        ValueError,
        match=r"cache group 2, page 7: prefill holds item 5, decode "
        r"holds none",
    ):
        held_pairs([7, 5], [9, 0], group=2, offset=6)


def _compat(specs: list, page_size: int = 4) -> dict:
    from pdserve.disagg.kv_args import KVArgs
    from pdserve.disagg.metadata import MetadataBuffers

    groups = group_layers(specs)
    pools = [
        make_pool(g, 3 if g.spec.per_request else 8, page_size, torch.float32, "cpu")
        for g in groups
    ]
    return KVArgs.from_buffers(pools, MetadataBuffers(2), cache_groups=groups).compat_info()


def test_registration_refuses_a_peer_with_other_compress_rates_or_buffers_naming_both():
    from pdserve.disagg.kv_args import compat_mismatches

    mine = _compat(layer_specs(4))
    assert compat_mismatches(mine, _compat(layer_specs(4))) == []
    [err] = compat_mismatches(mine, _compat(layer_specs(8)))
    assert err.startswith("layer 1 cache mismatch: prefill compressed (dim 8, rate 4, part kv)")
    assert "decode compressed (dim 8, rate 8, part kv)" in err
    # the compressor's buffers: same rate, another shape
    other = layer_specs(4)
    other[2] = (other[2][0], other[2][1], state(8, dim=5))
    [err] = compat_mismatches(mine, _compat(other))
    assert err.startswith("layer 2 cache mismatch: prefill compressor_state (parts")
    assert "[8, 12]" in err and "[8, 10]" in err
