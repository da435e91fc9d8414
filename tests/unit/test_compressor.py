"""The paged KV compressor (``layers/compressor.py``) against HF's DeepSeek-V4 compressors and
indexer, float32: requests prefilled in chunks that cut windows at odd places, batched together,
then decoded token by token, on page sizes 1, 4 and 16 with pages from the KV cache manager; the
entries in the pool equal HF's running compressed list after every forward. A prefix hit restores
the compressor's state from the snapshot the forward took at a page boundary and continues as an
uncut run does."""

from __future__ import annotations

import types

import pytest
import torch

from pdserve.engine.cache_kinds import make_pool
from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.request import Req, SamplingParams
from pdserve.kv_spec import CompressedEntries, CompressorState, LatentWindow, group_layers
from pdserve.layers.compressor import Compressor

hf = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

HIDDEN, HEAD_DIM, INDEX_DIM, Q_LORA = 32, 16, 8, 12
KINDS = {"csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention"}


def config(rate: int):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        vocab_size=64,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=HEAD_DIM,
        q_lora_rank=Q_LORA,
        index_n_heads=2,
        index_head_dim=INDEX_DIM,
        index_topk=2,
        sliding_window=8,
        compress_rates={KINDS["csa"]: rate, KINDS["hca"]: 2 * rate},
        layer_types=[KINDS["csa"], KINDS["hca"]],
        mlp_layer_types=["moe", "moe"],
        partial_rotary_factor=0.5,
        max_position_embeddings=4096,
    )


class Reference:
    """HF's compressor of one kind (``csa``: the attention's and the indexer's; ``hca``) with
    random weights (position biases included), and one cache per request."""

    def __init__(self, kind: str, rate: int, seed: int = 0):
        self.kind, self.cfg = kind, config(rate)
        torch.manual_seed(seed)
        if kind == "csa":
            self.module = hf.DeepseekV4CSACompressor(self.cfg).float()
        else:
            self.module = hf.DeepseekV4HCACompressor(self.cfg).float()
        for p in self.module.parameters():
            torch.nn.init.normal_(p, std=0.3)
        self.caches: dict[str, object] = {}

    def run(self, rid: str, h: torch.Tensor, prefix: int) -> dict[str, torch.Tensor]:
        """Feed request ``rid``'s next tokens; its running entries per compressor name."""
        if rid not in self.caches:
            layer = (hf.DeepseekV4CSACache if self.kind == "csa" else hf.DeepseekV4HCACache)(
                self.cfg
            )
            self.caches[rid] = types.SimpleNamespace(layers=[layer])
        cache = self.caches[rid]
        n = h.shape[0]
        positions = torch.arange(prefix, prefix + n)[None]
        q_resid = torch.randn(1, n, Q_LORA)
        with torch.no_grad():
            self.module(h[None], q_resid, positions, cache, 0)
        entries = cache.layers[0].compressed_kv
        return {k: v[0] for k, v in entries.items() if v is not None}

    def ours(self) -> list[Compressor]:
        """pdserve's compressors with the same weights (the attention's; the indexer's)."""
        rope = self.module.rotary_emb
        inv, scaling = rope.compress_inv_freq, rope.compress_attention_scaling
        rate = self.module.compress_rate
        pairs = [(self.module, CompressedEntries(HEAD_DIM, rate), "")]
        if self.kind == "csa":
            idx = self.module.indexer
            pairs.append((idx, CompressedEntries(INDEX_DIM, rate, part="index_k"), "index_"))
        out = []
        for src, spec, name in pairs:
            c = Compressor(HIDDEN, spec, self.kind == "csa", 1e-6, inv, scaling, name)
            c.kv_proj.weight.data.copy_(src.kv_proj.weight)
            c.gate_proj.weight.data.copy_(src.gate_proj.weight)
            c.position_bias.data.copy_(src.position_bias)
            c.norm.weight.data.copy_(src.kv_norm.weight)
            out.append(c)
        return out


def stack(compressors: list[Compressor], page_size: int, disable: bool):
    """A manager whose layer keeps a window, each compressor's entries and their state."""
    names, shapes, dtypes = [], [], []
    for c in compressors:
        n, s, d = c.state_parts("float32")
        names += n
        shapes += s
        dtypes += d
    layer = (
        LatentWindow(HEAD_DIM, 0, 8),
        *(c.spec for c in compressors),
        CompressorState(tuple(names), tuple(shapes), tuple(dtypes)),
    )
    groups = group_layers([layer])
    pools = [
        make_pool(g, 9 if g.spec.per_request else 200, page_size, torch.float32, "cpu")
        for g in groups
    ]
    return KVCacheManager(groups, pools, page_size, disable_radix_cache=disable)


def forward(m: KVCacheManager, comps: list[Compressor], batch: list[tuple[Req, torch.Tensor]]):
    """One forward of ``batch`` (request, its new tokens' hidden states) through every
    compressor, with the manager's pages (grown first, as the scheduler does)."""
    state_g = next(g.id for g in m.groups if g.spec.per_request)
    h = torch.cat([x for _, x in batch])
    prefix = [r.kv_len for r, _ in batch]
    extend = [x.shape[0] for _, x in batch]
    slots = [r.kv.pages[state_g][0] for r, _ in batch]
    snaps = [r.kv.pages[state_g][1] if len(r.kv.pages[state_g]) > 1 else 0 for r, _ in batch]
    for c in comps:
        g = next(g.id for g in m.groups if g.spec == c.spec)
        pool = m.pools[g]
        with torch.no_grad():
            c(h, prefix, extend, m.pools[state_g], 0, slots, pool.entries(0),
              [r.kv.pages[g] for r, _ in batch], m.page_size, snaps)  # fmt: skip
    for (r, _), n in zip(batch, extend):
        r.kv_len += n


def pooled(m: KVCacheManager, c: Compressor, r: Req, count: int) -> torch.Tensor:
    g = next(g.id for g in m.groups if g.spec == c.spec)
    rows = []
    for e in range(count):
        page, row = c.spec.entry_location(e, m.page_size)
        rows.append(m.pools[g].entries(0)[r.kv.pages[g][page], row])
    return torch.stack(rows) if rows else torch.zeros(0, c.dim)


def check(ref_entries: dict, m, comps, r: Req) -> int:
    """Our pool's entries of ``r`` equal HF's running lists; returns how many there are."""
    count = 0
    for c, key in zip(comps, ("compressor", "indexer")):
        want = ref_entries.get(key, torch.zeros(0, c.dim))
        got = pooled(m, c, r, want.shape[0])
        assert want.shape[0] == r.kv_len // c.rate
        torch.testing.assert_close(got, want)  # float32: the batched matmuls round apart
        count += want.shape[0]
    return count


@pytest.mark.parametrize("kind", ["csa", "hca"])
@pytest.mark.parametrize("page_size,rate", [(1, 4), (4, 4), (16, 4), (4, 2)])
def test_entries_match_hf_over_chunks_batches_and_decode_steps(kind, page_size, rate):
    ref = Reference(kind, rate)
    comps = ref.ours()
    m = stack(comps, page_size, disable=True)
    torch.manual_seed(1)
    prompts = {"a": torch.randn(45, HIDDEN), "b": torch.randn(29, HIDDEN)}
    chunks = {"a": [5, 3, 9, 1, 1, 16, 10], "b": [7, 7, 15]}
    reqs = {
        k: Req(k, list(range(len(v))), SamplingParams(max_new_tokens=8)) for k, v in prompts.items()
    }
    for r in reqs.values():
        assert m.admit(r, chunks[r.rid][0], 0, 0)
    step = 0
    while any(step < len(chunks[k]) for k in reqs):
        batch = []
        for k, r in reqs.items():
            if step < len(chunks[k]):
                n = chunks[k][step]
                if step:
                    assert m.grow(r, n)
                batch.append((r, prompts[k][r.kv_len : r.kv_len + n]))
        refs = {r.rid: ref.run(r.rid, x, r.kv_len) for r, x in batch}
        forward(m, comps, batch)
        for r, _ in batch:
            check(refs[r.rid], m, comps, r)
        step += 1
    for _ in range(9):  # decode steps, both requests in one batch
        batch = []
        for r in reqs.values():
            r.output_ids.append(3)
            assert m.grow(r, 1)
            batch.append((r, torch.randn(1, HIDDEN)))
        refs = {r.rid: ref.run(r.rid, x, r.kv_len) for r, x in batch}
        forward(m, comps, batch)
        total = sum(check(refs[r.rid], m, comps, r) for r, _ in batch)
    assert total > 0
    for r in reqs.values():
        m.release(r)
    m.check_integrity([0] * m.num_groups)


@pytest.mark.parametrize("kind", ["csa", "hca"])
@pytest.mark.parametrize("page_size,rate", [(1, 4), (4, 4), (16, 4), (2, 4)])
def test_a_prefix_hit_continues_from_the_snapshot_as_an_uncut_run(kind, page_size, rate):
    ref = Reference(kind, rate)
    comps = ref.ours()
    m = stack(comps, page_size, disable=False)
    torch.manual_seed(2)
    h = torch.randn(50, HIDDEN)
    ids = list(range(100, 150))
    first = Req("first", ids[:37], SamplingParams(max_new_tokens=1))
    assert m.admit(first, 64, 0, 0)
    forward(m, comps, [(first, h[:37])])  # one extend; its snapshot is at 37 // page_size pages
    m.release(first)
    again = Req("again", ids, SamplingParams(max_new_tokens=1))
    assert m.admit(again, 64, 0, (len(ids) - 1) // page_size)
    hit = again.kv_len
    assert hit == 37 // page_size * page_size and hit > 0 and m.restored == 1
    forward(m, comps, [(again, h[hit:])])
    want = ref.run("uncut", h, 0)  # HF over the whole sequence in one go
    check(want, m, comps, again)
    m.release(again)
