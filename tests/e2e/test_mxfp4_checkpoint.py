"""MXFP4 experts as GPT-OSS publishes them (``*_blocks`` U8 e2m1 pairs + ``*_scales`` U8 E8M0 per
32 values, ``quantization_config.quant_method = "mxfp4"``), written by
``tests/helpers/checkpoints.py`` from the tiny GPT-OSS and served as they are:

- float32 compute: greedy tokens and logprobs of HF transformers on the weights its own MXFP4
  dequantizer gives; bf16 compute serves them too;
- the bytes held: the checkpoint's codes and scale bytes (4.25 bits a weight), repacked;
- a tensor-parallel rank holds its rows and whole groups of the same weights; a split inside a
  group is refused naming the dimension; broken checkpoints are refused naming the tensor;
- deterministic serving on MXFP4 weights; requantizing refused;
- through PD: an MXFP4 prefill sending an int8 KV cache layer by layer to an MXFP4 decode with DP
  attention and expert parallelism (dp 2, ep 2) gives the colocated engine's tokens."""

from __future__ import annotations

import pytest
import torch

import pdserve
from pdserve import kernels
from pdserve.distributed import TPGroup
from pdserve.models.loader import checkpoint_tensors, load_model
from pdserve.quantization.mxfp4 import Mxfp4
from pdserve.quantization.mxfp4_matmul import Mxfp4Experts
from tests.e2e.test_engine import prompts_for
from tests.e2e.test_fp8_checkpoint import (
    GREEDY,
    assert_batch_invariant,
    assert_hf_tokens_and_logprobs,
    assert_router_equals_engine,
    int8_layerwise_pd,
    runner_model,
)
from tests.helpers.checkpoints import (
    build_mxfp4_checkpoint,
    build_tiny_checkpoint,
    mxfp4_dequantized_checkpoint,
)


def mxfp4(**edits) -> str:
    return build_mxfp4_checkpoint(build_tiny_checkpoint("gpt_oss"), **edits)


def mxfp4_experts(model) -> list:
    return [m for m in model.modules() if isinstance(getattr(m, "impl", None), Mxfp4Experts)]


def test_greedy_tokens_and_logprobs_equal_hf_on_the_dequantized_weights(request):
    path = mxfp4()
    eng = pdserve.Engine(
        model_path=path, dtype="float32", torch_num_threads=1, max_total_tokens=8192
    )
    request.node._engine = eng
    experts = mxfp4_experts(runner_model(eng))
    assert len(experts) == 4  # every layer's
    assert all(w.packed is not None for e in experts for pair in e.impl.linears for w in pair)
    assert_hf_tokens_and_logprobs(eng, mxfp4_dequantized_checkpoint(path), prompts_for(7)[:4])


def test_bf16_compute_serves_the_mxfp4_weights(request):
    eng = pdserve.Engine(
        model_path=mxfp4(), dtype="bfloat16", torch_num_threads=1, max_total_tokens=8192
    )
    request.node._engine = eng
    out = eng.generate(input_ids=prompts_for(1)[0], sampling_params=GREEDY)
    assert len(out["output_ids"]) == GREEDY["max_new_tokens"]


def test_held_bytes_are_the_checkpoints():
    """The codes and scale bytes as stored, repacked into the kernels' panels: at most 1.05 times
    the checkpoint's expert bytes (rows a multiple of 64, as in the published models)."""
    src = build_tiny_checkpoint("gpt_oss", hidden_size=128, intermediate_size=128)
    path = build_mxfp4_checkpoint(src)
    model, _ = load_model(path, dtype="float32")
    stored = sum(
        torch.Size(shape).numel()
        for name, (_, shape) in checkpoint_tensors(path).items()
        if name.endswith(("_blocks", "_scales"))
    )
    before = sum(e.impl.nbytes for e in mxfp4_experts(model))
    held = Mxfp4().use_kernels(model, kernels.load())
    assert before == stored and 0 < held <= 1.05 * stored, (held, before, stored)
    # nothing else holds the experts' bytes
    for e in mxfp4_experts(model):
        assert all(getattr(e, n).numel() == 0 for n in ("w13", "w2", "w13_scale", "w2_scale"))


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_parallel_rank_holds_its_part_of_the_same_weights(rank):
    """Intermediate 64 over 2 ranks: each holds its gate and up rows and its 32 down columns (one
    whole group) of every expert."""
    path = build_mxfp4_checkpoint(build_tiny_checkpoint("gpt_oss", intermediate_size=64))
    whole, _ = load_model(path, dtype="float32")
    part, _ = load_model(path, dtype="float32", tp=TPGroup(rank=rank, size=2))
    pairs = list(zip(mxfp4_experts(whole), mxfp4_experts(part)))
    assert pairs
    for a, b in pairs:
        for (w13, w2), (m13, m2) in zip(a.impl.linears, b.impl.linears):
            full13, full2 = w13.dequantized(), w2.dequantized()
            gate, up = full13[:64], full13[64:]
            mine = slice(rank * 32, (rank + 1) * 32)
            assert torch.equal(m13.dequantized(), torch.cat([gate[mine], up[mine]]))
            assert torch.equal(m2.dequantized(), full2[:, mine])


def test_a_split_inside_a_group_is_refused():
    with pytest.raises(ValueError, match="16 intermediate columns .* not whole 32-value"):
        load_model(mxfp4(), tp=TPGroup(rank=0, size=2))  # intermediate 32 over 2 ranks


EXPERTS = "model.layers.1.mlp.experts"


@pytest.mark.parametrize(
    "edits,message",
    [
        (
            {"drop": f"{EXPERTS}.down_proj_scales"},
            f"'{EXPERTS}.down_proj_blocks': its scale tensor '{EXPERTS}.down_proj_scales' is "
            "missing",
        ),
        (
            {"reshape": f"{EXPERTS}.gate_up_proj_scales"},
            f"'{EXPERTS}.gate_up_proj_scales': U8 \\[4, 64, 1\\], expected U8 \\[4, 64, 2\\]",
        ),
        (
            {"drop": f"{EXPERTS}.gate_up_proj_blocks"},
            f"{EXPERTS}: gate_up_proj_blocks missing",
        ),
        (
            {"scale": (f"{EXPERTS}.down_proj_scales", 255)},
            f"{EXPERTS}.down_proj_scales: scale byte 255 \\(NaN\\) is out of the range",
        ),
    ],
)
def test_broken_checkpoints_are_refused_naming_the_tensor(edits, message):
    with pytest.raises(ValueError, match=message):
        load_model(mxfp4(**edits))


def test_requantizing_and_other_gpt_oss_quantizations_are_refused(tmp_path):
    import json
    import shutil

    with pytest.raises(ValueError, match="--quantization w8a8_int8: the checkpoint is already"):
        pdserve.Engine(model_path=mxfp4(), torch_num_threads=1, quantization="w8a8_int8")
    dst = tmp_path / "fp8"
    shutil.copytree(build_tiny_checkpoint("gpt_oss"), dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [32, 32]}
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT-OSS checkpoints quantized with 'fp8'.*mxfp4"):
        load_model(str(dst))


@pytest.mark.parametrize("int8_activations", [False, True])
def test_deterministic_inference_on_mxfp4_weights(int8_activations, request):
    """The kernel's rows do not depend on each other: a prompt decoded with others gives the bits
    it gives alone (bf16 compute, one kernel at every row count; with
    ``--mxfp4-int8-activations``: exact integer sums, the scales in a fixed order)."""
    eng = pdserve.Engine(
        model_path=mxfp4(),
        dtype="bfloat16",
        torch_num_threads=1,
        max_total_tokens=8192,
        enable_deterministic_inference=True,
        mxfp4_int8_activations=int8_activations,
    )
    request.node._engine = eng
    linears = [w for e in mxfp4_experts(runner_model(eng)) for p in e.impl.linears for w in p]
    assert linears and all(w.amx_min_rows == -1 for w in linears)
    ps = prompts_for(2)[:6]
    params = {**GREEDY, "max_new_tokens": 12}
    assert_batch_invariant(eng, ps, params)


COMMON = ["--dtype", "float32", "--max-total-tokens", "4096", "--page-size", "16"]


@pytest.fixture(scope="module")
def pd_dp_ep(tmp_path_factory):
    """An MXFP4 prefill sending int8 KV pages layer by layer (one layer a group) to an MXFP4
    decode with DP attention over 2 ranks and the 4 experts split over 2 expert-parallel
    ranks."""
    logs = tmp_path_factory.mktemp("mxfp4-pd")
    dp_ep = ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--ep-size", "2"]
    yield from int8_layerwise_pd("mxfp4", mxfp4(), logs, COMMON, dp_ep)


def test_pd_mxfp4_to_dp_attention_and_expert_parallel_decode_equals_colocated(pd_dp_ep, request):
    """Through PD the tokens of one engine serving the same checkpoint with the same int8 cache,
    and logprobs within 1e-4 (float32: the ranks' partial sums add in another order)."""
    path, router = pd_dp_ep
    eng = pdserve.Engine(
        model_path=path,
        dtype="float32",
        torch_num_threads=1,
        max_total_tokens=4096,
        page_size=16,
        kv_cache_dtype="int8",
    )
    request.node._engine = eng
    assert_router_equals_engine(router, eng, prompts_for(9)[:4], 1e-4)


def first_token_logprobs(eng, prompts: list[list[int]]) -> list[tuple[int, float, dict]]:
    """(token, logprob, top-2 logprobs by token) of each prompt's first greedy token."""
    outs = eng.generate(
        input_ids=prompts,
        sampling_params={**GREEDY, "max_new_tokens": 1},
        return_logprob=True,
        top_logprobs_num=2,
    )
    return [
        (
            o["output_ids"][0],
            o["meta_info"]["output_token_logprobs"][0][0],
            {t: v for v, t, _ in o["meta_info"]["output_top_logprobs"][0]},
        )
        for o in outs
    ]


def test_int8_activations_follow_the_16_bit_experts_where_decisive(request):
    """``--mxfp4-int8-activations``: every expert matmul takes ``linear_mxfp4_w4a8`` (the layer's
    C++ call too). Against the same checkpoint's 16-bit-activation experts, float32 compute: the
    first token's logprob within 0.06 (the activations' int8 rounding; measured up to 0.038 on
    these prompts), the token itself the same wherever the 16-bit run's top-2 gap exceeds 0.1."""
    if kernels.load() is None:
        pytest.skip(f"the CPU kernels are not available here: {kernels.unavailable_reason()}")
    path = mxfp4()
    prompts = prompts_for(5)
    common = dict(model_path=path, dtype="float32", torch_num_threads=1, max_total_tokens=8192)
    eng = pdserve.Engine(**common, mxfp4_int8_activations=True)
    request.node._engine = eng
    experts = mxfp4_experts(runner_model(eng))
    linears = [w for e in experts for pair in e.impl.linears for w in pair]
    assert experts and all(e.impl.fused is not None for e in experts)
    assert linears and all(w.int8_activations and w.panels().codes == 4 for w in linears)
    got = first_token_logprobs(eng, prompts)
    eng.shutdown()
    w16 = pdserve.Engine(**common)
    request.node._engine = w16
    want = first_token_logprobs(w16, prompts)
    decisive = 0
    for (tok, lp, _), (ref_tok, ref_lp, top) in zip(got, want):
        if tok == ref_tok:
            assert abs(lp - ref_lp) < 0.06
        values = sorted(top.values(), reverse=True)
        if values[0] - values[1] > 0.1:
            decisive += 1
            assert tok == ref_tok
    assert decisive >= len(prompts) // 2, f"only {decisive} decisive prompts"


@pytest.mark.parametrize("checkpoint", ["int4", "unquantized"])
def test_mxfp4_int8_activations_are_refused_without_mxfp4_weights(checkpoint):
    from tests.helpers.checkpoints import build_compressed_int4_checkpoint

    src = build_tiny_checkpoint("llama")
    path = build_compressed_int4_checkpoint(src, 32, False) if checkpoint == "int4" else src
    with pytest.raises(ValueError, match="--mxfp4-int8-activations"):
        pdserve.Engine(model_path=path, dtype="float32", mxfp4_int8_activations=True)


def test_int4_int8_activations_are_refused_on_mxfp4_weights():
    with pytest.raises(ValueError, match="--int4-int8-activations: the checkpoint has no int4"):
        pdserve.Engine(model_path=mxfp4(), dtype="float32", int4_int8_activations=True)
