"""The typed transfer layout: regions paired by cache group and layer, per-layer cache specs
compared with both sides' values named, one chunk's descriptors group by group, and a group whose
pages are final only after the last chunk refused in an earlier one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.config import ServerArgs
from pdserve.disagg.bootstrap import BootstrapServer
from pdserve.disagg.kv_args import KVArgs, compat_mismatches
from pdserve.disagg.layout import chunk_descriptors, pair_regions
from pdserve.disagg.manager import KVManager, buffer_allocator, get_kv_class
from pdserve.disagg.metadata import MetadataBuffers
from pdserve.disagg.poll import KVPoll
from pdserve.engine.kv_pool import KVPool
from pdserve.kv_spec import CacheGroup, FullAttention, SlidingWindow
from tests.helpers.cluster import wait_for

torch.set_num_threads(1)


def groups(window: int = 16, first: int = 0, layers: int = 3) -> list[CacheGroup]:
    """Layers first.. : sliding, sliding, full (as Gemma 3's 2 : 1)."""
    ids = list(range(first, first + layers))
    slide = tuple(i for i in ids if i % 3 != 2)
    full = tuple(i for i in ids if i % 3 == 2)
    out = [CacheGroup(0, SlidingWindow(2, 8, window), slide)]
    if full:
        out.append(CacheGroup(1, FullAttention(2, 8), full))
    return out


def kv_args(
    gs: list[CacheGroup], alloc=None, pages: int = 16, **kw
) -> tuple[KVArgs, list[KVPool], MetadataBuffers]:
    pools = [
        KVPool(len(g.layers), pages, 4, 2, 8, torch.float32, "cpu", *([alloc] if alloc else []))
        for g in gs
    ]
    meta = MetadataBuffers(4, **({"allocator": alloc} if alloc else {}))
    return (
        KVArgs.from_buffers(pools, meta, cache_groups=gs, model_fingerprint="tiny", **kw),
        pools,
        meta,
    )


def test_regions_pair_by_group_and_layer():
    whole, _, _ = kv_args(groups(layers=6))
    stage, _, _ = kv_args(
        groups(first=3, layers=3), prefill_start_layer=3
    )  # a pipeline stage: layers 3..5
    assert [r.final for r in whole.regions[:2]] == ["last_chunk"] * 2 and whole.regions[
        -1
    ].final == "per_chunk"
    paired, why = pair_regions(stage.regions, whole.regions)
    assert why == ""
    assert [whole.regions[j].key for j in paired] == [r.key for r in stage.regions]
    assert [(r.group, r.layer, r.part) for r in stage.regions[:2]] == [(0, 3, "k"), (0, 3, "v")]
    assert len(set(paired)) == len(paired)  # K and V of a layer land in K and V
    _, why = pair_regions(whole.regions, stage.regions)
    assert why == "decode registered no region for cache group 0 layer 0 k"


def test_layer_specs_mismatch_names_both_values():
    p, _, _ = kv_args(groups(window=16))
    d, _, _ = kv_args(groups(window=8))
    errs = compat_mismatches(p.compat_info(), d.compat_info())
    assert (
        errs
        and "layer 0 cache mismatch" in errs[0]
        and "window 16" in errs[0]
        and "window 8" in errs[0]
    ), errs
    assert compat_mismatches(p.compat_info(), p.compat_info()) == []
    # one group where the other side has two: the kinds are named
    one, _, _ = kv_args([CacheGroup(0, FullAttention(2, 8), (0, 1, 2))])
    errs = compat_mismatches(p.compat_info(), one.compat_info())
    assert "sliding_window" in errs[0] and "full_attention" in errs[0], errs


def test_chunk_descriptors_address_each_group_with_its_own_pages():
    a, pools, _ = kv_args(groups())
    dst = [r.at(r.ptr + 10**9) for r in a.regions]  # decode's paired regions, somewhere else
    src_pages, dst_pages = [[], [3, 4]], [[], [7, 8]]  # only the full group moves in this chunk
    s, d, n = chunk_descriptors(a.regions, dst, None, src_pages, dst_pages)
    full = [i for i, r in enumerate(a.regions) if r.group == 1]
    item = pools[1].item_bytes
    assert list(s) == [a.regions[i].ptr + 3 * item for i in full]  # one run of 2 pages per region
    assert list(d) == [dst[i].ptr + 7 * item for i in full] and list(n) == [2 * item] * len(full)
    assert chunk_descriptors(a.regions, dst, None, [[], []], [[], []]) is None
    s, _, _ = chunk_descriptors(a.regions, dst, None, [[1], [3, 4]], [[2], [7, 8]])
    assert len(s) == len(a.regions) and np.all(s > 0)


@pytest.fixture
def two_group_pair():
    server = BootstrapServer("127.0.0.1", 0, expected_ranks=1)
    args = ServerArgs(
        model_path="m",
        device="cpu",
        page_size=4,
        disaggregation_bootstrap_port=server.port,
        disaggregation_bootstrap_timeout=20,
        disaggregation_waiting_timeout=20,
    )
    p_args, p_pools, p_meta = kv_args(groups())
    d_args, d_pools, _ = kv_args(groups(), alloc=buffer_allocator("local", "decode"))
    for pool in p_pools:
        pool.buffer.copy_(torch.randn(pool.buffer.shape))
    P, D = KVManager(p_args, "prefill", args, "local"), KVManager(d_args, "decode", args, "local")
    yield P, D, p_pools, d_pools, p_meta, f"127.0.0.1:{server.port}"
    P.close()
    D.close()
    server.shutdown()


def _room(P, D, addr, room, dst):
    sender = get_kv_class("local", "sender")(P, addr, room)
    receiver = get_kv_class("local", "receiver")(D, addr, room)
    wait_for(lambda: receiver.poll() == KVPoll.WaitingForInput, 20, "decode's connection")
    receiver.send_metadata(dst, 1)
    wait_for(lambda: sender.poll() == KVPoll.WaitingForInput, 20, "decode's transfer request")
    return sender, receiver


def test_each_group_lands_in_its_own_pages(two_group_pair):
    P, D, p_pools, d_pools, p_meta, addr = two_group_pair
    sender, receiver = _room(
        P, D, addr, 5, [[9, 10], [4, 5, 6]]
    )  # window group: the last 2 pages only
    sender.init([2, 3], 0)
    p_meta.set_row(0, 5, 11)
    sender.send([[], [1, 2]])  # full-attention pages as chunks complete
    sender.send([[2, 3], [3]], last_chunk=True)  # the window's pages once, with the last chunk
    wait_for(lambda: receiver.poll() == KVPoll.Success, 20, "Success on decode")
    assert torch.equal(d_pools[0].buffer[:, :, [9, 10]], p_pools[0].buffer[:, :, [2, 3]])
    assert torch.equal(d_pools[1].buffer[:, :, [4, 5, 6]], p_pools[1].buffer[:, :, [1, 2, 3]])
    sender.clear()
    receiver.clear()


def test_a_last_chunk_group_sent_early_fails_the_room(two_group_pair):
    P, D, _, d_pools, _, addr = two_group_pair
    before = d_pools[0].buffer.clone()
    sender, receiver = _room(P, D, addr, 6, [[9, 10], [4, 5, 6]])
    sender.init([2, 3], 0)
    sender.send([[2, 3], [1]])  # window pages in a chunk that is not the last
    assert sender.poll() == KVPoll.Failed
    assert "before the last chunk" in sender.failure_reason()
    wait_for(lambda: receiver.poll() == KVPoll.Failed, 20, "decode told")
    assert torch.equal(d_pools[0].buffer, before)  # nothing written
    sender.clear()
    receiver.clear()


def test_grammar_engines_must_agree():
    """Decode continues prefill's grammar from its first token: the engine and the vocabulary its
    masks index are compared at registration (unknown, "", is not)."""
    p, _, _ = kv_args(groups(), grammar="xgrammar:0123abcd")
    for other, bad in (
        ("llguidance:0123abcd", True),
        ("xgrammar:ffff0000", True),
        ("", False),
        ("xgrammar:0123abcd", False),
    ):
        d, _, _ = kv_args(groups(), grammar=other)
        errs = compat_mismatches(p.compat_info(), d.compat_info())
        assert bool(errs) == bad, (other, errs)
        if bad:
            assert errs == [
                f"grammar mismatch: prefill xgrammar:0123abcd, decode {other} (give both servers "
                "the same --grammar-backend and tokenizer: decode continues the grammar from "
                "prefill's first token, so both must allow the same tokens)"
            ]


def test_state_layers_of_other_dtypes_are_refused_naming_both():
    """A hybrid whose decode keeps its SSM state in bf16 where prefill keeps float32: both named."""
    from pdserve.engine.kv_pool import StatePool
    from pdserve.kv_spec import RecurrentState

    def args(ssm_dtype: str) -> KVArgs:
        state = RecurrentState(("conv", "ssm"), ((6, 3), (2, 4, 5)), ("float32", ssm_dtype))
        gs = [CacheGroup(0, FullAttention(2, 8), (1,)), CacheGroup(1, state, (0, 2))]
        pools = [
            KVPool(1, 16, 4, 2, 8, torch.float32, "cpu"),
            StatePool(state, 2, 4, "cpu"),
        ]
        meta = MetadataBuffers(4)
        return KVArgs.from_buffers(pools, meta, cache_groups=gs, model_fingerprint="tiny")

    errs = compat_mismatches(args("float32").compat_info(), args("bfloat16").compat_info())
    assert errs and "layer 0 cache mismatch" in errs[0], errs
    assert "float32" in errs[0] and "bfloat16" in errs[0], errs
