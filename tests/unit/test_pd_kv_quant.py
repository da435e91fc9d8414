"""PD with a quantized KV cache on the local backend, in process: decode continues from the
quantized pages (and int8 scales) prefill sent with the tokens a colocated engine with the same
``--kv-cache-dtype`` gives; the transfer stats count about half the bytes of a bf16 cache; a
prefill and a decode with different KV dtypes are refused with both named."""

from __future__ import annotations

import random

import pytest
import torch

import pdserve
from tests.helpers.checkpoints import build_tiny_checkpoint
from tests.unit.test_pd_layer_pipeline import close, serve
from tests.unit.test_pd_queues import make, req, run_until

torch.set_num_threads(1)
HEAD_DIM = 64  # an int8 row's float32 scale adds 4 / HEAD_DIM to its bytes
FORMATS = ("bfloat16", "int8", "fp8_e4m3")


def model() -> str:
    return build_tiny_checkpoint("llama", head_dim=HEAD_DIM)


@pytest.fixture(scope="module")
def pairs():
    """A local prefill and decode per KV dtype: {dtype: (prefill, decode, bootstrap port)}."""
    from tests.helpers.cluster import free_port

    out = {}
    try:
        for fmt in FORMATS:
            bport = free_port()
            kw = dict(model=model(), kv_cache_dtype=fmt, max_total_tokens=8192)
            P = make("prefill", "local", disaggregation_bootstrap_port=bport, **kw)
            D = make("decode", "local", **kw)
            out[fmt] = (P, D, bport)
        yield out
    finally:
        for P, D, _ in out.values():
            close(P, D)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    return [[rng.randrange(100, 40000) for _ in range(n)] for n in (230, 40)]


def test_pd_gives_colocated_tokens_with_half_the_bytes(pairs, prompts):
    sent = {}
    for fmt, (P, D, bport) in pairs.items():
        served = serve(P, D, bport, prompts)
        ref = pdserve.Engine(
            model_path=model(),
            torch_num_threads=1,
            max_total_tokens=8192,
            page_size=16,
            chunked_prefill_size=64,
            kv_cache_dtype=fmt,
        )
        want = ref.generate(
            input_ids=prompts,
            sampling_params={"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
        )
        ref.shutdown()
        for (rp, rd), out in zip(served, want):
            assert rd.output_ids == out["output_ids"], f"{fmt}, prompt of {len(rp.input_ids)}"
        transfers = {t["rid"]: t for t in P.pd.recent_transfers}
        sent[fmt] = [transfers[rp.rid]["kv_bytes"] for rp, _ in served]
        for s in (P, D):
            info = s.check_integrity()
            assert info["in_use_pages"] == 0
            assert info["metadata_slots_free"] == info["metadata_slots_total"]
    # as the stats count them: fp8 one byte per value, int8 one byte and a float32 per row
    for bf16, i8, f8 in zip(sent["bfloat16"], sent["int8"], sent["fp8_e4m3"]):
        assert f8 * 2 == bf16
        assert i8 / bf16 == (HEAD_DIM + 4) / (2 * HEAD_DIM)


def test_kv_dtype_mismatch_is_refused_naming_both(pairs, prompts):
    P, _, bport = pairs["int8"]
    _, D, _ = pairs["fp8_e4m3"]
    room = random.Random(9).randrange(2**63)
    rp, rd = req("mp", prompts[1], room, port=bport), req("md", prompts[1], room, port=bport)
    P.add_request(rp)
    D.add_request(rd)
    run_until(lambda: rd.finished and rp.finished, P, D)
    why = rd.finish_reason.message
    assert "kv_dtype mismatch: prefill int8, decode fp8_e4m3" in why, why
    for s in (P, D):  # the failed room left nothing behind
        run_until(lambda: s.check_integrity()["in_use_pages"] == 0, P, D)
        info = s.check_integrity()
        assert info["metadata_slots_free"] == info["metadata_slots_total"], info


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_int8_pages_and_scales_over_rdma_engines(backend, pairs, prompts):
    """The same int8 pages and scale regions registered with Mooncake's and NIXL's engines (TCP
    / UCX on loopback): decode gives the local pair's tokens, and the same bytes move."""
    from pdserve.disagg.transfer.base import get_backend
    from tests.helpers.cluster import free_port

    try:
        get_backend(backend)
    except ValueError as e:
        pytest.skip(str(e))
    P0, D0, bport0 = pairs["int8"]
    seed = 3 + ["mooncake", "nixl"].index(backend)  # fresh rooms on the shared local pair
    local = serve(P0, D0, bport0, prompts, seed=seed)
    local_bytes = {
        len(rp.input_ids): t["kv_bytes"]
        for rp, _ in local
        for t in P0.pd.recent_transfers
        if t["rid"] == rp.rid
    }
    bport = free_port()
    kw = dict(model=model(), kv_cache_dtype="int8", max_total_tokens=8192, host="127.0.0.1")
    P = make("prefill", backend, disaggregation_bootstrap_port=bport, **kw)
    D = make("decode", backend, **kw)
    try:
        served = serve(P, D, bport, prompts, seed=seed)
        transfers = {t["rid"]: t for t in P.pd.recent_transfers}
        for (rp, rd), (_, want) in zip(served, local):
            assert rd.output_ids == want.output_ids, f"{backend}, prompt of {len(rp.input_ids)}"
            assert transfers[rp.rid]["kv_bytes"] == local_bytes[len(rp.input_ids)]
        for s in (P, D):
            info = s.check_integrity()
            assert info["in_use_pages"] == 0
            assert info["metadata_slots_free"] == info["metadata_slots_total"]
    finally:
        close(P, D)
