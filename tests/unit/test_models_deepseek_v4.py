"""DeepSeek-V4's pieces against HF's modules: the rotary tables (default and YaRN, partial), the
hyper-connection weights, and the MTP weights set aside at load."""

from __future__ import annotations

import pytest
import torch

hf = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

from transformers import DeepseekV4Config  # noqa: E402

from pdserve.layers.hyper_connections import hyper_weights  # noqa: E402
from pdserve.models.deepseek_v4 import _rope  # noqa: E402


def config(**kw) -> DeepseekV4Config:
    return DeepseekV4Config(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        head_dim=64,
        q_lora_rank=8,
        o_groups=1,
        o_lora_rank=8,
        moe_intermediate_size=8,
        n_routed_experts=2,
        num_experts_per_tok=1,
        index_n_heads=1,
        index_head_dim=16,
        layer_types=["compressed_sparse_attention"],
        mlp_layer_types=["moe"],
        num_nextn_predict_layers=0,
        **kw,
    )


@pytest.mark.parametrize("compress", ["default", "yarn"])
def test_rotary_tables_equal_hf(compress):
    params = {"rope_type": compress, "rope_theta": 160000.0, "partial_rotary_factor": 0.25}
    if compress == "yarn":
        params.update(factor=16.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1)
    cfg = config(
        max_position_embeddings=65536,
        rope_parameters={
            "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            "compress": params,
        },
    )
    ref = hf.DeepseekV4RotaryEmbedding(cfg)
    for kind in ("main", "compress"):
        inv, scaling = _rope(cfg, kind)
        assert torch.equal(inv, getattr(ref, f"{kind}_inv_freq"))
        assert scaling == getattr(ref, f"{kind}_attention_scaling")
    with pytest.raises(ValueError, match=r"rope_parameters\['compress'\]: rope_type 'linear'"):
        cfg.rope_parameters["compress"]["rope_type"] = "linear"
        _rope(cfg, "compress")


def test_hyper_connection_weights_equal_hf():
    cfg = config(hc_mult=4)
    torch.manual_seed(0)
    ref = hf.DeepseekV4HyperConnection(cfg).float()
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.5)
    streams = torch.randn(7, 4, 32)
    post, comb, collapsed = ref(streams[None])
    ours = hyper_weights(cfg, ref.fn, ref.base, ref.scale, streams)
    for a, b in zip(ours, (post[0], comb[0], collapsed[0])):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_mtp_layers_are_set_aside_at_load():
    from pdserve.models.deepseek_v4 import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM(config())
    weights = {n: t.detach().clone().normal_() for n, t in model.named_parameters()}
    weights.update({n: t.detach().clone() for n, t in model.named_buffers()})
    # the published names, an MTP layer's among them: the experts' one tensor per expert and
    # projection (w1 gate, w3 up, w2 down), the router's selection bias ``gate.bias``
    published = {}
    for n, t in weights.items():
        n = (
            n.replace(".compressor.kv_proj.", ".compressor.wkv.")
            .replace(".compressor.gate_proj.", ".compressor.wgate.")
            .replace(".compressor.position_bias", ".compressor.ape")
            .replace(".ffn.gate.correction", ".ffn.gate.bias")
        )
        head, sep, leaf = n.partition(".experts.")
        if not sep:
            published[n] = t
        for e in range(t.shape[0] if sep else 0):
            if leaf == "w2":
                published[f"{head}.experts.{e}.w2.weight"] = t[e]
            else:
                gate, up = t[e].chunk(2)
                published[f"{head}.experts.{e}.w1.weight"] = gate
                published[f"{head}.experts.{e}.w3.weight"] = up
    published["mtp.0.ffn.gate.weight"] = torch.zeros(2, 32)
    model.load_weights(published.items())
    assert model.mtp_weights == {"mtp.0.ffn.gate.weight": (2, 32)}
    got = dict(model.named_parameters())
    assert torch.equal(
        got["model.layers.0.attn.compressor.position_bias"],
        weights["model.layers.0.attn.compressor.position_bias"],
    )
    del published["model.layers.0.attn.wkv.weight"]
    with pytest.raises(ValueError, match="lacks 1 weights: .*attn.wkv.weight"):
        DeepseekV4ForCausalLM(config()).load_weights(published.items())
