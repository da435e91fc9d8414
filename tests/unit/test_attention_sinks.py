"""Attention sinks (GPT-OSS): the torch and cpu backends over the paged KV cache, and the C++
kernels on their own, against a dense float64 reference written like HF's eager attention (whose
own ``eager_attention_forward`` the reference is checked against first).

The backends run mixed batches (prefill, one-token prefill, extend after a prefix, decode rows
leading the batch and not) over scattered pages of size 1 and 16, on a sliding-window layer and a
full one, for several forwards in a row.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from pdserve import kernels
from pdserve.engine.kv_pool import KVPool
from pdserve.forward_batch import ForwardBatch, GroupTable
from pdserve.layers.attention import torch_backend
from pdserve.layers.attention.base import AttentionBackend, AttnLayer
from pdserve.layers.attention.cpu_backend import CpuAttnBackend
from pdserve.layers.attention.torch_backend import TorchAttnBackend, attention
from tests.helpers.spans import first_visible_key

torch.set_num_threads(1)

HEADS, KV_HEADS, HEAD_DIM, WINDOW = 8, 2, 64, 8


def additive_mask(visible: torch.Tensor) -> torch.Tensor:
    """HF's float mask: 0 where a key is visible, the dtype's lowest value where not (float64)."""
    zero = torch.zeros((), dtype=torch.float64)
    return torch.where(visible, zero, torch.finfo(torch.float64).min)


def eager_reference(q, k, v, q_pos, scale, window, sinks):
    """float64 attention as HF's GPT-OSS eager code computes it. ``q`` [Lq, H, D] at positions
    ``q_pos``; ``k``/``v`` [Lk, KVH, D] the whole sequence; ``sinks`` [H] or None."""
    q, k, v = q.double(), k.double(), v.double()
    heads, kv_heads = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    weights = torch.einsum("qhd,khd->hqk", q, k) * scale  # [H, Lq, Lk]
    kpos = torch.arange(k.shape[0])
    visible = kpos[None, :] <= q_pos[:, None]
    if window:  # W > 0 a sliding window, -C an attention chunk
        first = torch.tensor([first_visible_key(int(p), window) for p in q_pos])
        visible &= kpos[None, :] >= first[:, None]
    weights = weights + additive_mask(visible)
    if sinks is not None:  # one more logit column per row, its head's sink
        weights = torch.cat(
            [weights, sinks.double().view(heads, 1, 1).expand(heads, q.shape[0], 1)], -1
        )
    weights = weights - weights.max(-1, keepdim=True).values
    probs = torch.softmax(weights, -1)
    if sinks is not None:
        probs = probs[..., :-1]  # the sink column carries no value
    return torch.einsum("hqk,khd->qhd", probs, v)


def test_reference_is_hf_eager_attention():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    gen = torch.Generator().manual_seed(0)
    lq, lk = 5, 13
    q = torch.randn(lq, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    k = torch.randn(lk, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    v = torch.randn(lk, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    sinks = 2 * torch.randn(HEADS, generator=gen, dtype=torch.float64)
    q_pos = torch.arange(lk - lq, lk)
    kpos = torch.arange(lk)
    visible = (kpos[None, :] <= q_pos[:, None]) & ((q_pos[:, None] - kpos[None, :]) < WINDOW)
    mask = additive_mask(visible)[None, None]
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=HEADS // KV_HEADS, training=False)
    hf, _ = eager_attention_forward(
        module,
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        mask,
        scaling=HEAD_DIM**-0.5,
    )
    ours = eager_reference(q, k, v, q_pos, HEAD_DIM**-0.5, WINDOW, sinks)
    torch.testing.assert_close(ours, hf[0], atol=1e-12, rtol=0)
    # the sinks matter at this size, so a backend that dropped them would fail the tests below
    assert (ours - eager_reference(q, k, v, q_pos, HEAD_DIM**-0.5, WINDOW, None)).abs().max() > 0.05


class PagedAttention:
    """One cache group of two layers (0: sliding window, 1: full) over scattered pages; runs one
    backend forward per step and keeps every sequence's K/V for the reference."""

    def __init__(
        self, backend: AttentionBackend, page: int, dtype: torch.dtype, num_pages: int, seed: int
    ):
        self.backend, self.page, self.dtype = backend, page, dtype
        self.pool = KVPool(2, num_pages, page, KV_HEADS, HEAD_DIM, dtype, "cpu")
        self.free = list(range(1, num_pages))
        random.Random(seed).shuffle(self.free)
        self.gen = torch.Generator().manual_seed(seed)
        self.pages: dict[str, list[int]] = {}
        self.kv: dict[str, list[list[torch.Tensor]]] = {}  # sid -> per layer [k chunks, v chunks]
        self.layers = [
            AttnLayer(0, HEAD_DIM**-0.5, WINDOW, has_sinks=True),
            AttnLayer(1, HEAD_DIM**-0.5, None, has_sinks=True),
        ]
        self.sinks = [(2 * torch.randn(HEADS, generator=self.gen)).to(dtype) for _ in self.layers]

    def randn(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.dtype)

    def step(self, chunks: dict[str, int]) -> float:
        """One forward of ``{sid: new tokens}``; returns the largest error against the reference."""
        prefix_lens, extend_lens, out_pages, out_offsets = [], [], [], []
        for sid, n in chunks.items():
            prefix = sum(c.shape[0] for c in self.kv[sid][0][0]) if sid in self.kv else 0
            pages = self.pages.setdefault(sid, [])
            while len(pages) * self.page < prefix + n:
                pages.append(self.free.pop())
            out_pages += [pages[p // self.page] for p in range(prefix, prefix + n)]
            out_offsets += [p % self.page for p in range(prefix, prefix + n)]
            prefix_lens.append(prefix)
            extend_lens.append(n)
        table = torch.zeros(len(chunks), max(len(self.pages[s]) for s in chunks), dtype=torch.long)
        for row, sid in enumerate(chunks):
            table[row, : len(self.pages[sid])] = torch.tensor(self.pages[sid])
        total = sum(extend_lens)
        fb = ForwardBatch(
            input_ids=torch.zeros(total, dtype=torch.long),
            positions=torch.zeros(total, dtype=torch.long),
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            groups=[GroupTable(self.pool, table, torch.tensor(out_pages))],
            layer_group=[0, 0],
            layer_slot=[0, 1],
            out_offsets=torch.tensor(out_offsets),
            logits_idx=torch.arange(total),
            attn_backend=self.backend,
        )
        self.backend.init_forward(fb)
        err = 0.0
        for li, layer in enumerate(self.layers):
            q, k, v = (
                self.randn(total, HEADS, HEAD_DIM),
                self.randn(total, KV_HEADS, HEAD_DIM),
                self.randn(total, KV_HEADS, HEAD_DIM),
            )
            out = self.backend.forward(layer, q, k, v, fb, sinks=self.sinks[li])
            assert out.shape == q.shape and out.dtype == q.dtype
            for (sid, n), start, prefix in zip(chunks.items(), fb.extend_starts, prefix_lens):
                hist = self.kv.setdefault(sid, [[[], []], [[], []]])[li]
                hist[0].append(k[start : start + n])
                hist[1].append(v[start : start + n])
                ref = eager_reference(
                    q[start : start + n],
                    torch.cat(hist[0]),
                    torch.cat(hist[1]),
                    torch.arange(prefix, prefix + n),
                    layer.scale,
                    layer.sliding_window,
                    self.sinks[li],
                )
                err = max(err, (out[start : start + n].double() - ref).abs().max().item())
        return err


# a prefill and a one-token prefill; a leading decode row, an extend after a prefix, a prefill;
# decode rows leading and not, an extend, a prefill longer than the flash kernel's key block and
# query block; decode only
STEPS = [
    {"a": 20, "b": 1},
    {"a": 1, "b": 7, "c": 5},
    {"c": 1, "a": 3, "b": 1, "d": 150},
    {"d": 1, "a": 1, "b": 1, "c": 1},
]


@pytest.fixture(scope="module")
def ops():
    mod = kernels.load()
    assert mod is not None, f"CPU kernels did not build: {kernels.unavailable_reason()}"
    return mod


def backend_of(name: str, ops):
    if name == "torch":
        return TorchAttnBackend(), torch.float32
    if name == "cpu-float32":  # the decode kernel for one-token rows, the torch math for extends
        return CpuAttnBackend(ops=ops, compute_dtype=torch.float32), torch.float32
    return CpuAttnBackend(
        ops=ops, compute_dtype=torch.bfloat16
    ), torch.bfloat16  # every row in the flash kernel


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("name", ["torch", "cpu-float32"])
def test_backend_matches_eager_reference(ops, name, page):
    _backend_matches_eager_reference(ops, name, page)


@pytest.mark.parametrize("page", [1, 16])
def test_bf16_backend_matches_eager_reference(ops, flash_isa, page):
    _backend_matches_eager_reference(ops, "cpu-bf16", page)


def _backend_matches_eager_reference(ops, name, page):
    backend, dtype = backend_of(name, ops)
    run = PagedAttention(backend, page, dtype, num_pages=256 if page == 1 else 64, seed=page)
    if name == "cpu-bf16":
        assert backend.uses_flash(
            SimpleNamespace(groups=[SimpleNamespace(pool=run.pool, paged=True)])
        )
    # float32: accumulation error only; bf16: rounded inputs to the P V product and the output
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for chunks in STEPS:
        err = run.step(chunks)
        assert err < tol, f"{chunks}: max abs error {err}"


def test_sinks_are_read_at_each_forward():
    """The sinks are the model's parameter, loaded after the layer is described: a backend must
    take the values it is given at that forward."""
    run = PagedAttention(TorchAttnBackend(), 16, torch.float32, num_pages=16, seed=3)
    assert run.step({"a": 9}) < 2e-5
    for s in run.sinks:
        s.mul_(-3.0)
    assert run.step({"a": 1, "b": 4}) < 2e-5


def test_sinks_must_come_with_the_layer_flag():
    run = PagedAttention(TorchAttnBackend(), 16, torch.float32, num_pages=16, seed=4)
    run.sinks = [None, None]
    with pytest.raises(AssertionError, match="has_sinks"):
        run.step({"a": 3})


def test_backends_declare_sinks_and_refuse_by_name():
    layers = [AttnLayer(0, 0.125, has_sinks=True), AttnLayer(1, 0.125, 8)]
    assert TorchAttnBackend.missing_features(layers) == []
    assert CpuAttnBackend.missing_features(layers) == []  # both kernels take sinks

    class NoSinks(TorchAttnBackend):
        name = "nosinks"
        supports_sinks = False

    assert NoSinks.missing_features(layers) == ["attention sinks"]
    assert NoSinks.missing_features(layers[1:]) == []
    with pytest.raises(
        ValueError, match="'nosinks' does not support the attention sinks of GptOssForCausalLM"
    ):
        NoSinks().check_supported(["full_attention"], layers, "GptOssForCausalLM")
    # a model with both features the backend lacks hears of both
    NoSinks.supports_softcap = False
    with pytest.raises(ValueError, match="soft-capping and attention sinks"):
        NoSinks().check_supported(["full_attention"], [AttnLayer(0, 0.1, None, 30.0, True)], "M")


# ---- the kernels on their own ------------------------------------------------------------------


def paged_case(gen, lens, page, kv_dtype):
    """A pool with every request's pages scattered over it; (k_cache, v_cache, page table)."""
    max_pages = (max(lens) + page - 1) // page
    num_pages = len(lens) * max_pages + 3
    kc = torch.randn(num_pages, KV_HEADS, page, HEAD_DIM, generator=gen).to(kv_dtype)
    vc = torch.randn(num_pages, KV_HEADS, page, HEAD_DIM, generator=gen).to(kv_dtype)
    perm = torch.randperm(num_pages - 1, generator=gen)[: len(lens) * max_pages] + 1
    return kc, vc, perm.view(len(lens), max_pages).to(torch.int32)


def sequence_kv(kc, vc, table, b, n):
    """K, V [n, kv_heads, D] of request b's first n positions."""
    page = kc.shape[2]
    pos = torch.arange(n)
    pages = table[b][pos // page].long()
    return kc[pages, :, pos % page], vc[pages, :, pos % page]


@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize(
    "kv_dtype,q_dtype,page",
    [
        (torch.float32, torch.float32, 16),
        (torch.bfloat16, torch.float32, 1),
        (torch.bfloat16, torch.bfloat16, 16),
    ],
)
def test_decode_kernel_with_sinks(ops, isa, kv_dtype, q_dtype, page, window):
    gen = torch.Generator().manual_seed(page + window)
    lens = [1, 2, 15, 17, 300, 1001]
    kc, vc, table = paged_case(gen, lens, page, kv_dtype)
    q = torch.randn(len(lens), HEADS, HEAD_DIM, generator=gen).to(q_dtype)
    sinks = 3 * torch.randn(HEADS, generator=gen)
    scale, lens_t = HEAD_DIM**-0.5, torch.tensor(lens, dtype=torch.int32)
    tol = 2e-6 if q_dtype == torch.float32 else 2**-8 * 4
    for s in (sinks, None):
        out = torch.full_like(q, float("nan"))
        ops.paged_decode_attention(out, q, kc, vc, table, lens_t, scale, window, s)
        for b, n in enumerate(lens):
            k, v = sequence_kv(kc, vc, table, b, n)
            ref = eager_reference(q[b : b + 1], k, v, torch.tensor([n - 1]), scale, window, s)
            err = (out[b : b + 1].double() - ref).abs().max().item()
            assert err < tol, f"sinks {s is not None}, length {n}: max abs error {err}"
    plain = torch.empty_like(q)
    ops.paged_decode_attention(
        plain, q, kc, vc, table, lens_t, scale, window
    )  # sinks default to none
    assert torch.equal(plain, out)
    with pytest.raises(RuntimeError, match="sinks has 7 values for 8 query heads"):
        ops.paged_decode_attention(out, q, kc, vc, table, lens_t, scale, window, sinks[:7])
    with pytest.raises(RuntimeError, match="float32"):
        ops.paged_decode_attention(out, q, kc, vc, table, lens_t, scale, window, sinks.double())


@pytest.mark.parametrize("window", [0, 70, -48])
@pytest.mark.parametrize("page", [1, 16])
def test_flash_kernel_with_and_without_sinks(ops, flash_isa, page, window):
    gen = torch.Generator().manual_seed(page * 100 + abs(window))
    # (new tokens, length): decode rows, short and long prefills, extends after a prefix; more than
    # one query block (16) and key block (64)
    rows = [(1, 1), (1, 200), (5, 5), (40, 170), (130, 130), (1, 64), (17, 81)]
    lens = [n for _, n in rows]
    kc, vc, table = paged_case(gen, lens, page, torch.bfloat16)
    starts = torch.tensor([0] + [e for e, _ in rows], dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(int(starts[-1]), HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    sinks = 3 * torch.randn(HEADS, generator=gen)
    scale, lens_t = HEAD_DIM**-0.5, torch.tensor(lens, dtype=torch.int32)
    for s in (sinks, None):
        out = torch.full_like(q, float("nan"))
        ops.paged_attention_bf16(out, q, kc, vc, table, lens_t, starts, scale, window, s)
        for b, (ext, n) in enumerate(rows):
            k, v = sequence_kv(kc, vc, table, b, n)
            a = int(starts[b])
            ref = eager_reference(q[a : a + ext], k, v, torch.arange(n - ext, n), scale, window, s)
            err = (out[a : a + ext].double() - ref).abs().max().item()
            # probabilities rounded to bf16 for the P V product, the output rounded to bf16
            assert err < 2e-2, f"sinks {s is not None}, row {b} ({ext} of {n}): max abs error {err}"
    plain = torch.empty_like(q)
    ops.paged_attention_bf16(plain, q, kc, vc, table, lens_t, starts, scale, window)
    assert torch.equal(plain, out)
    with pytest.raises(RuntimeError, match="sinks must be a contiguous float32"):
        ops.paged_attention_bf16(
            out, q, kc, vc, table, lens_t, starts, scale, window, sinks.bfloat16()
        )


def test_sink_logits_shift_mass_as_softmax_says(monkeypatch):
    """A sink far below every score changes nothing; one far above leaves the output near zero;
    the written-out math gives the same rows a block of queries at a time."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, HEADS, 9, HEAD_DIM, generator=gen)  # a prefill: mask None is plain causal
    k = torch.randn(1, KV_HEADS, 9, HEAD_DIM, generator=gen)
    v = torch.randn(1, KV_HEADS, 9, HEAD_DIM, generator=gen)
    plain = attention(q, k, v, None, 0.125, None)
    low = attention(q, k, v, None, 0.125, None, torch.full((HEADS,), -1e4))
    high = attention(q, k, v, None, 0.125, None, torch.full((HEADS,), 1e4))
    torch.testing.assert_close(low, plain, atol=1e-6, rtol=0)
    assert high.abs().max() < 1e-6
    sinks = torch.randn(HEADS, generator=gen)
    whole = attention(q, k, v, None, 0.125, None, sinks)
    monkeypatch.setattr(torch_backend, "_MATH_BLOCK", HEADS * 9 * 2)  # two query rows per block
    torch.testing.assert_close(
        attention(q, k, v, None, 0.125, None, sinks), whole, atol=1e-6, rtol=0
    )


def test_sinks_parameter_is_split_by_query_heads():
    from transformers import LlamaConfig

    from pdserve.distributed import TPGroup
    from pdserve.models.llama import LlamaAttention
    from pdserve.models.weights import TPShards

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=16,
    )
    sinks = torch.arange(HEADS, dtype=torch.float32)
    for rank in range(2):
        shards = TPShards.of(cfg, TPGroup(rank=rank, size=2))
        got = shards.shard("model.layers.1.self_attn.sinks", sinks)
        assert torch.equal(got, sinks[rank * 4 : (rank + 1) * 4])
        attn = LlamaAttention(cfg, 1, shards, qkv_bias=True, o_bias=True, qk_norm=False, sinks=True)
        assert attn.attn.has_sinks and attn.sinks.shape == (HEADS // 2,)
        assert dict(attn.named_parameters())["sinks"] is attn.sinks
    plain = LlamaAttention(cfg, 0, TPShards.of(cfg), qkv_bias=False, o_bias=False, qk_norm=False)
    assert plain.sinks is None and not plain.attn.has_sinks
