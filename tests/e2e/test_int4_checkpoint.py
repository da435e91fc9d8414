"""compressed-tensors ``pack-quantized`` int4 checkpoints (W4A16: ``weight_packed`` I32 with eight
codes ``q + 8`` a word, ``weight_scale`` per output channel and group of 32, ``weight_shape``),
written by compressed-tensors' own compressor from the tiny models and served as they are:

- float32 compute: HF transformers' greedy tokens and logprobs on compressed-tensors'
  decompression, for a dense model, a MoE with every projection in int4, and DeepSeek-V3 with only
  its routed experts in int4 (Kimi K2-Thinking's layout);
- each layer's weight is the decompression bit for bit; the bytes held are the checkpoint's;
- a tensor-parallel rank holds its part; a split inside a packed word or a scale group is refused
  naming it; variants not built are refused naming the field;
- deterministic serving; through PD: the Kimi-layout model from a prefill on two ranks (heads
  split, experts over two expert-parallel ranks) to a one-rank decode gives HF's tokens."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import pdserve
from pdserve.distributed import TPGroup
from pdserve.layers.linear import Linear
from pdserve.models.loader import checkpoint_tensors, load_model
from pdserve.quantization.int4_matmul import Int4GroupLinear
from tests.e2e.test_engine import hf_greedy, prompts_for
from tests.e2e.test_fp8_checkpoint import (
    GREEDY,
    assert_batch_invariant,
    assert_decode_stack_is_the_layers,
    assert_hf_tokens_and_logprobs,
    assert_rank_holds_its_part,
    pd_pair,
    runner_model,
)
from tests.e2e.test_int8_checkpoint import (
    assert_hf_with_int8_activations,
    assert_refused,
    hf_with_int8_activations,
)
from tests.helpers import localhttp
from tests.helpers.checkpoints import (
    build_compressed_int4_checkpoint,
    build_tiny_checkpoint,
    decompressed_int4_checkpoint,
)


def int4(arch: str, experts_only: bool = False, **config) -> str:
    return build_compressed_int4_checkpoint(build_tiny_checkpoint(arch, **config), 32, experts_only)


def int4_experts(model) -> list:
    return [m for m in model.modules() if getattr(m, "quantized", False)]


@pytest.mark.parametrize(
    "arch,experts_only", [("llama", False), ("qwen3_moe", False), ("deepseek_v3", True)]
)
def test_greedy_tokens_and_logprobs_equal_hf_on_the_decompression(arch, experts_only, request):
    path = int4(arch, experts_only)
    eng = pdserve.Engine(
        model_path=path, dtype="float32", torch_num_threads=1, max_total_tokens=8192
    )
    request.node._engine = eng
    model = runner_model(eng)
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    quantized = [m for m in layers if isinstance(m.impl, Int4GroupLinear)]
    if experts_only:
        assert not quantized and int4_experts(model)
    else:
        assert len(quantized) == len(layers) - 1  # all but the LM head
    assert all(e.w13.numel() == 0 for e in int4_experts(model))  # held packed only
    assert_hf_tokens_and_logprobs(eng, decompressed_int4_checkpoint(path), prompts_for(12)[:4])


def test_layers_hold_the_decompression_and_the_checkpoints_bytes():
    src = build_tiny_checkpoint("qwen3_moe", hidden_size=128, intermediate_size=256)
    path = build_compressed_int4_checkpoint(src, 32, False)
    model, _ = load_model(path, dtype="float32")
    want = load_file(f"{decompressed_int4_checkpoint(path)}/model.safetensors")
    layer = model.model.layers[0].self_attn.o_proj
    assert isinstance(layer.impl, Int4GroupLinear) and layer.weight.dtype == torch.uint8
    assert torch.equal(layer.impl.dequantized(), want["model.layers.0.self_attn.o_proj.weight"])
    experts = int4_experts(model)[0]
    down = experts.impl.linears[0][1].dequantized()  # slot 0 holds expert 0
    assert torch.equal(down, want["model.layers.0.mlp.experts.0.down_proj.weight"])
    stored = sum(
        torch.Size(shape).numel() * {"I32": 4, "F32": 4, "BF16": 2}[dtype]
        for name, (dtype, shape) in checkpoint_tensors(path).items()
        if name.endswith((".weight_packed", ".weight_scale"))
    )
    held = sum(m.impl.nbytes for m in model.modules() if isinstance(m, Linear) and m.impl)
    held += sum(e.impl.nbytes for e in int4_experts(model))
    assert held == stored, (held, stored)  # before the kernels: the checkpoint's bytes
    from pdserve import kernels
    from pdserve.quantization.registry import weight_format

    fmt = weight_format(type("Cfg", (), {"quantization_config": model.config.quantization_config}))
    packed = fmt.use_kernels(model, kernels.load())
    assert 0 < packed <= 1.05 * stored, (packed, stored)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_parallel_rank_holds_its_part_of_the_same_weights(rank):
    path = int4("llama", intermediate_size=128)  # down_proj's 128 columns: 64 a rank, 2 groups
    assert_rank_holds_its_part(path, rank, Int4GroupLinear)


def test_a_split_inside_a_group_is_refused():
    path = int4("llama", intermediate_size=96)  # down_proj's 96 columns split 48 / 48
    with pytest.raises(ValueError, match="down_proj.weight_scale_inv': columns 0:48 of 96 split"):
        load_model(path, tp=TPGroup(rank=0, size=2))


@pytest.mark.parametrize(
    "weights,acts,message",
    [
        ({"symmetric": False}, None, "weights.symmetric: False"),
        ({"num_bits": 8}, None, "weights.num_bits: 8"),
        ({"group_size": 12}, None, "weights.group_size: 12"),
        ({"strategy": "channel"}, None, "weights.strategy: 'channel'"),
        ({}, {"num_bits": 8, "type": "int", "strategy": "tensor"}, "strategy: 'tensor'"),
        ({}, {"num_bits": 8, "type": "int", "dynamic": False}, "dynamic: False"),
    ],
)
def test_int4_variants_not_built_are_refused(weights, acts, message):
    base = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 32, "symmetric": True}
    group = {"weights": {**base, **weights}}
    if acts:
        group["input_activations"] = acts
    assert_refused({"format": "pack-quantized", "config_groups": {"g": group}}, message)


def test_deterministic_inference_on_int4_weights(request):
    eng = pdserve.Engine(
        model_path=int4("qwen3_moe"),
        dtype="bfloat16",
        torch_num_threads=1,
        max_total_tokens=8192,
        enable_deterministic_inference=True,
    )
    request.node._engine = eng
    ps = prompts_for(13)[:4]
    assert_batch_invariant(eng, ps, GREEDY)


@pytest.fixture(scope="module")
def pd_kimi_layout(tmp_path_factory):
    logs = tmp_path_factory.mktemp("int4-pd")
    path = int4("deepseek_v3", experts_only=True)
    common = ["--dtype", "float32", "--max-total-tokens", "4096", "--page-size", "16"]
    yield from pd_pair("int4", path, logs, common, ["--tp-size", "2", "--ep-size", "2"], [])


def test_pd_kimi_layout_prefill_on_two_ranks_gives_hf_tokens(pd_kimi_layout):
    path, router = pd_kimi_layout
    ref = decompressed_int4_checkpoint(path)
    for ids in prompts_for(14)[:4]:
        r = localhttp.post(
            router.url + "/generate", json={"input_ids": ids, "sampling_params": GREEDY}
        )
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == hf_greedy(ref, ids, GREEDY["max_new_tokens"])


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_decode_stack_on_int4_weights_equals_layer_by_layer_path(arch, request):
    """bf16 compute: an int4 model decodes through the C++ decoder stack (linear_int4 on every
    projection; a MoE's experts in one PanelExperts call a layer) with the layer-by-layer path's
    tokens and logprobs, bit for bit."""
    eng = pdserve.Engine(
        model_path=int4(arch),
        dtype="bfloat16",
        torch_num_threads=1,
        max_total_tokens=8192,
        disable_radix_cache=True,
    )
    request.node._engine = eng
    assert_decode_stack_is_the_layers(eng)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_int8_activations_give_hf_tokens_with_the_schemes_activations(arch, request):
    """``--int4-int8-activations`` (W4A8): every int4 layer (the experts' too) multiplies its input
    quantized to int8 per token; HF on compressed-tensors' decompression with those inputs
    quantized the same way gives the same greedy tokens, logprobs as for int8 checkpoints."""
    path = int4(arch)
    eng = pdserve.Engine(
        model_path=path,
        dtype="float32",
        torch_num_threads=1,
        max_total_tokens=8192,
        int4_int8_activations=True,
    )
    request.node._engine = eng
    model = runner_model(eng)
    impls = [
        m.impl for m in model.modules() if isinstance(getattr(m, "impl", None), Int4GroupLinear)
    ]
    impls += [lin for e in int4_experts(model) for pair in e.impl.linears for lin in pair]
    assert impls and all(lin.int8_activations for lin in impls)
    hf = hf_with_int8_activations(path, decompressed_int4_checkpoint(path))
    assert_hf_with_int8_activations(eng, hf, prompts_for(12)[:4])


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_int8_activations_decode_stack_and_batch_invariance(arch, request):
    """W4A8 in bf16 compute: the C++ decoder stack gives the layer-by-layer path's bits, and a
    request's tokens and logprobs do not depend on its batch (deterministic serving)."""
    eng = pdserve.Engine(
        model_path=int4(arch),
        dtype="bfloat16",
        torch_num_threads=1,
        max_total_tokens=8192,
        disable_radix_cache=True,
        int4_int8_activations=True,
        enable_deterministic_inference=True,
    )
    request.node._engine = eng
    assert_decode_stack_is_the_layers(eng)
    assert_batch_invariant(eng, prompts_for(13)[:4], GREEDY)


@pytest.mark.parametrize("checkpoint", ["fp8", "unquantized"])
def test_int8_activations_are_refused_without_int4_weights(checkpoint):
    from tests.helpers.checkpoints import build_fp8_block_checkpoint

    src = build_tiny_checkpoint("llama")
    path = build_fp8_block_checkpoint(src, (32, 32)) if checkpoint == "fp8" else src
    with pytest.raises(ValueError, match="--int4-int8-activations"):
        pdserve.Engine(model_path=path, dtype="float32", int4_int8_activations=True)


def test_a_w4a8_checkpoint_serves_with_its_int8_activations(request):
    """A W4A8 checkpoint (llm-compressor's preset: int8 activations per token, dynamic, in its
    quantization_config) runs on the W4A8 kernel without the flag: HF's tokens with that
    activation quantization."""
    path = build_compressed_int4_checkpoint(
        build_tiny_checkpoint("llama"), 32, int8_activations=True
    )
    eng = pdserve.Engine(
        model_path=path, dtype="float32", torch_num_threads=1, max_total_tokens=8192
    )
    request.node._engine = eng
    model = runner_model(eng)
    impls = [
        m.impl for m in model.modules() if isinstance(getattr(m, "impl", None), Int4GroupLinear)
    ]
    assert impls and all(lin.int8_activations for lin in impls)
    hf = hf_with_int8_activations(path, decompressed_int4_checkpoint(path))
    assert_hf_with_int8_activations(eng, hf, prompts_for(12)[:4])
