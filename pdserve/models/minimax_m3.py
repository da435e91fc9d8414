"""MiniMax M3's text model (``MiniMaxM3VLForCausalLM``; published inside
``MiniMaxM3SparseForConditionalGeneration``, whose text model ``models/multimodal.py`` serves),
as HF transformers computes it:

- **Attention.** GQA with per-head q/k norms and RoPE by halves on the first
  ``partial_rotary_factor`` of each head (``rope_parameters``; transformers reads that, not the
  config's ``rotary_dim``). On the layers ``layer_types`` marks ``minimax_m3_sparse`` a block
  indexer (``layers/block_indexer.py``) chooses per KV head the blocks of ``index_block_size``
  keys its query heads attend to (causally inside): the ``index_local_blocks`` ending at the
  query's own block and the best-scoring ones up to ``index_topk_blocks``
  (``attention/block_select.py``). Those layers keep the indexer's key per token as a second
  cache (``kv_spec.IndexKeys``: the ``index_keys`` group holds the sparse layers only, so PD moves
  index keys for them alone); ``full_attention`` layers attend to every earlier key.
- **Norms.** Every RMSNorm is Gemma's: float32, times ``(1 + weight)``, rounded once.
- **MLPs** by ``mlp_layer_types``: ``dense`` is one MLP of ``dense_intermediate_size``;
  ``sparse`` is ``num_local_experts`` experts of ``intermediate_size`` routed by sigmoid scores
  (the selection adds ``e_score_correction_bias``; the chosen scores renormalised, their sum times
  ``routed_scaling_factor``) plus a shared expert of ``shared_intermediate_size`` added with
  weight 1. All use the clamped SwiGLU ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)`` (gate
  clamped above at ``swiglu_limit``, up to +-``swiglu_limit``).

Checkpoints in either naming are read: as transformers saves the text model (``gate_up_proj``
fused, experts stacked as 3-D ``gate_up_proj`` / ``down_proj``, ``self_attn.indexer.*``) and as
MiniMax publishes it (``block_sparse_moe.experts.E.w1/w2/w3``, ``gate_proj`` / ``up_proj``,
``self_attn.index_q_proj`` ...); the multi-token-prediction modules are set aside. Quantized
checkpoints are refused at load, as are an indexer with other than one head per KV head and
fewer top-k blocks than local ones (whose choice HF leaves to ``torch.topk``'s tie order).
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from typing import Any, Iterable, Iterator

import torch

from pdserve.distributed import SINGLE
from pdserve.kv_spec import CacheSpec, FullAttention, IndexKeys
from pdserve.layers.block_indexer import BlockIndexer
from pdserve.layers.mlp import GatedMLP
from pdserve.layers.moe.router import Router
from pdserve.layers.norm import GemmaRMSNorm
from pdserve.models.glm import rotary_fraction
from pdserve.models.llama import LlamaAttention
from pdserve.models.minimax_m2 import MiniMaxRouter
from pdserve.models.moe import LocalExperts, MoEDecoderLayer, MoEForCausalLM, MoEModel
from pdserve.models.weights import RowSection

logger = logging.getLogger(__name__)

ATTENTION_TYPES = ("full_attention", "minimax_m3_sparse")
MLP_TYPES = ("dense", "sparse")
# the published checkpoint's names -> transformers' (which this model reads)
PUBLISHED_NAMES = (
    (
        re.compile(r"\.block_sparse_moe\.e_score_correction_bias$"),
        ".mlp.gate.e_score_correction_bias",
    ),
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"\.self_attn\.index_(q|k)_(proj|norm)\."), r".self_attn.indexer.\1_\2."),
)
MTP = re.compile(r"(^|\.)mtp\.")


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class ClampedSwiGLU(GatedMLP):
    """A ``GatedMLP`` (sharded, self-loading) with the clamped SwiGLU of M3's MLPs."""

    def __init__(self, hidden: int, intermediate: int, config, tp=SINGLE):
        super().__init__(hidden, intermediate, "silu", tp)
        self.alpha, self.limit = float(config.swiglu_alpha), float(config.swiglu_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(swiglu_oai(gate, up, self.alpha, self.limit))


class M3Attention(LlamaAttention):
    """``LlamaAttention`` (Gemma q/k norms, partial RoPE) whose sparse layers attend through the
    block indexer's per-KV-head key mask."""

    def __init__(self, config, layer_id, shards, **kwargs):
        super().__init__(config, layer_id, shards, **kwargs)
        self.kv_heads = shards.kv_heads  # [start, end) of this rank's, among the model's
        sparse = config.layer_types[layer_id] == "minimax_m3_sparse"
        self.indexer = BlockIndexer(config) if sparse else None
        self.attn = replace(self.attn, key_masked=sparse)

    @property
    def cache_specs(self) -> tuple[CacheSpec, ...]:
        kv = FullAttention(self.num_kv_heads, self.head_dim)
        return (kv,) if self.indexer is None else (kv, IndexKeys(self.indexer.dim))

    def forward(self, h: torch.Tensor, rope, fb) -> torch.Tensor:
        t = h.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(h))
        q = self.q_norm(q.view(t, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
        q, k = self.rotate(q, k, rope)
        mask = None
        if self.indexer is not None:
            mask = self.indexer(h, rope, fb, self.attn).heads(*self.kv_heads)
        o = fb.attn_backend.forward(
            self.attn, q, k, v.view(t, self.num_kv_heads, self.head_dim), fb, key_mask=mask
        )
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class M3DecoderLayer(MoEDecoderLayer):
    attn_cls = M3Attention
    norm_cls = GemmaRMSNorm


class M3Model(MoEModel):
    layer_cls = M3DecoderLayer
    norm_cls = GemmaRMSNorm


def check_config(config) -> None:
    """Refuse, naming the field, what this implementation does not compute."""
    quant = getattr(config, "quantization_config", None)
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ValueError(
            f"quantization_config: {method!r} weights are not supported for MiniMax M3; "
            "supported: a bf16 or float32 checkpoint"
        )
    n = config.num_hidden_layers
    for field, kinds in (("layer_types", ATTENTION_TYPES), ("mlp_layer_types", MLP_TYPES)):
        values = list(getattr(config, field, None) or [])
        if len(values) != n:
            raise ValueError(f"{field}: {len(values)} entries for {n} layers")
        bad = sorted(set(values) - set(kinds))
        if bad:
            raise ValueError(f"{field}: {bad} not supported; supported: {', '.join(kinds)}")
    if "minimax_m3_sparse" not in config.layer_types:
        return
    if config.index_n_heads != config.num_key_value_heads:
        raise ValueError(
            f"index_n_heads: {config.index_n_heads}; the indexer chooses blocks per KV head, so "
            f"it must equal num_key_value_heads ({config.num_key_value_heads})"
        )
    if config.index_block_size < 1 or config.index_topk_blocks < 1:
        raise ValueError(
            f"index_block_size and index_topk_blocks must be >= 1, got "
            f"{config.index_block_size} and {config.index_topk_blocks}"
        )
    if not 0 <= config.index_local_blocks <= config.index_topk_blocks:
        raise ValueError(
            f"index_local_blocks: {config.index_local_blocks} must be in [0, index_topk_blocks = "
            f"{config.index_topk_blocks}] (which local blocks HF keeps beyond the top k is "
            "torch.topk's tie order)"
        )


def canonical_weights(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors under the names this model reads: the published names renamed,
    fused gate/up rows and stacked experts handed out as their parts (read when indexed), the
    multi-token-prediction modules set aside."""
    skipped = 0
    for name, src in weights:
        if MTP.search(name):
            skipped += 1
            continue
        for pattern, repl in PUBLISHED_NAMES:
            name = pattern.sub(repl, name)
        shape = tuple(src.shape) if isinstance(src, torch.Tensor) else tuple(src.get_shape())
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):  # [E, 2I, H] / [E, H, I]
            base, proj = name.rsplit(".", 1)
            for e in range(shape[0]):
                t = src[e : e + 1][0]
                if proj == "down_proj":
                    yield f"{base}.{e}.w2.weight", t
                else:
                    yield f"{base}.{e}.w1.weight", t[: shape[1] // 2]
                    yield f"{base}.{e}.w3.weight", t[shape[1] // 2 :]
        elif name.endswith(".gate_up_proj.weight"):  # [2I, H]: gate rows, then up rows
            base, half = name[: -len("gate_up_proj.weight")], shape[0] // 2
            yield base + "gate_proj.weight", RowSection(src, 0, half)
            yield base + "up_proj.weight", RowSection(src, half, 2 * half)
        else:
            yield name, src
    if skipped:
        logger.info("MiniMax M3: %d multi-token-prediction tensors set aside", skipped)


class MiniMaxM3VLForCausalLM(LocalExperts, MoEForCausalLM):
    model_cls = M3Model
    norm_cls = GemmaRMSNorm
    qk_norm = "head"
    expert_format = "mixtral"  # the experts' names after ``canonical_weights``
    shared_name = "shared_experts"

    def __init__(self, config, *args, **kwargs):
        check_config(config)
        super().__init__(config, *args, **kwargs)

    def is_sparse(self, config, layer_id: int) -> bool:
        return config.mlp_layer_types[layer_id] == "sparse"

    def attention_options(self, config) -> dict:
        return {
            **super().attention_options(config),
            "norm": GemmaRMSNorm,
            "rotary_fraction": rotary_fraction(config),
        }

    def make_router(self, config) -> Router:
        # one group: the grouped sigmoid router's selection is then a plain biased top-k
        n, k = config.num_local_experts, config.num_experts_per_tok
        return MiniMaxRouter(config.hidden_size, n, k, 1, 1, True, config.routed_scaling_factor)

    def make_shared(self, config, layer_id, tp):
        size = config.shared_intermediate_size
        return ClampedSwiGLU(config.hidden_size, size, config, tp), None

    def make_mlp(self, config, layer_id: int, shards) -> torch.nn.Module:
        if self.is_sparse(config, layer_id):
            return super().make_mlp(config, layer_id, shards)
        tp = SINGLE if self._moe_ctx.options.dense_tp_size == 1 else shards.tp
        return ClampedSwiGLU(config.hidden_size, config.dense_intermediate_size, config, tp)

    def expert_options(self, config) -> dict:
        return dict(
            activation="swiglu_oai",
            alpha=float(config.swiglu_alpha),
            limit=float(config.swiglu_limit),
        )

    def kv_cache_specs(self) -> list:
        return [layer.self_attn.cache_specs for layer in self.model.own_layers]

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights(canonical_weights(weights))
