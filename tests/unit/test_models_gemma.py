"""Gemma 2 and Gemma 3 (text) against HF transformers (float32) on tiny random checkpoints whose
sliding window (16 tokens) is several times shorter than the prompts, through real KV pools (one
per cache group) and the torch attention backend: prefill, chunked prefill across the window,
greedy decode past it, mixed batches, page sizes 1 and 16, two tensor-parallel ranks."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig

from pdserve import kernels
from pdserve.distributed import TPGroup
from pdserve.kv_spec import FullAttention, SlidingWindow, group_layers
from pdserve.layers.attention.cpu_backend import CpuAttnBackend
from pdserve.models.base import CausalLM
from pdserve.models.loader import load_model
from pdserve.models.registry import model_class, supported_architectures
from tests.helpers import PagedRunner
from tests.helpers.checkpoints import GEMMA_MQA, build_tiny_checkpoint
from tests.unit.test_models import check, rewrite_config, tokens

torch.set_num_threads(1)

VARIANTS = {
    "gemma2": ("gemma2", {}),  # S, F, S, F; attention and final soft-caps
    "gemma2-mqa": ("gemma2", GEMMA_MQA),  # one KV head
    "gemma3": ("gemma3", {}),  # S, S, F, S, S, F; RoPE per layer type, q/k norms
}
WINDOW = 16
PROMPT_LEN = 80  # five windows
NEW_TOKENS = 24
SECOND_LEN = 50  # the other sequence of the mixed batches


@dataclass
class Case:
    path: str
    model: Any
    prompt: list[int]
    hf_new: list[int]  # HF generate's greedy tokens after the prompt
    ref: torch.Tensor  # HF logits of prompt + hf_new (no cache), [PROMPT_LEN + NEW_TOKENS, vocab]
    ref2: torch.Tensor  # HF logits of tokens(2, SECOND_LEN + 1)


@pytest.fixture(scope="module", params=list(VARIANTS))
def case(request) -> Case:
    arch, overrides = VARIANTS[request.param]
    path = build_tiny_checkpoint(arch, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = tokens(1, PROMPT_LEN)
    ids = torch.tensor([prompt])
    gen = GenerationConfig(
        max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
        ref = hf(out).logits[0]
        ref2 = hf(torch.tensor([tokens(2, SECOND_LEN + 1)])).logits[0]
    return Case(path, load_model(path)[0], prompt, out[0, PROMPT_LEN:].tolist(), ref, ref2)


def greedy_past_window(runner: PagedRunner, c: Case, first_logits: torch.Tensor) -> None:
    """Greedy decode from the prompt's last logits: HF's tokens, and HF's logits at every step."""
    nxt, got = int(first_logits.argmax()), []
    for step in range(NEW_TOKENS):
        got.append(nxt)
        if step == NEW_TOKENS - 1:
            break
        logits = runner.extend({1: [nxt]})[1][0]
        check(logits, c.ref[PROMPT_LEN + step])
        nxt = int(logits.argmax())
    assert got == c.hf_new


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_then_greedy_decode(case, page_size):
    runner = PagedRunner(case.model, page_size)
    out = runner.extend({1: case.prompt})[1]
    check(out, case.ref[:PROMPT_LEN])
    greedy_past_window(runner, case, out[-1])


@pytest.mark.parametrize("chunk", [7, 16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_chunked_prefill_across_window(case, page_size, chunk):
    """Chunks that start inside, at and across window and page boundaries."""
    runner = PagedRunner(case.model, page_size)
    for start in range(0, PROMPT_LEN, chunk):
        out = runner.extend({1: case.prompt[start : start + chunk]})[1]
        check(out, case.ref[start : min(start + chunk, PROMPT_LEN)])
    greedy_past_window(runner, case, out[-1])


@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_batches(case, page_size):
    """One sequence decodes past the window while another prefills in chunks in the same batch."""
    runner = PagedRunner(case.model, page_size)
    a, b = case.prompt + case.hf_new, tokens(2, SECOND_LEN + 1)
    out = runner.extend({1: a[:PROMPT_LEN], 2: b[:9]})
    check(out[1], case.ref[:PROMPT_LEN])
    check(out[2], case.ref2[:9])
    pos_b = 9
    for step in range(6):  # b goes 9 -> 45 in chunks of 6 while a decodes
        out = runner.extend({2: b[pos_b : pos_b + 6], 1: [a[PROMPT_LEN + step]]})
        check(out[1][0], case.ref[PROMPT_LEN + step])
        check(out[2], case.ref2[pos_b : pos_b + 6])
        pos_b += 6
    out = runner.extend(
        {1: [a[PROMPT_LEN + 6]], 2: b[pos_b:]}
    )  # b's rest and its first decode input
    check(out[1][0], case.ref[PROMPT_LEN + 6])
    check(out[2], case.ref2[pos_b:])


def test_cache_specs_groups_and_interface(case):
    m, cfg = case.model, case.model.config
    kv = cfg.num_key_value_heads
    sliding, full = SlidingWindow(kv, 16, WINDOW), FullAttention(kv, 16)
    expected = [sliding if t == "sliding_attention" else full for t in cfg.layer_types]
    assert m.kv_cache_specs() == expected
    if cfg.model_type == "gemma2":  # HF: sliding on even layers
        assert expected == [sliding, full, sliding, full]
        assert {layer.logit_softcap for layer in m.attention_layers()} == {2.0}
    else:  # sliding_window_pattern 3: every third layer global
        assert expected == [sliding, sliding, full, sliding, sliding, full]
        assert {layer.logit_softcap for layer in m.attention_layers()} == {None}
    groups = group_layers(m.kv_cache_specs(), m.first_layer)
    assert [(g.spec, g.layers) for g in groups] == [
        (sliding, tuple(i for i, s in enumerate(expected) if s == sliding)),
        (full, tuple(i for i, s in enumerate(expected) if s == full)),
    ]
    assert [a.layer_id for a in m.attention_layers()] == list(range(cfg.num_hidden_layers))
    assert {a.scale for a in m.attention_layers()} == {
        24**-0.5
    }  # query_pre_attn_scalar, not head_dim
    assert isinstance(m, CausalLM)
    assert (m.first_layer, m.total_layers, m.total_kv_heads, m.num_attention_heads) == (
        0,
        cfg.num_hidden_layers,
        kv,
        4,
    )
    assert m.lm_head is None  # tied
    assert m.enable_decode_stack(None) is False


def test_cpu_attention_backend_refuses_gemma2_softcap():
    backend = CpuAttnBackend.__new__(CpuAttnBackend)  # check_supported reads only class attributes
    kinds = ["sliding_window", "full_attention"]
    gemma2 = load_model(build_tiny_checkpoint("gemma2"))[0]
    with pytest.raises(ValueError, match="soft-capping"):
        backend.check_supported(kinds, gemma2.attention_layers(), "Gemma2ForCausalLM")
    backend.check_supported(
        kinds, load_model(build_tiny_checkpoint("gemma3"))[0].attention_layers(), "Gemma3"
    )


def logits_of(model, n: int = 40) -> torch.Tensor:
    return PagedRunner(model, 16).extend({0: tokens(1, n)})[0]


def set_attn(model, **fields) -> None:
    for layer in model.model.layers:
        layer.self_attn.attn = dataclasses.replace(layer.self_attn.attn, **fields)


def test_each_gemma2_feature_changes_logits():
    """The window, both soft-caps and the (1 + w) norms must each matter on the gemma2
    checkpoint, or the HF matches above would not show they are applied."""
    path = build_tiny_checkpoint("gemma2")
    base = logits_of(load_model(path)[0])
    no_window = load_model(path)[0]
    set_attn(no_window, sliding_window=None)
    unwindowed = logits_of(no_window)
    assert torch.equal(unwindowed[:WINDOW], base[:WINDOW])
    assert (unwindowed[WINDOW:] - base[WINDOW:]).abs().max() > 1e-3
    no_attn_cap = load_model(path)[0]
    set_attn(no_attn_cap, logit_softcap=None)
    assert (logits_of(no_attn_cap) - base).abs().max() > 1e-2
    no_final_cap = load_model(path)[0]
    no_final_cap.final_logit_softcap = None
    uncapped = logits_of(no_final_cap)
    assert uncapped.abs().max() > base.abs().max() + 0.1
    torch.testing.assert_close(torch.tanh(uncapped / 5.0) * 5.0, base, atol=1e-5, rtol=0)
    ones = load_model(path)[0]
    ones.model.layers[1].post_feedforward_layernorm.weight.data.zero_()
    assert (logits_of(ones) - base).abs().max() > 1e-3


def test_gemma3_rope_per_layer_type_changes_logits():
    path = build_tiny_checkpoint("gemma3")
    base = logits_of(load_model(path)[0], 60)
    one_rope = load_model(path)[0]
    rotaries = one_rope.model.rotaries
    assert rotaries["sliding_attention"].params == {"rope_type": "default", "rope_theta": 10000.0}
    assert rotaries["full_attention"].params == {
        "rope_type": "linear",
        "rope_theta": 1e6,
        "factor": 8.0,
    }
    rotaries["full_attention"] = rotaries["sliding_attention"]
    assert (logits_of(one_rope, 60) - base).abs().max() > 1e-3


class _Hub:
    def __init__(self, size: int):
        self.slots: list[Any] = [None] * size
        self.barrier = threading.Barrier(size, timeout=60)


@dataclass(frozen=True)
class ThreadGroup(TPGroup):
    """Ranks as threads of this process: the collectives exchange tensors through ``hub``."""

    hub: Any = None

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.hub.slots[self.rank] = t
        self.hub.barrier.wait()
        parts = list(self.hub.slots)
        self.hub.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return parts

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(t.clone())
        return t.copy_(torch.stack(parts).sum(0))

    def all_gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._exchange(t.contiguous()), dim=-1)


@pytest.mark.parametrize("variant", ["gemma2", "gemma3", "gemma2-mqa"])
def test_two_tensor_parallel_ranks_match_hf(variant):
    """Heads, KV heads (split, or replicated with one), MLP columns and the vocabulary split over
    two ranks; the scaled embedding and the soft-capped logits come out whole on both."""
    arch, overrides = VARIANTS[variant]
    path = build_tiny_checkpoint(arch, **overrides)
    hub = _Hub(2)
    ranks = [load_model(path, tp=ThreadGroup(rank=r, size=2, hub=hub))[0] for r in range(2)]
    assert [m.num_heads for m in ranks] == [2, 2]
    prompt = tokens(1, PROMPT_LEN)
    with torch.no_grad():
        ref = (
            AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            .eval()(torch.tensor([prompt]))
            .logits[0]
        )
    results: dict[int, Any] = {}

    def run(rank: int) -> None:
        torch.set_num_threads(1)
        try:
            runner = PagedRunner(ranks[rank], 16)
            out = [runner.extend({0: prompt[:37]})[0], runner.extend({0: prompt[37:]})[0]]
            results[rank] = torch.cat(out)
        except BaseException as e:  # the other rank then fails on the barrier's timeout
            results[rank] = e
            hub.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for rank in range(2):
        if isinstance(results.get(rank), BaseException):
            raise results[rank]
        check(results[rank], ref)


def test_cpu_kernels_float32_match_hf(case):
    """On CPU the engine gives the model pdserve's kernels (here: the RoPE kernel; the Gemma
    norms and GeGLU stay in PyTorch); float32 still matches HF."""
    ops = kernels.load()
    if ops is None:
        pytest.skip(f"pdserve's CPU kernels are not available: {kernels.unavailable_reason()}")
    model = load_model(case.path)[0]
    model.use_cpu_kernels(ops)
    runner = PagedRunner(model, 16)
    check(runner.extend({1: case.prompt[:30]})[1], case.ref[:30])
    check(runner.extend({1: case.prompt[30:]})[1], case.ref[30:PROMPT_LEN])
    check(runner.extend({1: [case.hf_new[0]]})[1][0], case.ref[PROMPT_LEN])


def test_architectures_registered(tmp_path):
    bad = rewrite_config(
        build_tiny_checkpoint("gemma3"),
        str(tmp_path / "bad"),
        lambda cfg: cfg.update(architectures=["Gemma3ForConditionalGeneration"]),
    )
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration") as err:
        load_model(bad)
    assert "Gemma2ForCausalLM" in str(err.value) and "Gemma3ForCausalLM" in str(err.value)
    assert {"Gemma2ForCausalLM", "Gemma3ForCausalLM"} <= set(supported_architectures())
    text = transformers.Gemma3TextConfig(num_hidden_layers=2, architectures=["Gemma3ForCausalLM"])
    assert model_class(text).__name__ == "Gemma3ForCausalLM"
    assert (
        model_class(SimpleNamespace(architectures=["Gemma2ForCausalLM"])).__name__
        == "Gemma2ForCausalLM"
    )


def test_unsupported_config_fields_are_named(tmp_path):
    src = build_tiny_checkpoint("gemma3")
    bidi = rewrite_config(
        src, str(tmp_path / "bidi"), lambda cfg: cfg.update(use_bidirectional_attention=True)
    )
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        load_model(bidi)
    act = rewrite_config(
        src, str(tmp_path / "act"), lambda cfg: cfg.update(hidden_activation="relu")
    )
    with pytest.raises(ValueError, match="hidden_activation"):
        load_model(act)
