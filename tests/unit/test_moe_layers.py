"""MoE building blocks against HF transformers' modules: the routers of Qwen3-MoE, Mixtral and
GPT-OSS (ids, weights and their dtypes, float32 and bf16), the experts (both runners, both
activations, slots held elsewhere), expert placement, and the start-up checks of the layout."""

from __future__ import annotations

import pytest
import torch
import transformers

from pdserve.distributed import Parallel, TPGroup
from pdserve.layers.moe.context import MoEContext, MoEOptions
from pdserve.layers.moe.experts import Experts
from pdserve.layers.moe.placement import ExpertPlacement, to_physical
from pdserve.layers.moe.router import TopKSoftmax, mixtral_router, qwen_router

torch.set_num_threads(1)


def qwen3_config(**kw):
    return transformers.Qwen3MoeConfig(
        hidden_size=32, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, **kw
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renorm", [True, False])
def test_qwen3_router_matches_hf(dtype, renorm):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = qwen3_config(norm_topk_prob=renorm)
    torch.manual_seed(0)
    hf = Qwen3MoeTopKRouter(cfg).to(dtype)
    torch.nn.init.normal_(hf.weight, std=0.5)
    ours = qwen_router(cfg).to(dtype)
    ours.weight.data.copy_(hf.weight.data)
    x = torch.randn(11, 32).to(dtype)
    _, w, ids = hf(x)
    r = ours(x)
    assert (
        torch.equal(r.ids, ids)
        and r.weights.dtype == w.dtype == dtype
        and torch.equal(r.weights, w)
    )


def test_mixtral_router_keeps_float32_weights():
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    cfg = transformers.MixtralConfig(hidden_size=32, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(1)
    hf = MixtralTopKRouter(cfg).to(torch.bfloat16)
    torch.nn.init.normal_(hf.weight, std=0.5)
    ours = mixtral_router(cfg).to(torch.bfloat16)
    ours.weight.data.copy_(hf.weight.data)
    x = torch.randn(9, 32).to(torch.bfloat16)
    _, w, ids = hf(x)
    r = ours(x)
    assert r.weights.dtype == torch.float32 == w.dtype
    assert torch.equal(r.ids, ids) and torch.equal(r.weights, w)


def test_gpt_oss_router_matches_hf():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    cfg = transformers.GptOssConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=4)
    torch.manual_seed(2)
    hf = GptOssTopKRouter(cfg)
    torch.nn.init.normal_(hf.weight, std=0.5)
    torch.nn.init.normal_(hf.bias, std=0.5)
    ours = TopKSoftmax(32, 8, 4)
    ours.weight.data.copy_(hf.weight.data)
    ours.bias.data.copy_(hf.bias.data)
    x = torch.randn(7, 32)
    _, w, ids = hf(x)
    r = ours(x)
    assert torch.equal(r.ids, ids) and torch.allclose(r.weights, w, atol=0, rtol=0)


def random_experts(
    activation: str, bias: bool, runner: str, slots=(0, 1, 2, 3), hidden=32, inter=16
):
    torch.manual_seed(3)
    e = Experts(hidden, (0, inter), list(slots), activation=activation, bias=bias, runner=runner)
    for p in e.parameters():
        p.data.normal_(0, 0.3)
    return e


@pytest.mark.parametrize("runner", ["loop", "grouped_mm"])
def test_experts_match_hf_qwen3_experts(runner):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = qwen3_config()
    cfg.num_experts = 4
    hf = Qwen3MoeExperts(cfg)
    ours = random_experts("silu", False, runner)
    hf.gate_up_proj.data.copy_(ours.w13.data)
    hf.down_proj.data.copy_(ours.w2.data)
    x = torch.randn(13, 32)
    ids = torch.randint(0, 4, (13, 2))
    w = torch.rand(13, 2)
    torch.testing.assert_close(ours(x, ids, w), hf(x, ids, w), atol=1e-6, rtol=1e-6)


def test_gpt_oss_experts_match_hf_after_deinterleaving():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = transformers.GptOssConfig(hidden_size=32, num_local_experts=4, intermediate_size=16)
    torch.manual_seed(4)
    hf = GptOssExperts(cfg)
    for p in hf.parameters():
        p.data.normal_(0, 0.3)
    ours = Experts(
        32, (0, 16), [0, 1, 2, 3], activation="swiglu_oai", bias=True, fmt="gpt_oss", runner="loop"
    )
    for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        ours.load_checkpoint(name, getattr(hf, name).data)
    x = torch.randn(10, 32)
    ids = torch.randint(0, 4, (10, 2))
    w = torch.rand(10, 2)
    torch.testing.assert_close(ours(x, ids, w), hf(x, ids, w), atol=1e-5, rtol=1e-5)


def test_slots_elsewhere_are_skipped_and_runners_agree():
    loop = random_experts("swiglu_oai", True, "loop")
    grouped = random_experts("swiglu_oai", True, "grouped_mm")
    x = torch.randn(9, 32)
    ids = torch.randint(-1, 4, (9, 3))
    ids[0] = -1  # a token with no expert here
    w = torch.rand(9, 3)
    a, b = loop(x, ids, w), grouped(x, ids, w)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert torch.equal(a[0], torch.zeros(32))
    kept = torch.where(ids >= 0, ids, 0)
    masked_w = torch.where(ids >= 0, w, torch.zeros_like(w))
    torch.testing.assert_close(a, loop(x, kept, masked_w), atol=1e-6, rtol=1e-6)


def test_copies_of_an_expert_share_its_tokens():
    p = ExpertPlacement(4, 2, {0: [0, 1, 2, 0, 3, 1]})  # experts 0 and 1 have two copies
    table, counts = p.dispatch_table(0)
    ids = torch.tensor([[0, 2], [0, 3], [1, 0], [0, 1]])
    slots = to_physical(ids, table, counts)
    assert [p.physical_to_logical[0][s] for s in slots.flatten().tolist()] == ids.flatten().tolist()
    assert slots[:, 0].tolist() == [
        0,
        3,
        1,
        3,
    ]  # the j-th pair routed to an expert takes copy j % 2
    assert p.rank_slots(0, 1) == [0, 3, 1]


def layout(tp: int, **options) -> MoEContext:
    group = TPGroup(rank=0, size=tp)
    return MoEContext(Parallel(world=group, tp=group, attn=group), MoEOptions(**options))


def test_layout_checks_name_the_flags_and_values():
    with pytest.raises(ValueError, match=r"ep_size: 3 must divide the tensor-parallel size 4"):
        layout(4, ep_size=3).check(8)
    with pytest.raises(ValueError, match=r"ep_size: 4 does not divide the model's 6 experts"):
        layout(4, ep_size=4).check(6)
    with pytest.raises(ValueError, match=r"plus 1 redundant"):
        layout(2, ep_size=2, num_redundant_experts=1).check(8)
    with pytest.raises(ValueError, match=r"moe_a2a_backend: 'torch'.*--ep-size 2"):
        layout(4, ep_size=2, a2a_backend="torch").check(8)
    ctx = layout(4, ep_size=2)
    ctx.check(8)
    assert (ctx.moe_tp_size, ctx.ep_rank, ctx.moe_tp_rank) == (2, 0, 0)


def test_server_flags_are_checked(tmp_path):
    from pdserve.config import ServerArgs

    cases = [
        (dict(tp_size=2, ep_size=4), "ep_size: must divide --tp-size \\(2\\), got 4"),
        (
            dict(moe_a2a_backend="torch"),
            "needs expert parallelism \\(--ep-size > 1\\), got --ep-size 1",
        ),
        (
            dict(tp_size=4, ep_size=2, moe_a2a_backend="torch"),
            "needs --ep-size equal to --tp-size \\(4\\)",
        ),
        (dict(moe_dense_tp_size=2), "moe_dense_tp_size: must be 1"),
        (
            dict(init_expert_location=str(tmp_path / "nope.json")),
            "init_expert_location: .*no such file",
        ),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            ServerArgs(model_path=str(tmp_path), **kw)


def test_sglang_spellings_of_the_ep_flag():
    import argparse

    from pdserve.config import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    for flag in ("--ep-size", "--ep", "--expert-parallel-size"):
        assert parser.parse_args(["--model-path", "m", flag, "2"]).ep_size == 2
