"""The routed experts' store (ids kept with the KV pages), its encoding, the request checks, and
its transfer region: compatibility between prefill and decode, registration round trip,
descriptors and destination bounds."""

from __future__ import annotations

import base64
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pdserve.disagg import rank_map
from pdserve.disagg.destinations import DestinationGuard
from pdserve.disagg.kv_args import KVArgs, compat_mismatches
from pdserve.disagg.layout import chunk_descriptors
from pdserve.disagg.messages import (
    BufferDesc,
    Register,
    TransferRequest,
    decode_message,
    encode_message,
)
from pdserve.engine.routed_experts import (
    RoutedExpertsSpec,
    RoutedExpertsStore,
    decode,
    encode,
)
from pdserve.kv_region import Region
from pdserve.routed_experts_args import refusal

torch.set_num_threads(1)

SPEC = RoutedExpertsSpec(moe_layers=(0, 2), num_layers=3, top_k=2, num_experts=8, group=0)


def forward(
    store: RoutedExpertsStore, pages: list[int], offsets: list[int], ids: dict[int, torch.Tensor]
) -> None:
    """One forward of len(pages) tokens whose layers routed them to ``ids[layer]``."""
    fb = SimpleNamespace(
        input_ids=torch.zeros(len(pages), dtype=torch.long),
        out_offsets=torch.tensor(offsets),
        groups=[SimpleNamespace(out_pages=torch.tensor(pages))],
    )
    store.begin_forward()
    store.ctx.captured.update(ids)
    store.write(fb)


def test_store_keeps_ids_at_token_slots_and_reads_them_in_token_order():
    store = RoutedExpertsStore(
        SPEC, num_pages=5, page_size=2, ctx=SimpleNamespace(captured={}), device="cpu"
    )
    assert store.rows.shape == (5, 2, 2, 2) and store.rows.dtype == torch.int16
    # a sequence held in pages [3, 1]: a chunk of 3 tokens, then one decode token
    first = {0: torch.tensor([[1, 2], [3, 4], [5, 6]]), 2: torch.tensor([[7, 0], [6, 1], [5, 2]])}
    forward(store, [3, 3, 1], [0, 1, 0], first)
    forward(store, [1], [1], {0: torch.tensor([[4, 3]]), 2: torch.tensor([[2, 7]])})
    got = store.read([3, 1], 0, 4)
    assert got.dtype == torch.int32 and got.shape == (4, 3, 2)
    assert got[:, 0].tolist() == [[1, 2], [3, 4], [5, 6], [4, 3]]
    assert got[:, 2].tolist() == [[7, 0], [6, 1], [5, 2], [2, 7]]
    assert not got[:, 1].any()  # the dense layer: 0, as SGLang leaves it
    assert store.read([3, 1], 2, 4)[:, 0].tolist() == [[5, 6], [4, 3]]
    req = SimpleNamespace(kv_len=3, routed_experts_start_len=1, kv=SimpleNamespace(pages=[[3, 1]]))
    np.testing.assert_array_equal(decode(store.collect(req), 3, 2), got[1:3].numpy())


def test_a_forward_without_a_layers_ids_is_an_error():
    store = RoutedExpertsStore(
        SPEC, num_pages=3, page_size=2, ctx=SimpleNamespace(captured={}), device="cpu"
    )
    with pytest.raises(RuntimeError, match="MoE layer 2: the forward of 1 tokens captured None"):
        forward(store, [1], [0], {0: torch.tensor([[1, 2]])})


def test_encoding_is_little_endian_int32_as_sglang_sends_it():
    ids = torch.arange(12, dtype=torch.int32).view(2, 3, 2)
    data = encode(ids)
    assert data == np.arange(12, dtype="<i4").tobytes()
    back = np.frombuffer(base64.b64decode(base64.b64encode(data)), dtype=np.int32).reshape(-1, 3, 2)
    np.testing.assert_array_equal(back, ids.numpy())


def test_requests_are_refused_with_the_reason():
    on, off = (
        SimpleNamespace(enable_return_routed_experts=True),
        SimpleNamespace(enable_return_routed_experts=False),
    )
    assert "--enable-return-routed-experts" in refusal(off, SPEC, 0, 5)
    assert "no MoE layers" in refusal(on, None, 0, 5)
    assert refusal(on, SPEC, 5, 5) == "" and refusal(on, SPEC.describe(), 0, 5) == ""
    assert "routed_experts_start_len" in refusal(on, SPEC, 6, 5)
    assert "routed_experts_start_len" in refusal(on, SPEC, True, 5)


ROUTED = Region(
    ptr=1 << 20, nbytes=10 * 64, item_bytes=64, group=0, part="routed_experts", split="replicated"
)


def kv_args(routed: bool, **kw) -> KVArgs:
    kv = [
        Region(ptr=p, nbytes=16 * 128, item_bytes=128, group=0, layer=0, part=part)
        for p, part in ((4096, "k"), (8192, "v"))
    ]
    extra = dict(routed_experts=SPEC.describe()) if routed else {}
    return KVArgs(
        regions=kv + [ROUTED] * routed,
        page_size=4,
        total_kv_head_num=1,
        kv_head_num=1,
        **extra,
        **kw,
    )


def test_prefill_and_decode_must_agree_on_returning_routed_experts():
    with_ids, without = kv_args(True).compat_info(), kv_args(False).compat_info()
    assert compat_mismatches(with_ids, with_ids) == []
    [err] = compat_mismatches(with_ids, without)
    assert (
        err.startswith("routed_experts mismatch: prefill {")
        and "--enable-return-routed-experts" in err
    )
    # a side that does not list the field (the bootstrap server's instance info) is not compared
    assert (
        compat_mismatches({k: v for k, v in without.items() if k != "routed_experts"}, with_ids)
        == []
    )


def test_register_carries_the_region_and_destinations_are_bounded_by_it():
    a = kv_args(True)
    msg = Register(
        session_id="s",
        decode_rank=0,
        decode_tp_size=1,
        reply_endpoint="tcp://127.0.0.1:1",
        buffers=BufferDesc.from_kv_args(a),
        compat=a.compat_info(),
        backend="local",
    )
    back = decode_message(encode_message(msg))
    assert back == msg and ROUTED in back.buffers.regions and (1 << 20, 640) in back.buffers.spans()
    # the KV regions hold 16 pages, the routed region 10: page 10 is out of bounds
    guard = DestinationGuard(back.buffers, back.buffers.regions, 1)
    req = TransferRequest(session_id="s", room=1, generation=1, dst_pages=[[9, 10]], aux_slot=-1)
    assert "outside decode's registered KV pool (10 pages)" in guard.check(req)


def test_routed_rows_go_with_the_groups_pages():
    a = kv_args(True)
    dst = [r.at(r.ptr + (4 << 20)) for r in a.regions]
    src, dst_, lens = chunk_descriptors(
        a.regions, dst, rank_map.pair_for(1, 1, 1, 1, 0, 0, a.splits), [[2, 3, 7]], [[4, 5, 6]]
    )
    # pages 2-3 -> 4-5 are one run, 7 -> 6 another, in each region; the routed rows are 64 bytes a
    # page
    routed = [i for i, s in enumerate(src.tolist()) if s >= 1 << 20]
    assert [src[i] for i in routed] == [(1 << 20) + 2 * 64, (1 << 20) + 7 * 64]
    assert [dst_[i] for i in routed] == [(5 << 20) + 4 * 64, (5 << 20) + 6 * 64]
    assert [lens[i] for i in routed] == [128, 64] and len(src) == 6
    # a decode rank that another prefill rank writes (tp 2 -> 1: rank 0 writes), none from rank 1
    split = kv_args(True, tp_size=2)
    assert rank_map.pair_for(2, 1, 1, 2, 1, 0, split.splits).empty
    assert (
        chunk_descriptors(
            split.regions, dst, rank_map.pair_for(2, 1, 1, 2, 1, 0, split.splits), [[2]], [[4]]
        )
        is None
    )
