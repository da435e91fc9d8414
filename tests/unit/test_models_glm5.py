"""GLM-5's layers as the config lays them out (the tiny recipe: indexers on layers 0 and 2, layers 1
and 3 sharing their top-k; MLPs dense, sparse, sparse, dense): what each layer caches, which cache
groups and PD regions that makes, its MLPs, and the configs it refuses, naming the field."""

from __future__ import annotations

import pytest
import torch

from pdserve.distributed import Parallel
from pdserve.kv_spec import IndexKeys, LatentAttention, group_layers, transfer_bytes_per_token
from pdserve.models.glm5 import GlmMoeDsaForCausalLM
from tests.helpers.checkpoints import tiny_config


def config(**overrides):
    return tiny_config("glm5", **overrides)


def test_a_shared_layer_keeps_no_index_key_cache():
    from pdserve.disagg.kv_args import KVArgs
    from pdserve.disagg.metadata import MetadataBuffers
    from pdserve.engine.cache_kinds import make_pool

    cfg = config()
    model = GlmMoeDsaForCausalLM(cfg)
    latent = LatentAttention(cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    full = (latent, IndexKeys(cfg.index_head_dim))
    assert model.kv_cache_specs() == [full, (latent,), full, (latent,)]
    assert [layer.self_attn.indexer is None for layer in model.model.layers] == [
        False,
        True,
        False,
        True,
    ]
    groups = group_layers(model.kv_cache_specs())
    assert [(g.kind, g.layers) for g in groups] == [
        ("latent_attention", (0, 1, 2, 3)),
        ("index_keys", (0, 2)),
    ]
    # float32: four layers' latents and two layers' index keys per token, nothing more
    assert transfer_bytes_per_token(groups, 1, 4) == (4 * (32 + 8) + 2 * 16) * 4
    pools = [make_pool(g, 5, 4, torch.float32, "cpu") for g in groups]
    regions = KVArgs.from_buffers(pools, MetadataBuffers(2), cache_groups=groups).regions
    assert sorted((r.layer, r.part) for r in regions if r.part == "index_k") == [
        (0, "index_k"),
        (2, "index_k"),
    ]


def test_the_mlps_follow_mlp_layer_types_not_first_k_dense_replace():
    cfg = config()
    assert cfg.first_k_dense_replace == 1  # it would make layer 3 sparse
    model = GlmMoeDsaForCausalLM(cfg)
    kinds = [hasattr(layer.mlp, "experts") for layer in model.model.layers]
    assert kinds == [False, True, True, False]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"indexer_types": ["shared", "full", "full", "full"]},
            "indexer_types: layer 0 is 'shared'",
        ),
        ({"indexer_types": ["full", "skip", "full", "full"]}, r"indexer_types: \['skip'\]"),
        ({"indexer_types": ["full", "full"]}, "indexer_types: 2 entries for 4 layers"),
    ],
)
def test_a_layout_it_cannot_serve_is_refused_naming_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        GlmMoeDsaForCausalLM(config(**overrides))


def test_a_pipeline_stage_must_begin_at_a_full_layer():
    cfg = config()
    # two stages of layers 0-1 and 2-3: each begins at a full layer
    GlmMoeDsaForCausalLM(cfg, par=Parallel(pp_rank=1, pp_size=2))
    # four stages: stage 1 is layer 1 alone, whose top-k comes from layer 0
    with pytest.raises(ValueError, match="pp_size: 4 stages put layer 1 first on stage 1"):
        GlmMoeDsaForCausalLM(cfg, par=Parallel(pp_rank=1, pp_size=4))
