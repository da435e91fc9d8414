"""DeepSeek's routers against HF's (V2 greedy and group-limited softmax, V3 grouped sigmoid with
the correction bias), the tie rule (highest score first, lowest index among equals) where HF's
``torch.topk`` leaves the order open, float32 router weights in a bf16 model, and the config
fields pdserve does not implement refused at load, naming the field."""

from __future__ import annotations

import pytest
import torch
import transformers

from pdserve.layers.moe.router import GroupedSigmoidTopK, GroupedSoftmaxTopK, topk_ordered

torch.set_num_threads(1)


def _hf_router(cls_name: str, **fields):
    config = getattr(transformers, cls_name.replace("TopkRouter", "Config"))(
        hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, **fields
    )
    module = getattr(
        transformers.models,
        cls_name.split("TopkRouter")[0].lower().replace("deepseekv", "deepseek_v"),
    )
    router = getattr(getattr(module, f"modeling_{module.__name__.rsplit('.', 1)[1]}"), cls_name)(
        config
    )
    return router, config


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_v2_routing_matches_hf(method):
    hf, config = _hf_router(
        "DeepseekV2TopkRouter",
        topk_method=method,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.7,
    )
    torch.manual_seed(0)
    hf.weight.data.normal_(0, 1)
    ours = GroupedSoftmaxTopK(32, 16, 4, method, 4, 2, 1.7)
    ours.weight.data.copy_(hf.weight.data)
    x = torch.randn(50, 32)
    _, w, ids = hf(x)
    got = ours(x)
    order = torch.argsort(ids, dim=-1)  # HF's top-k is unsorted: compare as sets with their weights
    got_order = torch.argsort(got.ids, dim=-1)
    assert torch.equal(ids.gather(1, order), got.ids.gather(1, got_order))
    torch.testing.assert_close(
        w.gather(1, order), got.weights.gather(1, got_order), rtol=0, atol=1e-7
    )


def test_v3_routing_matches_hf():
    hf, config = _hf_router(
        "DeepseekV3TopkRouter",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )

    torch.manual_seed(1)
    hf.weight.data.normal_(0, 1)
    hf.e_score_correction_bias.copy_(torch.randn(16) * 0.3)
    ours = GroupedSigmoidTopK(32, 16, 4, 4, 2, True, 2.5)
    ours.weight.data.copy_(hf.weight.data)
    ours.e_score_correction_bias.data.copy_(hf.e_score_correction_bias)
    x = torch.randn(50, 32)
    _, w, ids = hf(x)
    got = ours(x)
    order, got_order = torch.argsort(ids, dim=-1), torch.argsort(got.ids, dim=-1)
    assert torch.equal(ids.gather(1, order), got.ids.gather(1, got_order))
    torch.testing.assert_close(
        w.gather(1, order), got.weights.gather(1, got_order), rtol=0, atol=1e-6
    )


def test_ties_go_to_the_lowest_index():
    x = torch.tensor([[0.5, 0.9, 0.5, 0.9, 0.1, 0.5]] * 2)
    values, ids = topk_ordered(x, 4)
    assert ids.tolist() == [[1, 3, 0, 2]] * 2 and torch.equal(values[0], x[0, [1, 3, 0, 2]])
    # a router whose experts all score the same picks the lowest ids, whatever the row count
    r = GroupedSigmoidTopK(8, 8, 2, 4, 2, True, 1.0)
    r.weight.data.zero_()
    r.e_score_correction_bias.data.zero_()
    for rows in (1, 7, 64):
        assert (
            r(torch.randn(rows, 8)).ids.tolist() == [[0, 1]] * rows
        )  # groups 0 and 1, then experts 0 and 1


def test_router_weights_stay_float32_in_a_bf16_model():
    with torch.device("meta"):
        r = GroupedSigmoidTopK(8, 8, 2, 4, 2, True, 1.0)
    r = r.to(dtype=torch.bfloat16).to_empty(device="cpu")
    assert r.weight.dtype == r.e_score_correction_bias.dtype == torch.float32


@pytest.mark.parametrize(
    "arch, field, value, needle",
    [
        ("deepseek_v3", "scoring_func", "softmax", "scoring_func: 'softmax' is not supported"),
        ("deepseek_v3", "topk_method", "greedy", "topk_method: 'greedy' is not supported"),
        ("deepseek_v2", "topk_method", "noaux_tc", "topk_method: 'noaux_tc' is not supported"),
        (
            "deepseek_v3",
            "quantization_config",
            {"quant_method": "awq", "bits": 4},
            "quantization_config: 'awq' weights are not supported for",
        ),
    ],
)
def test_unsupported_config_fields_are_refused_naming_them(arch, field, value, needle):
    from pdserve.models.registry import model_class
    from tests.helpers.checkpoints import tiny_config

    config = tiny_config(arch)
    setattr(config, field, value)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        with torch.device("meta"):
            model_class(config)(config)


def test_router_scores_do_not_depend_on_the_row_count():
    """V3's sigmoid scores of a token are the same bits alone or among others (PyTorch's remainder
    path, which rows of fewer columns than a vector land in, can differ in the last bit)."""
    from pdserve.layers.moe.router import rowwise_sigmoid

    x = torch.randn(67, 8, generator=torch.Generator().manual_seed(3)) * 4
    full = rowwise_sigmoid(x)
    for rows in (1, 2, 3, 5, 17, 66):
        assert torch.equal(rowwise_sigmoid(x[:rows]), full[:rows]), rows
    torch.testing.assert_close(full, x.sigmoid(), rtol=0, atol=1e-7)
