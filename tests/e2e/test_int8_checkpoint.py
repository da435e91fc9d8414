"""compressed-tensors ``int-quantized`` W8A8 checkpoints (``weight`` I8 + ``weight_scale`` [N, 1]
per output channel, int8 activations per token at run time), written by compressed-tensors' own
compressor from the tiny models and served on the int8 kernels with the checkpoint's weights and
scales:

- each layer's weight is compressed-tensors' decompression bit for bit;
- dense models (float32 compute): HF transformers on that decompression, with each quantized
  layer's input quantized per token as the kernels do (max|x| / 127, round to nearest even), gives
  the same greedy tokens and, but where an activation sits on a rounding boundary, the same
  logprobs;
- MoE experts (one int8 weight per expert) serve, a prompt alone gives its batch's tokens;
- the bytes held are the checkpoint's; variants not built are refused naming the field."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

import pdserve
from pdserve.layers.linear import Linear
from pdserve.models.loader import checkpoint_tensors, load_model
from pdserve.quantization.int8_matmul import Int8ChannelLinear
from tests.e2e.test_engine import hf_generate_logits, prompts_for
from tests.e2e.test_fp8_checkpoint import (
    GREEDY,
    assert_batch_invariant,
    assert_decode_stack_is_the_layers,
    runner_model,
)
from tests.helpers.checkpoints import (
    build_compressed_int8_checkpoint,
    build_tiny_checkpoint,
    decompressed_checkpoint,
)


def int8(arch: str) -> str:
    return build_compressed_int8_checkpoint(build_tiny_checkpoint(arch))


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` through int8 per row by the kernels' rule (``max|x| / 127``), back in float."""
    s = x.abs().amax(-1, keepdim=True) / 127
    q = torch.round(x * torch.where(s > 0, 1 / s, torch.zeros_like(s))).clamp(-127, 127)
    return q * s


def hf_with_int8_activations(path: str, reference: str | None = None):
    """HF in float32 on the decompressed weights (``reference``: that checkpoint; default the int8
    decompression), each quantized layer's input quantized to int8 per token by the kernels' rule
    (an MoE's experts: see ``int8_expert_inputs``)."""
    from transformers import AutoModelForCausalLM

    with safe_open(f"{path}/model.safetensors", "pt") as f:
        quantized = {k[: -len(".weight_scale")] for k in f.keys() if k.endswith(".weight_scale")}
    model = AutoModelForCausalLM.from_pretrained(
        reference or decompressed_checkpoint(path), dtype=torch.float32
    ).eval()

    def quantize(module, args):
        return (quantize_rows(args[0]),)

    hooked = 0
    for name, module in model.named_modules():
        if name in quantized:
            module.register_forward_pre_hook(quantize)
            hooked += 1
    experts = ".experts."
    assert hooked == len({q for q in quantized if experts not in q}), (hooked, len(quantized))
    return model


@contextlib.contextmanager
def int8_expert_inputs(model):
    """While inside: HF's eager experts loop (``F.linear`` on each expert's slice of the fused
    ``gate_up_proj`` / ``down_proj``) multiplies int8-quantized rows, as the kernels do; yields a
    list that counts those calls. Its fused expert weights take no hooks per projection."""
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    for m in experts:  # the eager loop (grouped_mm is transformers' default)
        m.config._experts_implementation = "eager"
    storages = {
        p.untyped_storage().data_ptr() for m in experts for p in (m.gate_up_proj, m.down_proj)
    }
    linear, calls = F.linear, []

    def quantized(x, weight, bias=None):
        if weight.untyped_storage().data_ptr() in storages:
            calls.append(x.shape[0])
            x = quantize_rows(x)
        return linear(x, weight, bias)

    F.linear = quantized
    try:
        yield calls
    finally:
        F.linear = linear


def test_layers_hold_compressed_tensors_decompression():
    path = int8("qwen3_moe")
    model, _ = load_model(path, dtype="float32")
    want = load_file(f"{decompressed_checkpoint(path)}/model.safetensors")
    layer = model.model.layers[0].self_attn.o_proj
    assert isinstance(layer.impl, Int8ChannelLinear) and layer.weight.dtype == torch.int8
    assert torch.equal(layer.impl.dequantized(), want["model.layers.0.self_attn.o_proj.weight"])
    experts = [m for m in model.modules() if getattr(m, "quantized", False)]
    assert experts and all(m.w13.dtype == torch.int8 for m in experts)
    w2 = experts[0].impl.linears[0][1].dequantized()  # slot 0 is expert 0 here
    name = "model.layers.0.mlp.experts.0.down_proj.weight"
    assert torch.equal(w2, want[name])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_dense_int8_gives_hf_tokens_with_the_schemes_activations(arch, request):
    path = int8(arch)
    eng = pdserve.Engine(
        model_path=path, dtype="float32", torch_num_threads=1, max_total_tokens=8192
    )
    request.node._engine = eng
    layers = [m for m in runner_model(eng).modules() if isinstance(m, Linear)]
    assert sum(isinstance(m.impl, Int8ChannelLinear) for m in layers) == len(layers) - 1
    assert_hf_with_int8_activations(eng, hf_with_int8_activations(path), prompts_for(10)[:4])


def test_int8_moe_gives_hf_tokens_and_logprobs_with_the_schemes_activations(request):
    """A Qwen3-MoE with every projection in int8, experts included: HF's greedy tokens and
    logprobs with each quantized matmul's input (attention, each expert's two) quantized per
    token."""
    path = int8("qwen3_moe")
    eng = pdserve.Engine(
        model_path=path, dtype="float32", torch_num_threads=1, max_total_tokens=8192
    )
    request.node._engine = eng
    assert_hf_with_int8_activations(eng, hf_with_int8_activations(path), prompts_for(10)[:4])


def assert_hf_with_int8_activations(eng, hf, prompts: list[list[int]]) -> None:
    """``eng``'s greedy tokens equal ``hf``'s (``hf_with_int8_activations``, its experts' inputs
    quantized too), logprobs within float32 rounding but where an activation sits on a rounding
    boundary."""
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    diffs = []
    moe = any(type(m).__name__.endswith("Experts") for m in hf.modules())
    with int8_expert_inputs(hf) as calls:
        for ids, out in zip(prompts, outs):
            tokens, logits = hf_generate_logits(hf, ids, GREEDY["max_new_tokens"])
            assert out["output_ids"] == tokens, f"prompt of {len(ids)} tokens"
            lps = torch.log_softmax(logits.float(), -1)
            got = [v for v, _, _ in out["meta_info"]["output_token_logprobs"]]
            diffs += [abs(g - lps[i, t].item()) for i, (g, t) in enumerate(zip(got, tokens))]
    assert calls or not moe, "HF's experts did not run their matmuls through F.linear"
    # an activation on a rounding boundary moves one int8 step in one of the two, and the prompt's
    # later positions with it (measured on the dense int8 models: one prompt of four, up to
    # 0.005); the others agree to float32 rounding
    assert max(diffs) < 0.05 and sorted(diffs)[len(diffs) // 2] < 1e-4, diffs


def test_int8_moe_serves_and_rows_are_batch_invariant(request):
    eng = pdserve.Engine(
        model_path=int8("qwen3_moe"), dtype="bfloat16", torch_num_threads=1, max_total_tokens=8192
    )
    request.node._engine = eng
    ps = prompts_for(11)[:4]
    assert_batch_invariant(eng, ps, GREEDY, logprobs=False)


def test_held_bytes_are_the_checkpoints():
    """int8 weights as stored and one float32 scale per row (the int8 kernels' panels also keep
    each row's integer sum: 4 bytes a row)."""
    src = build_tiny_checkpoint("llama", hidden_size=256, intermediate_size=512, head_dim=64)
    path = build_compressed_int8_checkpoint(src)
    eng = pdserve.Engine(model_path=path, dtype="float32", torch_num_threads=1)
    try:
        held = sum(
            m.impl.nbytes
            for m in runner_model(eng).modules()
            if isinstance(m, Linear) and isinstance(m.impl, Int8ChannelLinear)
        )
    finally:
        eng.shutdown()
    stored = sum(
        torch.Size(shape).numel() * (1 if dtype == "I8" else 4)
        for name, (dtype, shape) in checkpoint_tensors(path).items()
        if dtype == "I8" or name.endswith(".weight_scale")
    )
    assert 0 < held <= 1.05 * stored, (held, stored)


@pytest.mark.parametrize(
    "edit,message",
    [
        ({"input_activations": None}, "input_activations: none .* not supported"),
        ({"weights": {"symmetric": False}}, "weights.symmetric: False"),
        ({"weights": {"num_bits": 4}}, "weights.num_bits: 4"),
        ({"input_activations": {"strategy": "tensor"}}, "input_activations.strategy: 'tensor'"),
        ({"input_activations": {"dynamic": False}}, "input_activations.dynamic: False"),
    ],
)
def test_int8_variants_not_built_are_refused(edit, message):
    weights = {"type": "int", "num_bits": 8, "strategy": "channel", "symmetric": True}
    acts = {"type": "int", "num_bits": 8, "strategy": "token", "symmetric": True, "dynamic": True}
    group = {"weights": {**weights, **edit.get("weights", {})}}
    if "input_activations" not in edit or edit["input_activations"] is not None:
        group["input_activations"] = {**acts, **(edit.get("input_activations") or {})}
    assert_refused({"format": "int-quantized", "config_groups": {"g": group}}, message)


def assert_refused(quant: dict, message: str) -> None:
    """A compressed-tensors ``quantization_config`` (``quant`` over its ``quant_method``) is
    refused by the format registry with ``message``."""
    from pdserve.quantization.registry import weight_format

    class Cfg:
        quantization_config = {"quant_method": "compressed-tensors", **quant}

    with pytest.raises(ValueError, match=message):
        weight_format(Cfg())


def test_decode_stack_on_int8_weights_equals_layer_by_layer_path(request):
    """bf16 compute: a dense compressed-tensors int8 model decodes through the C++ decoder stack
    (its layers' int8 kernels) with the layer-by-layer path's tokens and logprobs, bit for bit."""
    eng = pdserve.Engine(
        model_path=int8("llama"),
        dtype="bfloat16",
        torch_num_threads=1,
        max_total_tokens=8192,
        disable_radix_cache=True,
    )
    request.node._engine = eng
    assert_decode_stack_is_the_layers(eng)
