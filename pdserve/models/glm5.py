"""GLM-5 (``GlmMoeDsaForCausalLM``): DeepSeek-V3.2's latent attention with the lightning indexer,
and DeepSeek-V3's MoE layout and sigmoid routing (``models/deepseek.py``), with three changes:

- **Interleaved RoPE in the indexer.** Its queries' and key's first ``qk_rope_head_dim`` dims
  turn as interleaved pairs, as the attention's do (V3.2's indexer turns halves).
- **Cross-layer top-k sharing.** ``indexer_types[i]`` is ``"full"`` (layer i runs its indexer and
  caches its index keys) or ``"shared"`` (layer i has no indexer and no index-key cache, and
  attends to the keys the last full layer before it chose for the same tokens). The shared
  layers are simply not in the ``index_keys`` cache group, so their pages hold no index keys and
  PD moves none for them. The selection passes from layer to layer in the forward batch
  (``ForwardBatch.index_selection``); a pipeline stage must therefore begin at a full layer.
- **MLP kinds by layer.** ``mlp_layer_types[i]`` (``"dense"`` or ``"sparse"``) decides each
  layer's MLP; transformers derives it from ``first_k_dense_replace`` only when the config
  leaves it out.

The attention itself (query LoRA, ``kv_b_proj`` of ``qk_nope_head_dim + v_head_dim`` rows per
head, interleaved RoPE, the YaRN-scaled ``(N + r)^-0.5``) is V3.2's; the router is V3's grouped
sigmoid one with ``n_group``/``topk_group`` (GLM-5: one group). The MTP layer past
``num_hidden_layers`` is set aside at load; ``--speculative-algorithm MTP`` runs V3's layer
(``models/deepseek_mtp.py``), which does not know the indexer's interleaved RoPE.
"""

from __future__ import annotations

from typing import Optional

from pdserve.forward_batch import ForwardBatch
from pdserve.layers.rotary import rotate_interleaved
from pdserve.models.deepseek import (
    DeepseekDecoderLayer,
    DeepseekModel,
    DeepseekV32ForCausalLM,
    Indexer,
    MLAttention,
)

INDEXER_TYPES = ("full", "shared")


class GlmIndexer(Indexer):
    rotate = staticmethod(rotate_interleaved)


class GlmAttention(MLAttention):
    """Latent attention whose layer runs its own indexer (a full layer) or reuses the selection
    of the last full layer before it (a shared layer: no indexer, no index-key cache)."""

    @staticmethod
    def make_indexer(config, layer_id: int) -> Optional[Indexer]:
        return GlmIndexer(config) if config.indexer_types[layer_id] == "full" else None

    def select(self, h, q_resid, rope, fb: ForwardBatch):
        if self.indexer is not None:
            fb.index_selection = super().select(h, q_resid, rope, fb)
        # a stage begins at a full layer (GlmMoeDsaForCausalLM), which ran before this one
        assert fb.index_selection is not None, f"layer {self.layer_id}: no full layer before it"
        return fb.index_selection


class GlmDecoderLayer(DeepseekDecoderLayer):
    attn_cls = GlmAttention


class GlmModel(DeepseekModel):
    layer_cls = GlmDecoderLayer


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    model_cls = GlmModel

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        start = self.model.start
        if config.indexer_types[start] == "shared":
            full = max(i for i in range(start) if config.indexer_types[i] == "full")
            raise ValueError(
                f"pp_size: {self.par.pp_size} stages put layer {start} first on stage "
                f"{self.par.pp_rank}, and it reuses the top-k of layer {full} on an earlier stage "
                "(indexer_types); choose a pp_size whose stages begin at full indexer layers"
            )

    @classmethod
    def check_config(cls, config) -> None:
        """Refuse an ``indexer_types`` it cannot serve (transformers checks ``mlp_layer_types``
        as it builds the config, ``indexer_types`` only when a shared layer finds no top-k)."""
        super().check_config(config)
        kinds = list(getattr(config, "indexer_types", None) or [])
        if len(kinds) != config.num_hidden_layers:
            raise ValueError(
                f"indexer_types: {len(kinds)} entries for {config.num_hidden_layers} layers"
            )
        bad = sorted(set(kinds) - set(INDEXER_TYPES))
        if bad:
            raise ValueError(
                f"indexer_types: {bad} not supported; supported: {', '.join(INDEXER_TYPES)}"
            )
        if kinds[0] != "full":
            raise ValueError(
                "indexer_types: layer 0 is 'shared', but a shared layer reuses the top-k of a "
                "full layer before it"
            )

    def is_sparse(self, config, layer_id: int) -> bool:
        return self.num_experts(config) > 0 and config.mlp_layer_types[layer_id] == "sparse"
