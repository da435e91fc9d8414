"""FP8 block-scaled checkpoints as DeepSeek, Qwen and MiniMax publish them (F8_E4M3 ``weight`` +
F32 ``weight_scale_inv`` per block, ``quantization_config.quant_method = "fp8"``), written by
``tests/helpers/checkpoints.py`` from the tiny models and served as they are:

- float32 compute: greedy tokens of HF transformers on the weights its own dequantizer gives,
  and its logprobs; blocks that divide the shapes, blocks larger than them and ragged ones
  (partial blocks on the ceil grid), power-of-two (ue8m0) scales; Llama, Qwen2 (biases), Qwen3 and
  Phi-3 (q/k/v and gate/up stored fused); Qwen3-MoE's and Mixtral's experts; DeepSeek-V2 / V3
  (latent attention, shared experts), MiniMax-M2 and GLM-4.5;
- the bytes held: the checkpoint's FP8 bytes and one scale per output row and column block;
- a tensor-parallel rank holds its rows and columns of the same weights; a split inside a scale
  block is refused naming it; broken checkpoints are refused naming the tensor;
- through PD: an FP8 prefill on 2 ranks and an FP8 decode give HF's tokens, and so does a decode
  on the unquantized (dequantized) weights of the same model taking the FP8 prefill's KV;
  DeepSeek-V3 in FP8 from a two-rank prefill; FP8 with an int8 KV cache sent layer by layer
  equals colocated;
- the kernels: the C++ decoder stack on FP8 layers, deterministic serving of FP8 weights."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import pdserve
from pdserve.distributed import TPGroup
from pdserve.layers.linear import Linear
from pdserve.models.loader import checkpoint_tensors, load_model
from pdserve.quantization.fp8_matmul import Fp8BlockLinear
from tests.e2e.test_engine import hf_greedy, hf_output_logprobs, prompts_for
from tests.helpers import cluster as c
from tests.helpers import localhttp
from tests.helpers.checkpoints import (
    build_fp8_block_checkpoint,
    build_tiny_checkpoint,
    dequantized_checkpoint,
)

NEW = 8
GREEDY = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
CASES = [
    ("llama", (128, 128), None),  # blocks larger than every tiny shape: one partial block
    ("llama", (16, 48), None),  # ragged: K = 64 and 96 end inside a block
    ("llama", (32, 32), "ue8m0"),
    ("qwen2", (32, 32), None),
    ("qwen3", (32, 32), None),  # q/k norms per head
    ("phi3", (16, 32), None),
]


def fp8(arch: str, block=(32, 32), scale_fmt=None, **edits) -> str:
    return build_fp8_block_checkpoint(build_tiny_checkpoint(arch), block, scale_fmt, **edits)


def runner_model(eng):
    return eng.scheduler.runner.model


def assert_hf_tokens_and_logprobs(eng, ref: str, prompts: list[list[int]], logprobs=True) -> None:
    """Greedy tokens of ``eng`` equal HF's on checkpoint ``ref``, and (``logprobs``) its logprobs
    within 1e-4."""
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    for ids, out in zip(prompts, outs):
        assert out["output_ids"] == hf_greedy(ref, ids, NEW), f"prompt of {len(ids)} tokens"
        if logprobs:
            got = [v for v, _, _ in out["meta_info"]["output_token_logprobs"]]
            want = hf_output_logprobs(ref, ids, out["output_ids"])
            assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4, f"prompt of {len(ids)}"


@pytest.mark.parametrize("arch,block,scale_fmt", CASES, ids=lambda v: str(v))
def test_greedy_tokens_and_logprobs_equal_hf_on_the_dequantized_weights(
    arch, block, scale_fmt, request
):
    path = fp8(arch, block, scale_fmt)
    ref = dequantized_checkpoint(path)
    eng = pdserve.Engine(
        model_path=path, dtype="float32", torch_num_threads=1, max_total_tokens=8192
    )
    request.node._engine = eng
    layers = [m for m in runner_model(eng).modules() if isinstance(m, Linear)]
    quantized = [m for m in layers if isinstance(m.impl, Fp8BlockLinear)]
    assert quantized and all(m.weight.dtype == torch.float8_e4m3fn for m in quantized)
    assert len(quantized) == len(layers) - 1  # all but the LM head
    # as in test_engine.py: Phi-3's RoPE differs before generation (its logprobs are not compared)
    assert_hf_tokens_and_logprobs(eng, ref, prompts_for(len(arch))[:5], logprobs=arch != "phi3")


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_experts_in_fp8_give_hf_tokens_and_logprobs(arch, request):
    """Every expert's gate / up / down FP8 (Qwen3-MoE-FP8's layout; Mixtral's w1 / w3 / w2), the
    router gate in bf16 as published."""
    path = fp8(arch, (32, 32))
    ref = dequantized_checkpoint(path)
    eng = pdserve.Engine(
        model_path=path, dtype="float32", torch_num_threads=1, max_total_tokens=8192
    )
    request.node._engine = eng
    experts = [m for m in runner_model(eng).modules() if getattr(m, "quantized", False)]
    assert experts and all(m.w13.dtype == torch.float8_e4m3fn for m in experts)
    assert_hf_tokens_and_logprobs(eng, ref, prompts_for(7)[:4])


def test_bf16_compute_serves_the_fp8_weights(request):
    path = fp8("llama")
    eng = pdserve.Engine(
        model_path=path, dtype="bfloat16", torch_num_threads=1, max_total_tokens=8192
    )
    request.node._engine = eng
    layers = [m for m in runner_model(eng).modules() if isinstance(m, Linear)]
    assert any(isinstance(m.impl, Fp8BlockLinear) for m in layers)
    out = eng.generate(input_ids=prompts_for(1)[0], sampling_params=GREEDY)
    assert len(out["output_ids"]) == NEW


def test_held_bytes_are_the_checkpoints():
    """The FP8 bytes as stored, and scales expanded to one per row: at most 1.05 times the
    checkpoint's bytes for these layers (K a multiple of 128, as in the published models)."""
    src = build_tiny_checkpoint("llama", hidden_size=256, intermediate_size=512, head_dim=64)
    path = build_fp8_block_checkpoint(src, (128, 128))
    tensors = checkpoint_tensors(path)
    model, _ = load_model(path, dtype="float32")
    stored = held = 0
    for module in model.modules():
        if isinstance(module, Linear) and isinstance(module.impl, Fp8BlockLinear):
            held += module.impl.nbytes
    for name, (dtype, shape) in tensors.items():
        if dtype == "F8_E4M3":
            scale = tensors[name[: -len("weight")] + "weight_scale_inv"][1]
            stored += shape[0] * shape[1] + scale[0] * scale[1] * 4
    assert stored > 0 and held <= 1.05 * stored, (held, stored)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    on_disk = sum(
        s[0] * (s[1] if len(s) > 1 else 1) * {"F8_E4M3": 1, "F32": 4, "BF16": 2}[d]
        for d, s in tensors.values()
    )
    # the model's other weights come from a bf16 checkpoint into a float32 model: 2 bytes more
    assert total - held == 2 * (on_disk - stored), (total, held, on_disk, stored)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_parallel_rank_holds_its_part_of_the_same_weights(rank):
    assert_rank_holds_its_part(fp8("llama", (16, 16)), rank, Fp8BlockLinear)


def assert_rank_holds_its_part(path: str, rank: int, impl_cls) -> None:
    """Rank ``rank`` of 2 holds, of each layer with an ``impl_cls`` matmul, the rows (each fused
    projection's own, in order) or input columns of the whole model's dequantized weight."""
    whole, _ = load_model(path, dtype="float32")
    part, _ = load_model(path, dtype="float32", tp=TPGroup(rank=rank, size=2))
    for (name, a), (_, b) in zip(whole.named_modules(), part.named_modules()):
        if not isinstance(a, Linear) or not isinstance(a.impl, impl_cls):
            continue
        full, mine = a.impl.dequantized(), b.impl.dequantized()
        if name.endswith(("o_proj", "down_proj")):  # input columns split
            cols = full.shape[1] // 2
            assert torch.equal(mine, full[:, rank * cols : (rank + 1) * cols]), name
        else:  # output rows split: each projection's own rows, fused in order
            sizes = a.output_sizes if hasattr(a, "output_sizes") else [full.shape[0]]
            want, start = [], 0
            for size in sizes:
                want.append(full[start + rank * size // 2 : start + (rank + 1) * size // 2])
                start += size
            assert torch.equal(mine, torch.cat(want)), name


def test_a_split_inside_a_scale_block_is_refused():
    path = fp8("llama", (128, 128))  # down_proj's 96 columns split 48 / 48 at tp 2
    with pytest.raises(ValueError, match="down_proj.weight_scale_inv': columns 0:48 of 96 split"):
        load_model(path, tp=TPGroup(rank=0, size=2))


@pytest.mark.parametrize(
    "edits,message",
    [
        (
            {"drop": "model.layers.0.self_attn.k_proj.weight_scale_inv"},
            "'model.layers.0.self_attn.k_proj.weight': its scale tensor "
            "'model.layers.0.self_attn.k_proj.weight_scale_inv' is missing",
        ),
        (
            {"reshape": "model.layers.1.mlp.down_proj.weight_scale_inv"},
            "'model.layers.1.mlp.down_proj.weight_scale_inv': "
            "shape \\[3, 3\\], expected \\[2, 3\\]",
        ),
        (
            {"keep": "model.layers.0.self_attn.q_proj.weight"},
            "qkv_proj: of its projections q_proj, k_proj, v_proj only k_proj, v_proj are FP8",
        ),
        ({"fmt": "e5m2"}, "quantization_config.fmt: 'e5m2'"),
    ],
)
def test_broken_checkpoints_are_refused_naming_the_tensor(edits, message):
    with pytest.raises(ValueError, match=message):
        load_model(fp8("llama", **edits))


def test_requantizing_is_refused():
    with pytest.raises(ValueError, match="--quantization w8a8_int8: the checkpoint is already"):
        pdserve.Engine(model_path=fp8("llama"), torch_num_threads=1, quantization="w8a8_int8")


def test_deterministic_inference_on_fp8_weights(request):
    """The FP8 kernel's rows do not depend on each other: a prompt decoded with others gives the
    bits it gives alone (bf16 compute, the kernel at every row count)."""
    eng = pdserve.Engine(
        model_path=fp8("llama"),
        dtype="bfloat16",
        torch_num_threads=1,
        max_total_tokens=8192,
        enable_deterministic_inference=True,
    )
    request.node._engine = eng
    impls = [m.impl for m in runner_model(eng).modules() if isinstance(m, Linear)]
    fp8_impls = [i for i in impls if isinstance(i, Fp8BlockLinear)]
    assert fp8_impls and all(i.packed is not None and not i.onednn for i in fp8_impls)
    ps = prompts_for(2)[:6]
    params = {**GREEDY, "max_new_tokens": 12}
    assert_batch_invariant(eng, ps, params)


def assert_batch_invariant(eng, prompts: list[list[int]], params: dict, logprobs=True) -> None:
    """Each prompt alone gives the tokens (and, with ``logprobs``, the logprob bits) it gives
    decoded with the others."""
    together = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    for ids, out in zip(prompts, together):
        alone = eng.generate(input_ids=ids, sampling_params=params, return_logprob=True)
        assert alone["output_ids"] == out["output_ids"]
        if logprobs:
            lp = [v for v, _, _ in out["meta_info"]["output_token_logprobs"]]
            assert [v for v, _, _ in alone["meta_info"]["output_token_logprobs"]] == lp


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    logs = tmp_path_factory.mktemp("fp8-pd")
    path = fp8("llama", (16, 16))
    common = ["--dtype", "float32", "--max-total-tokens", "4096", "--page-size", "16"]
    prefill, _ = c.prefill("P-fp8-tp2", path, logs, *common, "--tp-size", "2")
    decode = c.decode("D-fp8", path, logs, *common)
    plain = c.decode("D-plain", dequantized_checkpoint(path), logs, *common)
    procs = [prefill, decode, plain]
    routers = []
    try:
        c.start_all(procs)
        routers = [
            c.router("R-fp8", [prefill], [decode], logs).start(),
            c.router("R-plain", [prefill], [plain], logs).start(),
        ]
        yield path, routers
    finally:
        c.stop_all(routers + procs)


def hf_tokens_through(router, path: str, prompts: list[list[int]]) -> None:
    ref = dequantized_checkpoint(path)
    for ids in prompts:
        r = localhttp.post(
            router.url + "/generate", json={"input_ids": ids, "sampling_params": GREEDY}
        )
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == hf_greedy(ref, ids, NEW), f"prompt of {len(ids)} tokens"


def test_pd_fp8_prefill_on_two_ranks_to_fp8_decode_gives_hf_tokens(pd):
    path, (router, _) = pd
    hf_tokens_through(router, path, prompts_for(3)[:4])


def test_pd_fp8_prefill_to_a_decode_on_unquantized_weights(pd):
    """Same KV layout, weights stored otherwise: accepted. These are the FP8 weights' exact values
    in float32, so the tokens are HF's too (a bf16 copy would round them: other tokens)."""
    path, (_, router) = pd
    hf_tokens_through(router, path, prompts_for(4)[:3])


@pytest.fixture(scope="module")
def pd_deepseek(tmp_path_factory):
    logs = tmp_path_factory.mktemp("fp8-pd-deepseek")
    path = fp8("deepseek_v3", (16, 16))  # the tiny MLP's 96 columns split in two: 48, 3 blocks
    common = ["--dtype", "float32", "--max-total-tokens", "4096", "--page-size", "16"]
    yield from pd_pair("ds-fp8", path, logs, common, ["--tp-size", "2"], [])


def test_pd_fp8_deepseek_v3_prefill_on_two_ranks_gives_hf_tokens(pd_deepseek):
    """DeepSeek-V3 in FP8 as published: the prefill's two ranks split the heads (q_b_proj's rows,
    o_proj's columns on whole scale blocks, kv_b_proj dequantized per head) and the experts; the
    latent pages go to a one-rank decode: HF's tokens."""
    path, router = pd_deepseek
    hf_tokens_through(router, path, prompts_for(8)[:4])


@pytest.fixture(scope="module")
def pd_int8_layerwise(tmp_path_factory):
    """FP8 weights, an int8 KV cache, and the prefill sending each layer's pages as its forward
    writes them (every prompt, one layer a group)."""
    logs = tmp_path_factory.mktemp("fp8-pd-int8")
    path = fp8("llama", (16, 16))
    common = ["--dtype", "bfloat16", "--max-total-tokens", "4096", "--page-size", "16"]
    yield from int8_layerwise_pd("fp8-int8", path, logs, common, [])


def int8_layerwise_pd(name: str, path: str, logs, common: list, decode_flags: list):
    """A fixture body: a prefill of ``path`` sending int8 KV pages layer by layer (one layer a
    group, every prompt) to a decode with ``decode_flags``, behind pdserve's router; yields
    (path, router)."""
    common = [*common, "--kv-cache-dtype", "int8"]
    layers = ["--enable-disagg-layer-pipeline", "--disagg-layer-group-size", "1"]
    layers += ["--disagg-layer-pipeline-min-prefill-len", "0"]
    yield from pd_pair(name, path, logs, common, layers, decode_flags)


def pd_pair(name: str, path: str, logs, common: list, prefill_flags: list, decode_flags: list):
    """A fixture body: one prefill and one decode of ``path`` behind pdserve's router; yields
    (path, router) and stops them after."""
    prefill, _ = c.prefill(f"P-{name}", path, logs, *common, *prefill_flags)
    decode = c.decode(f"D-{name}", path, logs, *common, *decode_flags)
    procs, routers = [prefill, decode], []
    try:
        c.start_all(procs)
        routers = [c.router(f"R-{name}", [prefill], [decode], logs).start()]
        yield path, routers[0]
    finally:
        c.stop_all(routers + procs)


def test_pd_fp8_with_int8_kv_and_layerwise_transfer_equals_colocated(pd_int8_layerwise, request):
    """Through PD (int8 KV pages and their scales sent layer by layer) the tokens and logprobs of
    one engine serving the same FP8 checkpoint with the same int8 cache."""
    path, router = pd_int8_layerwise
    eng = pdserve.Engine(
        model_path=path,
        dtype="bfloat16",
        torch_num_threads=1,
        max_total_tokens=4096,
        page_size=16,
        kv_cache_dtype="int8",
    )
    request.node._engine = eng
    assert_router_equals_engine(router, eng, prompts_for(9)[:4], 1e-5)


def assert_router_equals_engine(router, eng, prompts: list[list[int]], tolerance: float) -> None:
    """Through ``router`` the greedy tokens of ``eng`` (colocated), logprobs within
    ``tolerance``."""
    for ids in prompts:
        want = eng.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
        body = {"input_ids": ids, "sampling_params": GREEDY, "return_logprob": True}
        r = localhttp.post(router.url + "/generate", json=body)
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["output_ids"] == want["output_ids"], f"prompt of {len(ids)} tokens"
        lp = [v for v, _, _ in got["meta_info"]["output_token_logprobs"]]
        ref = [v for v, _, _ in want["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(lp, ref)) < tolerance


@pytest.mark.parametrize("arch,max_rows", [("qwen3", None), ("qwen3", 2), ("qwen3_moe", None)])
def test_decode_stack_on_fp8_weights_equals_layer_by_layer_path(
    monkeypatch, arch, max_rows, request
):
    """bf16 compute: the C++ decoder stack runs the FP8 layers (a MoE's experts too) on the same
    kernels as the Python layers, identical tokens and logprobs (2: batches of 5 take the
    dequantized panels and the BLAS GEMM on both paths, the path hosts with oneDNN's bf16 and no
    AMX take)."""
    if max_rows is not None:
        from pdserve.quantization import fp8_matmul

        monkeypatch.setattr(fp8_matmul, "KERNEL_MAX_ROWS", max_rows)
    eng = pdserve.Engine(
        model_path=fp8(arch, (32, 32)),
        dtype="bfloat16",
        torch_num_threads=1,
        max_total_tokens=8192,
        disable_radix_cache=True,
    )
    request.node._engine = eng
    if max_rows is not None:  # the BLAS path beyond 2 rows, whatever this host prefers
        for m in runner_model(eng).model.modules():
            if isinstance(getattr(m, "impl", None), Fp8BlockLinear):
                m.impl.onednn = True
        runner = eng.scheduler.runner
        assert runner.model.enable_decode_stack(runner.ops)
    assert_decode_stack_is_the_layers(eng)


def assert_decode_stack_is_the_layers(eng) -> None:
    """``eng``'s decode steps through the C++ decoder stack give the tokens and logprobs of the
    layer-by-layer path, bit for bit (batches of 5)."""
    model = runner_model(eng).model
    assert model.decode_stack is not None
    prompts = prompts_for(6)[:5]
    assert model.decode_stack.max_rows() >= len(prompts)  # the batch runs through it
    sp = {**GREEDY, "max_new_tokens": 12}
    with_stack = eng.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)
    stack, model.decode_stack = model.decode_stack, None
    try:
        without = eng.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)
    finally:
        model.decode_stack = stack
    for a, b in zip(with_stack, without):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]


@pytest.mark.parametrize(
    "arch", ["deepseek_v3", "deepseek_v2", "minimax_m2", "glm4_moe", "qwen3_next"]
)
def test_fp8_moe_families_give_hf_tokens_and_logprobs(arch, request):
    """DeepSeek-V3 / V2 as their FP8 releases store them: latent attention's q_a / q_b /
    kv_a_proj_with_mqa (its width ends inside a block) and o_proj on the FP8 kernels, kv_b_proj
    (used per head, absorbed) dequantized at load, routed experts and the shared experts' MLP in
    FP8; MiniMax-M2, GLM-4.5 and Qwen3-Next (its Gated DeltaNet's projections and gated
    attention too) likewise: HF's tokens and logprobs on transformers' dequantization, in
    float32."""
    path = fp8(arch, (32, 32))
    ref = dequantized_checkpoint(path)
    eng = pdserve.Engine(
        model_path=path, dtype="float32", torch_num_threads=1, max_total_tokens=8192
    )
    request.node._engine = eng
    model = runner_model(eng)
    fp8_layers = {
        name.rsplit(".", 1)[-1]
        for name, m in model.named_modules()
        if isinstance(m, Linear) and isinstance(m.impl, Fp8BlockLinear)
    }
    experts = [m for m in model.modules() if getattr(m, "quantized", False)]
    assert experts, "the routed experts are FP8"
    if arch == "qwen3_next":
        assert {"in_proj_qkvz", "in_proj_ba", "out_proj", "qkv_proj", "o_proj"} <= fp8_layers
    if arch.startswith("deepseek"):
        assert {"kv_a_proj_with_mqa", "o_proj"} <= fp8_layers, fp8_layers
        assert "gate_up_proj" in fp8_layers and "down_proj" in fp8_layers  # the shared experts
    assert_hf_tokens_and_logprobs(eng, ref, prompts_for(5)[:4])


def test_fp8_deepseek_v32_with_its_indexer_in_fp8_gives_hf_tokens_and_logprobs(request):
    """DeepSeek-V3.2 as its FP8 release (ue8m0 scales) with the indexer's projections in FP8 too:
    ``wq_b`` and ``wk`` on the FP8 kernels, ``weights_proj`` (HF keeps it in float32) dequantized
    at load into float32, transformers' values exactly; HF's tokens and logprobs on transformers'
    dequantization, in float32. The indexer keeps every key here: with 8 of 160 kept, the FP8
    kernels' float32 rounding (each block's partial sum scaled) moves near-tied scores of the
    selection, and the tokens part from HF's even with the indexer left in bf16 (measured)."""
    src = build_tiny_checkpoint("deepseek_v32")
    also = ("wq_b", "wk", "weights_proj")
    path = build_fp8_block_checkpoint(src, (32, 32), "ue8m0", also=also)
    ref = dequantized_checkpoint(path)
    eng = pdserve.Engine(
        model_path=path, dtype="float32", torch_num_threads=1, max_total_tokens=8192
    )
    request.node._engine = eng
    indexer = runner_model(eng).model.layers[0].self_attn.indexer
    assert isinstance(indexer.wq_b.impl, Fp8BlockLinear) and isinstance(
        indexer.wk.impl, Fp8BlockLinear
    )
    want = load_file(f"{ref}/model.safetensors")[
        "model.layers.0.self_attn.indexer.weights_proj.weight"
    ]
    assert torch.equal(indexer.weights_proj.weight.data, want.float())
    assert_hf_tokens_and_logprobs(eng, ref, prompts_for(11)[3:6])


def test_fp8_mtp_draft_head_gives_plain_decodings_tokens(request):
    """DeepSeek-V3's next-token-prediction layer stored in FP8 like the rest: the draft head
    loads its FP8 projections under its own names (and dequantizes its kv_b_proj); speculative
    greedy decoding gives plain decoding's tokens, and drafts are accepted."""
    from pdserve.models.deepseek_mtp import DeepseekV3MTP
    from tests.e2e.test_speculative_mtp import SCALE, mtp_prompts
    from tests.helpers.checkpoints import build_mtp_checkpoint

    path = build_fp8_block_checkpoint(build_mtp_checkpoint(scale=SCALE), (32, 32))
    kw = dict(model_path=path, torch_num_threads=1, max_total_tokens=8192, dtype="float32")
    plain = pdserve.Engine(**kw)
    try:
        ps = mtp_prompts()[:3]
        sp = {**GREEDY, "max_new_tokens": 24}
        ref = plain.generate(input_ids=ps, sampling_params=sp)
    finally:
        plain.shutdown()
    spec = pdserve.Engine(**kw, speculative_algorithm="MTP")
    request.node._engine = spec
    head = spec.scheduler.speculator.proposer.runner.model
    assert isinstance(head, DeepseekV3MTP)
    assert any(isinstance(m.impl, Fp8BlockLinear) for m in head.modules() if isinstance(m, Linear))
    out = spec.generate(input_ids=ps, sampling_params=sp)
    assert [o["output_ids"] for o in out] == [r["output_ids"] for r in ref]
    assert sum(o["meta_info"]["spec_accept_length"] for o in out) > len(out)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "glm4_moe"])
def test_compressed_tensors_fp8_gives_hf_tokens_on_its_decompression(arch, request):
    """compressed-tensors' float-quantized format (FP8 weights, a scale per output channel, as
    llm-compressor's FP8-dynamic preset writes them; the checkpoint written by its compressor):
    each layer's weight bit for bit what compressed-tensors' decompressor gives, and HF's tokens
    and logprobs on that decompression, in float32 (experts too; GLM-4.5 as its FP8 release)."""
    from safetensors.torch import load_file

    from tests.helpers.checkpoints import build_compressed_fp8_checkpoint, decompressed_checkpoint

    path = build_compressed_fp8_checkpoint(build_tiny_checkpoint(arch))
    ref = decompressed_checkpoint(path)
    eng = pdserve.Engine(
        model_path=path, dtype="float32", torch_num_threads=1, max_total_tokens=8192
    )
    request.node._engine = eng
    model = runner_model(eng)
    want = load_file(f"{ref}/model.safetensors")
    layer = model.model.layers[0].self_attn.o_proj
    assert isinstance(layer.impl, Fp8BlockLinear) and layer.impl.block_k == layer.in_features
    assert torch.equal(layer.impl.dequantized(), want["model.layers.0.self_attn.o_proj.weight"])
    assert_hf_tokens_and_logprobs(eng, ref, prompts_for(10)[:4])


@pytest.mark.parametrize(
    "edit,message",
    [
        ({"format": "naive-quantized"}, "quantization_config.format: 'naive-quantized'"),
        (
            {"config_groups": {"g": {"weights": {"type": "int", "num_bits": 8}}}},
            "config_groups.g.weights.type: 'int'",
        ),
        (
            {"config_groups": {"g": {"weights": {"strategy": "group", "group_size": 128}}}},
            "config_groups.g.weights.strategy: 'group'",
        ),
        (
            {"config_groups": {"g": {"weights": {}, "input_activations": {"dynamic": False}}}},
            "static activation scales",
        ),
    ],
)
def test_compressed_tensors_variants_not_built_are_refused(edit, message):
    from pdserve.quantization.registry import weight_format

    quant = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"g": {"weights": {}}},
        **edit,
    }

    class Cfg:
        quantization_config = quant

    with pytest.raises(ValueError, match=message):
        weight_format(Cfg())
