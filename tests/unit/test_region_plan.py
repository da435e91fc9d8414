"""Typed regions planned per split across TP sizes: head-sharded, replicated and segmented
regions of one layout move from every prefill rank layout to every decode rank layout byte for
byte, each destination byte written exactly once, replicated bytes read from one prefill rank per
decode rank (spread over the prefill ranks), and registration naming both sides of a split
disagreement."""

from __future__ import annotations

import ctypes
import io
import itertools
import re
import tokenize
from pathlib import Path

import numpy as np
import pytest

import pdserve
from pdserve.disagg import rank_map
from pdserve.disagg.destinations import _region_mismatches
from pdserve.disagg.layout import chunk_descriptors, pair_regions
from pdserve.distributed import kv_heads_for_rank
from pdserve.kv_region import Region
from pdserve.kv_spec import held, piece_range

KV_HEADS, Q_HEADS, HEAD_BYTES = 4, 8, 6
SEGMENTS = (8, 16, 8)  # bytes of each segment of an item, whole model (a conv state's x | B | C)
# conv states of Mamba2 layers whose B and C are whole groups (``Region.pieces``): one group (every
# rank holds it), two groups (split by two ranks, shared by two of four)
GROUPED = {"conv_g1": ((16, 4, 4), (0, 1, 1)), "conv_g2": ((16, 4, 4), (0, 2, 2))}
LATENT = 20  # bytes of a replicated item
PAGES = 5
SPLITS = ("heads", "replicated", "segments")


def whole_items(seed: int) -> dict[str, np.ndarray]:
    """Every region's items for the whole model: [pages, bytes]."""
    rng = np.random.default_rng(seed)
    return {
        "k": rng.integers(0, 256, (PAGES, KV_HEADS * HEAD_BYTES), dtype=np.uint8),
        "latent": rng.integers(0, 256, (PAGES, LATENT), dtype=np.uint8),
        "conv": rng.integers(0, 256, (PAGES, sum(SEGMENTS)), dtype=np.uint8),
        **{
            name: rng.integers(0, 256, (PAGES, sum(segs)), dtype=np.uint8)
            for name, (segs, _) in GROUPED.items()
        },
    }


def share(items: dict[str, np.ndarray], rank: int, tp: int) -> dict[str, np.ndarray]:
    """What rank ``rank`` of ``tp`` holds of each region."""
    h0, h1 = kv_heads_for_rank(KV_HEADS, Q_HEADS, rank, tp)
    out = {"k": items["k"][:, h0 * HEAD_BYTES : h1 * HEAD_BYTES], "latent": items["latent"]}
    parts, start = [], 0
    for seg in SEGMENTS:
        n = seg // tp
        parts.append(items["conv"][:, start + rank * n : start + (rank + 1) * n])
        start += seg
    out["conv"] = np.concatenate(parts, axis=1)
    for name, (segs, pieces) in GROUPED.items():
        parts, start = [], 0
        for seg, k in zip(segs, pieces):
            if k:  # whole units: an even share, or the one unit of the rank's heads
                u0, u1 = piece_range(k, tp, rank)
                lo, hi = u0 * seg // k, u1 * seg // k
            else:
                lo, hi = rank * seg // tp, (rank + 1) * seg // tp
            parts.append(items[name][:, start + lo : start + hi])
            start += seg
        out[name] = np.concatenate(parts, axis=1)
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def local_segments(name: str, tp: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if name == "conv":
        return tuple(s // tp for s in SEGMENTS), ()
    if name in GROUPED:
        segs, pieces = GROUPED[name]
        return tuple(s // k * held(k, tp) if k else s // tp for s, k in zip(segs, pieces)), pieces
    return (), ()


def regions(arrays: dict[str, np.ndarray], tp: int, group: int = 0) -> list[Region]:
    split = {"k": "heads", "latent": "replicated"}
    return [
        Region(
            ptr=a.ctypes.data,
            nbytes=a.nbytes,
            item_bytes=a.shape[1],
            group=group,
            layer=0,
            part=name,
            split=split.get(name, "segments"),
            segments=local_segments(name, tp)[0],
            pieces=local_segments(name, tp)[1],
        )
        for name, a in arrays.items()
    ]


@pytest.mark.parametrize(
    "p_tp, d_tp", [(1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (2, 4), (4, 2), (4, 4)]
)
def test_every_split_lands_byte_exact_across_tp_sizes(p_tp, d_tp):
    """Also segments of whole units (a Mamba2 layer's groups) with fewer units than ranks: every
    decode rank gets each unit it holds once, from one of its sources."""
    items = whole_items(p_tp * 10 + d_tp)
    src = [share(items, p, p_tp) for p in range(p_tp)]
    dst = [{k: np.zeros_like(v) for k, v in share(items, d, d_tp).items()} for d in range(d_tp)]
    writes = [{k: np.zeros(v.shape, dtype=np.int32) for k, v in d.items()} for d in dst]
    plan = rank_map.plan(p_tp, d_tp, KV_HEADS, Q_HEADS, SPLITS)
    src_pages, dst_pages = [[0, 1, 3]], [[4, 2, 0]]
    for pair in plan:
        s_regions, d_regions = (
            regions(src[pair.prefill_rank], p_tp),
            regions(dst[pair.decode_rank], d_tp),
        )
        paired, why = pair_regions(s_regions, d_regions)
        assert why == ""
        assert (
            _region_mismatches(
                s_regions, [d_regions[j] for j in paired], pair, p_tp, d_tp, pair.decode_rank
            )
            == []
        )
        descs = chunk_descriptors(
            s_regions, [d_regions[j] for j in paired], pair, src_pages, dst_pages, p_tp, d_tp
        )
        assert (descs is None) == pair.empty
        if descs is None:
            continue
        for s, d, n in zip(*(x.tolist() for x in descs)):
            ctypes.memmove(d, s, n)
            for name, arr in dst[pair.decode_rank].items():  # count the bytes each write covers
                base = arr.ctypes.data
                if base <= d < base + arr.nbytes:
                    writes[pair.decode_rank][name].reshape(-1)[d - base : d - base + n] += 1
    for d in range(d_tp):
        want = share(items, d, d_tp)
        for name in want:
            assert np.array_equal(dst[d][name][dst_pages[0]], want[name][src_pages[0]]), (d, name)
            assert np.all(writes[d][name][dst_pages[0]] == 1), (d, name)  # every byte exactly once
            untouched = [p for p in range(PAGES) if p not in dst_pages[0]]
            assert not dst[d][name][untouched].any() and not writes[d][name][untouched].any()
    for d in range(d_tp):  # one metadata writer, and it is the replicated region's writer
        mine = [s for s in plan if s.decode_rank == d]
        assert [s.writes_metadata for s in mine].count(True) == 1
        assert [s for s in mine if s.replicated] == [s for s in mine if s.writes_metadata]


@pytest.mark.parametrize(
    "p_tp, d_tp, readers",
    [
        (1, 1, [0]),
        (2, 2, [0, 1]),
        (2, 1, [0]),
        (1, 2, [0, 0]),
        (4, 2, [0, 1]),
        (2, 4, [0, 1, 0, 1]),
    ],
)
def test_a_replicated_region_is_read_from_one_prefill_rank_spread_by_decode_rank(
    p_tp, d_tp, readers
):
    """A latent cache alone (MLA): decode rank d reads it whole from prefill rank d % p_tp; the
    other prefill ranks hold an empty pair, so they conclude their rooms without writing."""
    plan = rank_map.plan(p_tp, d_tp, 0, 0, ("replicated",))
    assert [
        next(s.prefill_rank for s in plan if s.decode_rank == d and s.replicated)
        for d in range(d_tp)
    ] == readers
    for p in set(range(p_tp)) - set(readers):
        [empty] = [s for s in plan if s.prefill_rank == p]
        assert empty.empty and empty.decode_rank == p % d_tp and not empty.writes_metadata
    for p in range(p_tp):
        assert rank_map.destinations_of(p_tp, d_tp, 0, 0, p, ("replicated",)) >= 1


def test_registration_names_both_sides_of_a_split_disagreement():
    items = whole_items(0)
    src = regions(share(items, 0, 1), 1)
    other = [r if r.part != "latent" else Region(**{**r.__dict__, "split": "heads"}) for r in src]
    pair = rank_map.pair_for(1, 1, KV_HEADS, Q_HEADS, 0, 0, SPLITS)
    [err] = _region_mismatches(src, other, pair, 1, 1, 0)
    assert (
        err
        == "region split mismatch: cache group 0 layer 0 latent is split replicated on prefill, "
        "heads on decode"
    )
    # decode registering a tp-2 rank's share where both sides say tp 1: both values named
    half = regions(share(items, 0, 2), 2)
    whole = rank_map.pair_for(1, 1, KV_HEADS, Q_HEADS, 0, 0, SPLITS)
    [err] = _region_mismatches(src, half, whole, 1, 1, 0)
    assert err == (
        "region item bytes mismatch: decode rank 0 should hold 4 KV head(s) per page (24 bytes per "
        "item of cache group 0 layer 0 k), it registered 12"
    )
    [err] = _region_mismatches(src[2:], half[2:], whole, 1, 1, 0)
    assert err == (
        "region segments mismatch: decode rank 0 of tp 1 should hold segments of [8, 16, 8] bytes "
        "of cache group 0 layer 0 conv, it registered [4, 8, 4]"
    )


def test_a_layer_may_hold_two_caches_of_two_groups():
    """V3.2's latent and indexer key on one layer: two groups, paired by (group, layer, part)."""
    a = [
        Region(ptr=1, nbytes=80, item_bytes=8, group=0, layer=3, part="latent", split="replicated"),
        Region(
            ptr=100, nbytes=40, item_bytes=4, group=1, layer=3, part="index_k", split="replicated"
        ),
    ]
    b = [r.at(r.ptr + 1000) for r in reversed(a)]
    paired, why = pair_regions(a, b)
    assert why == "" and paired == [1, 0]
    assert list(
        itertools.chain.from_iterable(
            x.tolist()
            for x in chunk_descriptors(a, [b[j] for j in paired], None, [[2], [5]], [[1], [6]])
        )
    ) == [1 + 16, 100 + 20, 1001 + 8, 1100 + 24, 8, 4]


# what a branch on a cache kind would name: the kinds' classes, their tags, their pools, the models
KIND_NAMES = re.compile(
    r"(?i)^(fullattention|slidingwindow|latentattention|recurrentstate|kvpool|latentpool|"
    r"full_attention|sliding_window|latent_attention|recurrent_state)$|mla|latent|deepseek|"
    r"indexer|swa|compress|hca|csa"
)
KIND_FREE = [
    "engine/scheduler.py",
    "engine/pd_queues.py",
    "disagg/prefill.py",
    "disagg/decode.py",
    "disagg/writer.py",
    "disagg/layout.py",
    "disagg/rank_map.py",
    "disagg/destinations.py",
    "disagg/kv_args.py",
    "disagg/messages.py",
    "disagg/sender.py",
    "disagg/receiver.py",
    "disagg/descriptors.py",
    "engine/kv_cache.py",
]


@pytest.mark.parametrize("path", KIND_FREE)
def test_the_scheduler_queues_and_transfer_layer_never_name_a_cache_kind(path):
    """Identifiers and string literals of the code (comments and docstrings aside) name no cache
    kind: a new kind is a spec, a pool and a model file."""
    src = (Path(pdserve.__file__).parent / path).read_text()
    found, prev = [], tokenize.INDENT
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.NAME or (
            tok.type == tokenize.STRING
            and prev not in (tokenize.INDENT, tokenize.NEWLINE, tokenize.NL, tokenize.DEDENT)
        ):  # not a docstring
            words = (
                re.findall(r"[A-Za-z_]+", tok.string)
                if tok.type == tokenize.STRING
                else [tok.string]
            )
            found += [f"line {tok.start[0]}: {w}" for w in words if KIND_NAMES.search(w)]
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            prev = tok.type
    assert found == []


def test_transfer_bytes_per_token_come_from_the_specs_counted_once():
    from pdserve.kv_spec import (
        CacheGroup,
        FullAttention,
        LatentAttention,
        RecurrentState,
        SlidingWindow,
        transfer_bytes_per_token,
    )

    # a rank of tp 4 holds 2 of 8 KV heads: the wire carries all 8 of each layer once
    full = CacheGroup(0, FullAttention(2, 64), (0, 1, 2))
    assert transfer_bytes_per_token([full], 8, 2) == 3 * 2 * 8 * 64 * 2
    # a latent is the same on every rank: counted once, whatever the KV heads (DeepSeek-V3's sizes)
    latent = CacheGroup(0, LatentAttention(512, 64), tuple(range(61)))
    assert transfer_bytes_per_token([latent], 1, 2) == 61 * 576 * 2
    # windows send their last pages only (left out beside a group that keeps every page), state per
    # request
    window = CacheGroup(1, SlidingWindow(2, 64, 128), (3, 4))
    state = CacheGroup(2, RecurrentState(("ssm",), ((4, 16),), ("float32",)), (5,))
    assert transfer_bytes_per_token([full, window, state], 8, 2) == transfer_bytes_per_token(
        [full], 8, 2
    )
    assert transfer_bytes_per_token([window], 8, 2) == 2 * 2 * 8 * 64 * 2  # a model of windows only


def test_the_pool_of_a_spec_describes_its_regions():
    import torch

    from pdserve.engine.cache_kinds import make_pool
    from pdserve.engine.kv_pool import KVPool, LatentPool, StatePool
    from pdserve.kv_spec import (
        CacheGroup,
        FullAttention,
        LatentAttention,
        RecurrentState,
        SlidingWindow,
    )

    latent = make_pool(CacheGroup(1, LatentAttention(16, 4), (0, 2)), 6, 4, torch.float32, "cpu")
    assert isinstance(latent, LatentPool) and latent.kv_heads == 0
    rs = latent.regions(CacheGroup(1, LatentAttention(16, 4), (0, 2)))
    assert [(r.layer, r.part, r.split, r.item_bytes, r.nbytes, r.final) for r in rs] == [
        (0, "latent", "replicated", 4 * 20 * 4, 6 * 4 * 20 * 4, "per_chunk"),
        (2, "latent", "replicated", 4 * 20 * 4, 6 * 4 * 20 * 4, "per_chunk"),
    ]
    x = torch.randn(3, 20)
    latent.write(1, torch.tensor([5, 5, 1]), torch.tensor([0, 3, 2]), x)
    assert torch.equal(latent.latent_cache(1)[[5, 5, 1], [0, 3, 2]], x)
    assert rs[1].ptr == latent.latent_cache(1).data_ptr() and rs[0].ptr + rs[0].nbytes == rs[1].ptr
    group = CacheGroup(0, SlidingWindow(2, 8, 16), (1,))
    kv = make_pool(group, 6, 4, torch.float32, "cpu")
    assert isinstance(kv, KVPool) and [(r.part, r.split, r.final) for r in kv.regions(group)] == [
        ("k", "heads", "last_chunk"),
        ("v", "heads", "last_chunk"),
    ]
    assert (
        make_pool(CacheGroup(0, FullAttention(2, 8), (0,)), 2, 4, torch.float32, "cpu").kv_heads
        == 2
    )
    # a recurrent state: a slot per request, each tensor in its own dtype, split in its segments
    spec = RecurrentState(
        ("conv", "ssm"), ((6, 3), (2, 4, 5)), ("bfloat16", "float32"), segments=((4, 1, 1), ())
    )
    group = CacheGroup(2, spec, (1, 3))
    state = make_pool(group, 5, 16, torch.float16, "cpu")
    assert isinstance(state, StatePool) and state.state("conv", 1).dtype == torch.bfloat16
    assert state.state("ssm", 0).shape == (5, 2, 4, 5) and state.allocator.capacity == 4
    rs = state.regions(group)
    assert [
        (r.layer, r.part, r.item_bytes, r.nbytes, r.split, r.segments, r.final) for r in rs
    ] == [
        (1, "conv", 36, 5 * 36, "segments", (24, 6, 6), "last_chunk"),
        (3, "conv", 36, 5 * 36, "segments", (24, 6, 6), "last_chunk"),
        (1, "ssm", 160, 5 * 160, "segments", (160,), "last_chunk"),
        (3, "ssm", 160, 5 * 160, "segments", (160,), "last_chunk"),
    ]
    assert all(not r.check() for r in rs)
    assert rs[1].ptr == state.state("conv", 1).data_ptr()
    assert state.nbytes == 2 * 5 * 36 + 2 * 5 * 160 == 2 * 5 * spec.page_bytes(16, 2)
    state.state("ssm", 1)[3] = 1.0
    state.clear("ssm", 1, torch.tensor([3]))
    assert not state.state("ssm", 1).any()
    with pytest.raises(ValueError, match="segments \\[4, 1\\] do not add up to axis 0"):
        RecurrentState(("conv",), ((6, 3),), ("float32",), segments=((4, 1),))


def test_a_layer_may_keep_two_caches_in_two_groups():
    """DeepSeek-V3.2's layers keep a latent and an indexer key: each layer is in both groups, and
    the transfer layer registers both regions of each layer under its own group."""
    import torch

    from pdserve.disagg.kv_args import KVArgs
    from pdserve.disagg.metadata import MetadataBuffers
    from pdserve.engine.cache_kinds import make_pool
    from pdserve.kv_spec import IndexKeys, LatentAttention, group_layers

    specs = [(LatentAttention(32, 8), IndexKeys(16))] * 2 + [LatentAttention(32, 8)]
    groups = group_layers(specs, first_layer=4)
    assert [(g.id, g.kind, g.layers) for g in groups] == [
        (0, "latent_attention", (4, 5, 6)),
        (1, "index_keys", (4, 5)),
    ]
    pools = [make_pool(g, 5, 4, torch.float32, "cpu") for g in groups]
    a = KVArgs.from_buffers(pools, MetadataBuffers(2), cache_groups=groups, prefill_start_layer=4)
    assert sorted((r.layer, r.group, r.part) for r in a.regions) == [
        (4, 0, "latent"),
        (4, 1, "index_k"),
        (5, 0, "latent"),
        (5, 1, "index_k"),
        (6, 0, "latent"),
    ]
    assert [(s["layer"], s["group"], s["kind"]) for s in a.layer_specs] == [
        (4, 0, "latent_attention"),
        (4, 1, "index_keys"),
        (5, 0, "latent_attention"),
        (5, 1, "index_keys"),
        (6, 0, "latent_attention"),
    ]
