"""DeepSeek-V3.2's sparse attention with ``index_topk`` smaller than the prompt (8 keys per
query): the same tokens at chunk sizes 1, 7, 64 and whole-prompt prefill, colocated and through
PD, and the same as HF's model whose indexer follows pdserve's stated top-k rule (highest score
first, the lowest position among equal scores: HF's ``torch.topk`` leaves ties open, and exact zeros
from the ReLU tie often). The indexer keys, a cache group of their own, move in PD with their
pages."""

from __future__ import annotations

import pytest
import torch

from pdserve.layers.attention.torch_backend import rule_topk
from tests.e2e.test_engine import hf_model, make_engine, prompts_for
from tests.e2e.test_tp import COMMON
from tests.helpers import cluster as c
from tests.helpers.checkpoints import build_tiny_checkpoint

torch.set_num_threads(1)

NEW_TOKENS = 8
TOPK = 8
SP = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}


@pytest.fixture(scope="module")
def sparse_model() -> str:
    return build_tiny_checkpoint("deepseek_v32", index_topk=TOPK)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return prompts_for(11)[3:6]  # 40, 95 and 160 tokens: most queries see more than 8 keys


def _rotate_half_part(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, r: int
) -> torch.Tensor:
    a, b = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat([-a[..., half:], a[..., :half]], dim=-1)
    return torch.cat([a * cos + rotated * sin, b], dim=-1)


def rule_indexer_forward(
    self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None, cache=None
):
    """HF's indexer with pdserve's top-k rule: scores from the formula (float64), then
    ``rule_topk``."""
    b, s, _ = hidden_states.shape
    cos, sin = position_embeddings  # [B, S, r]
    r = self.qk_rope_head_dim
    q = self.wq_b(q_resid).view(b, s, self.n_heads, self.head_dim)
    q = _rotate_half_part(q, cos[:, :, None], sin[:, :, None], r)
    k = _rotate_half_part(self.k_norm(self.wk(hidden_states)), cos, sin, r)
    if cache is not None:
        k = cache.update_indexer(k, self.layer_idx)
    scores = torch.relu(torch.einsum("bshd,btd->bsht", q.double(), k.double()) * self.softmax_scale)
    w = (
        self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).double()
        * self.n_heads**-0.5
    )
    index = torch.einsum("bsh,bsht->bst", w, scores)
    offset = k.shape[1] - s  # query i sits at position offset + i
    out = torch.empty((b, s, min(self.index_topk, k.shape[1])), dtype=torch.int32)
    for i in range(s):
        chosen = rule_topk(index[0, i, : offset + i + 1], self.index_topk)
        out[0, i] = torch.cat([chosen, chosen[-1:].expand(out.shape[2] - len(chosen))]).to(
            torch.int32
        )
    return out


def hf_rule_greedy(path: str, ids: list[int]) -> list[int]:
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as m

    model = hf_model(path)
    original = m.DeepseekV32Indexer.forward
    m.DeepseekV32Indexer.forward = rule_indexer_forward
    try:
        with torch.no_grad():
            t = torch.tensor([ids])
            return model.generate(
                t,
                attention_mask=torch.ones_like(t),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )[0, len(ids) :].tolist()
    finally:
        m.DeepseekV32Indexer.forward = original


@pytest.fixture(scope="module")
def by_chunk(sparse_model, prompts) -> dict:
    out = {}
    for chunk in (1, 7, 64, 4096):  # 4096: every prompt in one forward
        eng = make_engine(
            sparse_model,
            page_size=1 if chunk < 16 else 16,
            chunked_prefill_size=chunk,
            dtype="float32",
        )
        try:
            out[chunk] = [
                o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=SP)
            ]
            info = eng.check_integrity()
            assert info["in_use_pages"] == 0 and info["running"] == 0
        finally:
            eng.shutdown()
    return out


def test_the_same_tokens_at_every_chunk_size(by_chunk):
    assert by_chunk[1] == by_chunk[7] == by_chunk[64] == by_chunk[4096]


def test_the_same_tokens_as_hf_with_the_stated_rule(sparse_model, prompts, by_chunk):
    for ids, ours in zip(prompts, by_chunk[4096]):
        assert ours == hf_rule_greedy(sparse_model, ids), f"prompt of {len(ids)} tokens"


def test_the_torch_backend_selects_alike(sparse_model, prompts, by_chunk):
    eng = make_engine(
        sparse_model,
        page_size=1,
        chunked_prefill_size=64,
        dtype="float32",
        attention_backend="torch",
    )
    try:
        assert [
            o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=SP)
        ] == by_chunk[4096]
    finally:
        eng.shutdown()


def test_pd_serves_the_colocated_tokens(sparse_model, prompts, by_chunk, tmp_path):
    small = [*COMMON, "--dtype", "float32", "--max-total-tokens", "4096"]
    P = c.prefill("P_dsa", sparse_model, tmp_path, "--tp-size", "2", *small)[0]
    D = c.decode("D_dsa", sparse_model, tmp_path, *small)
    router = None
    try:
        c.start_all([P, D])
        router = c.router("R_dsa", [P], [D], tmp_path)
        router.start()
        for ids, want in zip(prompts, by_chunk[4096]):
            r = router.http.post(
                "/generate", json={"input_ids": ids, "sampling_params": SP}, timeout=120
            )
            assert r.status_code == 200 and r.json()["output_ids"] == want, r.text
        for s in (P, D):
            s.wait_idle()
    finally:
        c.stop_all(([router] if router else []) + [P, D])


def test_the_selection_changes_the_outcome(prompts, by_chunk):
    """The same weights with every key selected (index_topk above every prompt) answer otherwise:
    the sparse path above is not the dense one."""
    dense = make_engine(build_tiny_checkpoint("deepseek_v32"), page_size=16, dtype="float32")
    try:
        assert [
            o["output_ids"] for o in dense.generate(input_ids=prompts, sampling_params=SP)
        ] != by_chunk[4096]
    finally:
        dense.shutdown()
