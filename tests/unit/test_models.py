"""Our Llama-family models against HF transformers (float32) on tiny random checkpoints, through a
real KV pool and the torch attention backend: prefill, chunked prefill, decode, mixed batches."""

import dataclasses
import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from pdserve.layers.rotary import RotaryEmbedding, inv_frequencies, rope_parameters
from pdserve.models.loader import context_length, load_model, model_fingerprint
from pdserve.models.registry import model_class, supported_architectures
from tests.helpers import PagedRunner
from tests.helpers.checkpoints import LLAMA_MQA_TIED, QWEN2_SLIDING, build_tiny_checkpoint

torch.set_num_threads(1)

VARIANTS = {
    "llama": ("llama", {}),  # llama3 RoPE scaling
    "llama-mqa-tied": (
        "llama",
        LLAMA_MQA_TIED,
    ),  # 1 KV head, tied embeddings, biases, head_dim override
    "qwen2": ("qwen2", {}),
    "qwen2-sliding": ("qwen2", QWEN2_SLIDING),  # window on layer 1 only
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),  # window 32 < prompt length
}
PROMPT_LEN = 40
DECODE_STEPS = 4
ATOL = 1e-4


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=list(VARIANTS))
def case(request):
    """(our model, {seed: HF logits for tokens(seed, PROMPT_LEN + DECODE_STEPS)})."""
    arch, overrides = VARIANTS[request.param]
    path = build_tiny_checkpoint(arch, **overrides)
    model, _ = load_model(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = {
            s: hf(torch.tensor([tokens(s, PROMPT_LEN + DECODE_STEPS)])).logits[0] for s in (1, 2)
        }
    return model, ref


def check(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def decode(runner: PagedRunner, ref: dict, seeds: list[int]) -> None:
    """Feed the reference continuation token by token, all sequences in one batch per step."""
    for step in range(PROMPT_LEN, PROMPT_LEN + DECODE_STEPS):
        out = runner.extend({s: [tokens(s, step + 1)[-1]] for s in seeds})
        for s in seeds:
            check(out[s][0], ref[s][step])


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_then_decode(case, page_size):
    model, ref = case
    runner = PagedRunner(model, page_size)
    check(runner.extend({1: tokens(1, PROMPT_LEN)})[1], ref[1][:PROMPT_LEN])
    decode(runner, ref, [1])


@pytest.mark.parametrize("page_size", [1, 16])
def test_chunked_prefill(case, page_size):
    model, ref = case
    runner = PagedRunner(model, page_size)
    prompt = tokens(1, PROMPT_LEN)
    check(runner.extend({1: prompt[:25]})[1], ref[1][:25])
    check(runner.extend({1: prompt[25:]})[1], ref[1][25:PROMPT_LEN])  # second chunk attends to pool
    decode(runner, ref, [1])


@pytest.mark.parametrize("page_size", [1, 16])
def test_two_sequences_mixed_batches(case, page_size):
    model, ref = case
    runner = PagedRunner(model, page_size)
    a, b = tokens(1, PROMPT_LEN + 1), tokens(2, PROMPT_LEN)
    out = runner.extend({1: a[:PROMPT_LEN], 2: b[:20]})  # two prefills
    check(out[1], ref[1][:PROMPT_LEN])
    check(out[2], ref[2][:20])
    out = runner.extend({1: a[PROMPT_LEN:], 2: b[20:]})  # a decodes while b prefills its rest
    check(out[1][0], ref[1][PROMPT_LEN])
    check(out[2], ref[2][20:PROMPT_LEN])
    out = runner.extend({2: [tokens(2, PROMPT_LEN + 1)[-1]], 1: [tokens(1, PROMPT_LEN + 2)[-1]]})
    check(out[1][0], ref[1][PROMPT_LEN + 1])
    check(out[2][0], ref[2][PROMPT_LEN])


def test_sliding_window_changes_logits():
    """The mistral checkpoint's window (32) must matter for a 40-token prompt, or the HF match
    above would not show that the window is applied."""
    model, _ = load_model(build_tiny_checkpoint("mistral"))
    with_window = PagedRunner(model, 16).extend({0: tokens(1, PROMPT_LEN)})[0]
    for layer in model.model.layers:
        a = layer.self_attn
        a.sliding_window, a.attn = None, dataclasses.replace(a.attn, sliding_window=None)
    full = PagedRunner(model, 16).extend({0: tokens(1, PROMPT_LEN)})[0]
    assert torch.equal(with_window[:32], full[:32])
    assert (with_window[32:] - full[32:]).abs().max() > 1e-3


def state(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_sharded_checkpoint_loads_same_weights():
    single = build_tiny_checkpoint("llama")
    sharded = build_tiny_checkpoint("llama", max_shard_size="4MB")
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1
    a, b = state(load_model(single)[0]), state(load_model(sharded)[0])
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def rewrite_config(src: str, dst: str, edit) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    edit(cfg)
    with open(path, "w") as f:
        json.dump(cfg, f)
    return dst


def test_transformers4_rope_fields_give_same_logits(tmp_path):
    src = build_tiny_checkpoint("llama")

    def to_v4(cfg):
        params = cfg.pop("rope_parameters")
        cfg["rope_theta"] = params.pop("rope_theta")
        cfg["rope_scaling"] = params

    v4 = rewrite_config(src, str(tmp_path / "v4"), to_v4)
    prompt = {0: tokens(1, PROMPT_LEN)}
    new = PagedRunner(load_model(src)[0], 16).extend(prompt)[0]
    old = PagedRunner(load_model(v4)[0], 16).extend(prompt)[0]
    assert torch.equal(new, old)


def test_rope_parameters_normalises_both_styles():
    llama3 = dict(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=1024
    )
    v5 = SimpleNamespace(rope_parameters=dict(rope_type="llama3", rope_theta=5e5, **llama3))
    v4 = SimpleNamespace(rope_theta=5e5, rope_scaling=dict(type="llama3", **llama3))
    assert (
        rope_parameters(v5)
        == rope_parameters(v4)
        == dict(rope_type="llama3", rope_theta=5e5, **llama3)
    )
    assert rope_parameters({"rope_theta": 1e4}) == {"rope_type": "default", "rope_theta": 1e4}
    assert rope_parameters({}) == {"rope_type": "default", "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="yarn"):
        rope_parameters({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="factor"):
        rope_parameters({"rope_scaling": {"type": "linear"}})
    base = inv_frequencies(16, {"rope_type": "default", "rope_theta": 1e4})
    linear = inv_frequencies(16, {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0})
    torch.testing.assert_close(linear, base / 4)


def test_rotary_table_grows_and_keeps_values():
    rope = RotaryEmbedding(16, {"rope_type": "default", "rope_theta": 1e4}, initial_positions=8)
    rope.reserve(8, torch.device("cpu"))
    cos8, sin8 = rope(torch.arange(8))
    rope.reserve(20, torch.device("cpu"))
    assert rope.capacity == 32
    cos, sin = rope(torch.arange(20))
    assert cos.dtype == torch.float32
    assert torch.equal(cos[:8], cos8) and torch.equal(sin[:8], sin8)
    angle = 19 * inv_frequencies(16, rope.params)
    torch.testing.assert_close(cos[19, :8], angle.cos())


def test_longrope_tables_match_hf_and_pick_by_sequence_length():
    from types import SimpleNamespace

    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from pdserve.layers.rotary import rotary_embedding

    short = [1.0 + 0.1 * i for i in range(8)]
    long = [4.0 + i for i in range(8)]
    scaling = {"type": "longrope", "short_factor": short, "long_factor": long}
    config = Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=256,
        original_max_position_embeddings=64,
        rope_scaling=dict(scaling),
    )
    params = rope_parameters(config)
    assert params["rope_type"] == "longrope" and params["factor"] == 4.0
    # the transformers 4 form of the same config reads the same, under LongRoPE's old name too
    for kind in ("longrope", "su"):
        old = {"rope_scaling": {**scaling, "type": kind}, "max_position_embeddings": 256}
        got = rope_parameters({**old, "original_max_position_embeddings": 64})
        assert {**got, "partial_rotary_factor": 1.0} == params
    rope = rotary_embedding(16, params, 8)
    hf = Phi3RotaryEmbedding(config)
    x = torch.zeros(1, 1, 16)
    for n, table in ((64, rope), (100, rope.long)):  # HF picks by the forward's longest position
        hf_cos, hf_sin = hf(x, torch.arange(n)[None])
        table.reserve(n, torch.device("cpu"))
        cos, sin = table(torch.arange(n))
        assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])
    # per request in a batch: a sequence of 64 on the short tables, one of 65 on the long
    fb = SimpleNamespace(
        positions=torch.tensor([62, 63, 64]),
        extend_lens=[2, 1],
        seq_lens=[64, 65],
        full_lens=[64, 65],
    )
    cos, _ = rope.tables(fb)
    assert torch.equal(cos[:2], rope(torch.tensor([62, 63]))[0])
    assert torch.equal(cos[2], rope.long(torch.tensor([64]))[0][0])
    assert rope.variant(64) == 0 and rope.variant(65) == 1
    with pytest.raises(ValueError, match="short_factor has 8 entries; the 12 rotary dims need 6"):
        rotary_embedding(12, params, 8)
    with pytest.raises(ValueError, match="long_factor"):
        rope_parameters({"rope_scaling": {"type": "longrope", "short_factor": short}})


def test_unknown_architecture_lists_supported(tmp_path):
    bad = rewrite_config(
        build_tiny_checkpoint("llama"),
        str(tmp_path / "bad"),
        lambda cfg: cfg.update(architectures=["FooForCausalLM"]),
    )
    with pytest.raises(ValueError, match="FooForCausalLM") as err:
        load_model(bad)
    for arch in supported_architectures():
        assert arch in str(err.value)
    assert set(supported_architectures()) >= {
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "MistralForCausalLM",
    }
    assert (
        model_class(SimpleNamespace(architectures=["Qwen3ForCausalLM"])).__name__
        == "Qwen3ForCausalLM"
    )


def test_dummy_load_needs_no_weights(tmp_path):
    src = build_tiny_checkpoint("qwen3")
    dummy = str(tmp_path / "dummy")
    os.makedirs(dummy)
    shutil.copy(os.path.join(src, "config.json"), dummy)
    model, cfg = load_model(dummy, load_format="dummy", seed=3)
    again, _ = load_model(dummy, load_format="dummy", seed=3)
    other, _ = load_model(dummy, load_format="dummy", seed=4)
    w = model.model.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(w, again.model.layers[0].self_attn.qkv_proj.weight)
    assert not torch.equal(w, other.model.layers[0].self_attn.qkv_proj.weight)
    assert abs(w.std().item() - cfg.initializer_range) < 0.01
    logits = PagedRunner(model, 16).extend({0: tokens(1, 8)})[0]
    assert logits.shape == (8, cfg.vocab_size) and torch.isfinite(logits).all()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(dummy)


def test_missing_and_unexpected_weights_are_named(tmp_path):
    src = build_tiny_checkpoint("llama")
    weights = load_file(os.path.join(src, "model.safetensors"))

    def variant(name, tensors):
        dst = str(tmp_path / name)
        shutil.copytree(src, dst)
        save_file(tensors, os.path.join(dst, "model.safetensors"))
        return dst

    dropped = "model.layers.1.self_attn.k_proj.weight"
    with pytest.raises(ValueError, match=dropped.replace(".", r"\.")):
        load_model(variant("missing", {k: v for k, v in weights.items() if k != dropped}))
    with pytest.raises(ValueError, match="model.layers.0.extra.weight"):
        load_model(
            variant("unexpected", {**weights, "model.layers.0.extra.weight": torch.zeros(2)})
        )


def test_model_attributes_dtype_and_fingerprint():
    path = build_tiny_checkpoint("llama", **LLAMA_MQA_TIED)
    model, cfg = load_model(path)
    assert (
        model.num_layers,
        model.num_heads,
        model.num_kv_heads,
        model.head_dim,
        model.vocab_size,
    ) == (2, 4, 1, 32, 49152)
    assert next(model.parameters()).dtype == torch.float32  # "auto" = the checkpoint's
    bf16, _ = load_model(path, dtype="bfloat16")
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    assert context_length(cfg) == 4096
    fp = model_fingerprint(cfg)
    assert (
        fp == model_fingerprint(load_model(path, dtype="bfloat16")[1]) and len(fp) == 16
    )  # dtype is not in it
    assert fp != model_fingerprint(load_model(build_tiny_checkpoint("llama"))[1])


@pytest.mark.parametrize(
    "arch,edit,message",
    [
        # an unknown RoPE scaling type, named with its value
        (
            "glm4",
            lambda c: c["rope_parameters"].update(rope_type="dynamic_ntk_foo"),
            "rope_type: 'dynamic_ntk_foo' is not supported",
        ),
        ("olmoe", lambda c: c.update(clip_qkv=8.0), "clip_qkv: 8.0 not supported"),
        (
            "minimax_m2",
            lambda c: c.update(quantization_config={"quant_method": "awq"}),
            "quantization_config.quant_method: 'awq'",
        ),
        ("smollm3", lambda c: c.update(no_rope_layers=[1, 1]), "no_rope_layers: one 0 or 1 per"),
        (
            "exaone4",
            lambda c: c.update(layer_types=["sliding_attention"] * 3 + ["chunked_attention"]),
            "layer_types: \\['chunked_attention'\\] not supported",
        ),
    ],
)
def test_family_config_fields_not_computed_are_refused(tmp_path, arch, edit, message):
    bad = rewrite_config(build_tiny_checkpoint(arch), str(tmp_path / "bad"), edit)
    with pytest.raises(ValueError, match=message):
        load_model(bad)
