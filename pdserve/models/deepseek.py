"""DeepSeek-V2 / V2-Lite and DeepSeek-V3 (and R1): latent attention (MLA) and grouped expert
routing, whole or as one tensor-parallel rank.

**Attention (MLA).** A token's query is ``q_proj(h)`` (or ``q_b_proj(norm(q_a_proj(h)))`` with
``q_lora_rank``), per head ``[q_nope (N) | q_rope (r)]``. Its key and value come from one
compressed latent: ``kv_a_proj_with_mqa(h) = [c (R) | k_rope (r)]``, ``c`` normalised
(``kv_a_layernorm``), ``k_rope`` rotated and shared by every head; the cache keeps ``[c | k_rope]``,
R + r values per token per layer (576 at DeepSeek-V3's sizes) and no head axis
(``kv_spec.LatentAttention``, ``engine/kv_pool.LatentPool``). Head h's key is ``[W_kc[h] c |
k_rope]`` and its value ``W_vc[h] c`` (``kv_b_proj`` holds W_kc and W_vc of every head); the
attention backend attends in the decompressed or absorbed form
(``AttentionBackend.forward_latent``). RoPE rotates interleaved pairs (V2; V3 with
``rope_interleave``, its default) or halves (V3 without). The scale is ``(N + r)^-0.5``, times
YaRN's ``mscale_all_dim`` factor squared.

**Tensor parallelism.** The query heads (``q_proj``/``q_b_proj`` rows, ``kv_b_proj`` rows,
``o_proj`` columns) are split over the attention group; the latent path (``q_a_proj``,
``kv_a_proj_with_mqa``, their norms) is replicated, so every rank caches the same latent, and in
PD a decode rank reads it from one prefill rank (a ``replicated`` transfer region).

**MoE.** Layers ``>= first_k_dense_replace`` are sparse: ``n_routed_experts`` experts of
``moe_intermediate_size`` plus ``n_shared_experts`` shared ones (one MLP of
``moe_intermediate_size * n_shared_experts``, added with weight 1); the others are dense MLPs of
``intermediate_size``. Routing (``layers/moe/router.py``): V2 softmax with ``greedy`` or
``group_limited_greedy``; V3 grouped sigmoid with ``e_score_correction_bias``. Top-k ties go to
the lowest expert id. Checkpoint names are HF's (``mlp.experts.E.{gate,up,down}_proj``,
``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``, ``mlp.shared_experts.*``). The MTP
layers a V3 checkpoint carries past ``num_hidden_layers`` are set aside (``mtp_weights``: their
names and shapes); ``--speculative-algorithm MTP`` serves them (``models/deepseek_mtp.py``).

What pdserve does not implement is refused at load, naming the field: another ``scoring_func``
or ``topk_method``, FP8 block-quantized weights (``quantization_config``).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import torch
from torch import nn

from pdserve.distributed import shard_range
from pdserve.forward_batch import ForwardBatch
from pdserve.kv_spec import CacheSpec, IndexKeys, LatentAttention
from pdserve.layers.attention.base import AttnLayer
from pdserve.layers.linear import Float32Linear, Linear, RowParallelLinear
from pdserve.layers.moe.router import (
    GroupedSigmoidTopK,
    GroupedSoftmaxSumTopK,
    GroupedSoftmaxTopK,
    Router,
)
from pdserve.layers.norm import RMSNorm
from pdserve.layers.rotary import apply_rotary, rope_parameters, rotate_interleaved
from pdserve.models.decoder import PRE_NORM, DecoderLayer
from pdserve.models.llama import LlamaModel
from pdserve.models.moe import MoEForCausalLM
from pdserve.models.weights import MATRIX_KINDS, TPShards, with_scales
from pdserve.quantization.registry import supported_methods

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: HF builds them with the default eps


def yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def refuse_unsupported(config, model: str, scoring: str, topk_methods: tuple[str, ...]) -> None:
    """Refuse, naming the field, what this implementation does not compute: quantized weights,
    another expert scoring function or top-k method (a field the config leaves out is HF's
    default, which is what pdserve computes)."""
    quant = getattr(config, "quantization_config", None)
    method = (
        (
            quant.get("quant_method")
            if isinstance(quant, dict)
            else getattr(quant, "quant_method", quant)
        )
        if quant
        else None
    )
    if quant and method not in supported_methods():  # the weight formats of quantization/
        raise ValueError(
            f"quantization_config: {method!r} weights are not supported for {model}; supported: "
            f"{', '.join(supported_methods())} or a bf16 / float32 checkpoint"
        )
    value = getattr(config, "scoring_func", None)
    if value is not None and value != scoring:
        raise ValueError(
            f"scoring_func: {value!r} is not supported for {model} (it scores experts with "
            f"{scoring!r})"
        )
    value = getattr(config, "topk_method", None)
    if value is not None and value not in topk_methods:
        raise ValueError(
            f"topk_method: {value!r} is not supported for {model}; supported: "
            f"{', '.join(topk_methods)}"
        )


def set_aside_mtp(
    weights: Iterable[tuple[str, Any]], num_layers: int, store: dict
) -> Iterable[tuple[str, Any]]:
    """``weights`` without the MTP layers (``model.layers.N``, N >= ``num_layers``), whose names
    and shapes go into ``store`` (not read: ``--speculative-algorithm MTP`` loads them into a
    model of their own, ``models/deepseek_mtp.py``)."""
    for name, src in weights:
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= num_layers:
            store[name] = tuple(src.shape) if hasattr(src, "shape") else tuple(src.get_shape())
            continue
        yield name, src


class UpProjection(nn.Module):
    """``kv_b_proj``'s weight [H * (N + V), R] of this rank's heads, used as per-head matrices
    (never as one matmul, so it is not a ``Linear`` that prepacking would replace). An FP8
    checkpoint's is dequantized as it loads (``fp8_dequantized``): 0.15 % of DeepSeek-V3's
    weights."""

    fp8_dequantized = True

    def __init__(self, rows: int, rank: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, rank))


class Indexer(nn.Module):
    """DeepSeek-V3.2's lightning indexer: which earlier tokens each query attends to. Its key (one
    head of ``index_head_dim``) is cached with the latent (``index_k``); its queries
    (``index_n_heads``) come from the attention's ``q_lora`` output. Both get half-split RoPE on
    their first ``qk_rope_head_dim`` dims. Key t scores ``sum_h w_h relu(q_h . k_t / sqrt(D))``
    with ``w = weights_proj(x) / sqrt(H)`` (float32, as HF keeps ``weights_proj``); the
    ``index_topk`` best are kept, ties to the lowest position (``AttentionBackend.index_select``).
    Replicated over TP ranks, so every rank selects the same keys."""

    rotate = staticmethod(apply_rotary)  # how its RoPE turns the first dims: by halves

    def __init__(self, config):
        super().__init__()
        self.heads, self.dim = config.index_n_heads, config.index_head_dim
        self.rope, self.topk = config.qk_rope_head_dim, config.index_topk
        if self.rope > self.dim:
            raise ValueError(
                f"index_head_dim: {self.dim} is smaller than qk_rope_head_dim {self.rope}"
            )
        self.wq_b = Linear(config.q_lora_rank, self.heads * self.dim, bias=False)
        self.wk = Linear(config.hidden_size, self.dim, bias=False)
        self.k_norm = nn.LayerNorm(self.dim, eps=1e-6)
        self.weights_proj = Float32Linear(config.hidden_size, self.heads)

    def forward(
        self, h: torch.Tensor, q_resid: torch.Tensor, rope, fb: ForwardBatch, layer: AttnLayer
    ):
        t, r = h.shape[0], self.rope
        q = self.wq_b(q_resid).view(t, self.heads, self.dim)
        k = self.k_norm(self.wk(h))
        q = torch.cat([self.rotate(q[..., :r], *rope), q[..., r:]], dim=-1)
        k = torch.cat([self.rotate(k[:, None, :r], *rope)[:, 0], k[:, r:]], dim=-1)
        w = self.weights_proj(h) * self.heads**-0.5
        return fb.attn_backend.index_select(layer, q.float(), w, k, fb, self.topk, self.dim**-0.5)


class MLAttention(nn.Module):
    """Latent attention of one layer; loads and shards its own weights."""

    def __init__(
        self,
        config,
        layer_id: int,
        shards: TPShards,
        interleave: bool = True,
        query_scale: Optional[tuple[float, int]] = None,
    ):
        super().__init__()
        self.layer_id = layer_id
        # (beta, original context): queries scaled by 1 + beta * log(1 + floor(pos / original))
        # (Mistral 4's Llama-4 attention scaling)
        self.query_scale = query_scale
        self.tp = shards.attn
        h0, h1 = shard_range(config.num_attention_heads, self.tp.rank, self.tp.size)
        self.heads = (h0, h1)
        self.num_heads = h1 - h0  # this rank's
        self.num_kv_heads = 0  # no KV heads: one latent per token
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.rank = config.v_head_dim, config.kv_lora_rank
        self.q_lora = getattr(config, "q_lora_rank", None)
        self.head_dim = self.rotary_dim = self.rope  # what the model's rotary table is built for
        self.interleave = interleave
        params = rope_parameters(config)
        scale = (self.nope + self.rope) ** -0.5
        if params["rope_type"] != "default" and params.get("mscale_all_dim"):
            scale *= yarn_mscale(params["factor"], params["mscale_all_dim"]) ** 2
        self.scale = scale
        self.attn = AttnLayer(layer_id - shards.layers[0], scale)
        bias = bool(getattr(config, "attention_bias", False))
        hidden, qk = config.hidden_size, self.nope + self.rope
        if self.q_lora:
            self.q_a_proj = Linear(hidden, self.q_lora, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora, LATENT_NORM_EPS)
            self.q_b_proj = Linear(self.q_lora, self.num_heads * qk, bias=False)
        else:
            self.q_proj = Linear(hidden, self.num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = UpProjection(self.num_heads * (self.nope + self.v_dim), self.rank)
        self.o_proj = RowParallelLinear(self.num_heads * self.v_dim, hidden, bias=bias, tp=self.tp)
        self.indexer = self.make_indexer(config, layer_id)

    @staticmethod
    def make_indexer(config, layer_id: int) -> Optional[Indexer]:
        return Indexer(config) if getattr(config, "index_topk", None) else None

    def select(self, h, q_resid, rope, fb: ForwardBatch):
        """The keys each new token attends to (``AttentionBackend.index_select``), None: all."""
        return None if self.indexer is None else self.indexer(h, q_resid, rope, fb, self.attn)

    @property
    def cache_specs(self) -> tuple[CacheSpec, ...]:
        """The latent, and with the indexer its keys: two caches of this layer, two groups."""
        latent = LatentAttention(self.rank, self.rope)
        return (latent,) if self.indexer is None else (latent, IndexKeys(self.indexer.dim))

    def forward(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], fb: ForwardBatch
    ) -> torch.Tensor:
        t = h.shape[0]
        q_resid = self.q_a_layernorm(self.q_a_proj(h)) if self.q_lora else None
        q = self.q_b_proj(q_resid) if self.q_lora else self.q_proj(h)
        q = q.view(t, self.num_heads, self.nope + self.rope)
        q_nope, q_rope = q[..., : self.nope], q[..., self.nope :]
        ckv = self.kv_a_proj_with_mqa(h)
        c, k_rope = self.kv_a_layernorm(ckv[:, : self.rank].contiguous()), ckv[:, self.rank :]
        rope = tuple(x.to(h.dtype) for x in rope)
        q_rope, k_rope = self.rotate(q_rope, k_rope, rope)
        if self.query_scale is not None:
            beta, original = self.query_scale
            pos = fb.positions.to(torch.float32)
            scale = (1 + beta * torch.log(1 + torch.floor(pos / original))).to(q_nope.dtype)
            q_nope, q_rope = q_nope * scale[:, None, None], q_rope * scale[:, None, None]
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        selection = self.select(h, q_resid, rope, fb)
        o = fb.attn_backend.forward_latent(
            self.attn,
            q_nope,
            q_rope,
            torch.cat([c, k_rope], dim=-1),
            fb,
            w[:, : self.nope],
            w[:, self.nope :],
            selection,
        )
        return self.o_proj(o.reshape(t, self.num_heads * self.v_dim))

    def rotate(self, q_rope: torch.Tensor, k_rope: torch.Tensor, rope) -> tuple[torch.Tensor, ...]:
        """The queries' rotary parts [T, heads, r] and the shared key's [T, r], turned."""
        rotate = rotate_interleaved if self.interleave else apply_rotary
        return rotate(q_rope, *rope), rotate(k_rope.unsqueeze(1), *rope)[:, 0]

    # ---- weights -----------------------------------------------------------------------------
    def checkpoint_names(self) -> list[str]:
        q = (
            ["q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"]
            if self.q_lora
            else ["q_proj.weight"]
        )
        names = q + [
            "kv_a_proj_with_mqa.weight",
            "kv_a_layernorm.weight",
            "kv_b_proj.weight",
            "o_proj.weight",
        ]
        if self.o_proj.bias is not None:
            names += ["kv_a_proj_with_mqa.bias", "o_proj.bias"] + (
                ["q_a_proj.bias"] if self.q_lora else []
            )
        if self.indexer is not None:
            names += [
                f"indexer.{n}"
                for n in (
                    "wq_b.weight",
                    "wk.weight",
                    "k_norm.weight",
                    "k_norm.bias",
                    "weights_proj.weight",
                )
            ]
        return with_scales(self, names)

    def load_checkpoint(self, name: str, src: Any) -> None:
        if name not in self.checkpoint_names():
            raise ValueError(f"unexpected latent attention weight {name!r}")
        module = name.partition(".")[0]
        path, _, leaf = name.rpartition(".")
        h0, h1 = self.heads
        if module in ("q_proj", "q_b_proj"):  # this rank's heads' rows
            qk = self.nope + self.rope
            t = src[h0 * qk : h1 * qk]
        elif module == "kv_b_proj":
            per = self.nope + self.v_dim
            t = src[h0 * per : h1 * per]
        elif (
            module == "o_proj" and leaf in MATRIX_KINDS
        ):  # row parallel: this rank's heads' columns
            t = src[:, h0 * self.v_dim : h1 * self.v_dim]
        else:  # the latent path, the indexer and biases: whole on every rank
            t = src[:]
        target = getattr(self.get_submodule(path), leaf).data
        if target.shape != t.shape:
            raise ValueError(f"expected shape {tuple(target.shape)}, got {tuple(t.shape)}")
        target.copy_(t)


class DeepseekDecoderLayer(DecoderLayer):
    """Pre-norm block of latent attention and a dense or sparse MLP (``make_mlp``)."""

    attn_cls = MLAttention

    def __init__(
        self,
        config,
        layer_id: int,
        shards: TPShards,
        make_mlp=None,
        interleave: bool = True,
        query_scale=None,
        **_,
    ):
        super().__init__(
            self.attn_cls(config, layer_id, shards, interleave, query_scale),
            make_mlp(config, layer_id, shards),
            PRE_NORM,
            lambda: RMSNorm(config.hidden_size, config.rms_norm_eps),
        )


class DeepseekModel(LlamaModel):
    layer_cls = DeepseekDecoderLayer


class DeepseekMoE(MoEForCausalLM):
    """DeepSeek's MoE layout, shared by V2, V3 and GLM-4.5: layers from ``first_k_dense_replace``
    on are sparse (``n_routed_experts``), with ``n_shared_experts`` shared ones as one MLP; the
    MTP layers past ``num_hidden_layers`` are set aside; the routing fields this implementation
    lacks are refused (``SCORING``, ``TOPK_METHODS``)."""

    shared_name = "shared_experts"
    SCORING = "softmax"
    TOPK_METHODS: tuple[str, ...] = ()

    def __init__(self, config, *args, **kwargs):
        self.check_config(config)
        super().__init__(config, *args, **kwargs)
        self.mtp_weights: dict[str, tuple] = {}  # name -> shape

    @classmethod
    def check_config(cls, config) -> None:
        refuse_unsupported(config, cls.__name__, cls.SCORING, cls.TOPK_METHODS)

    @staticmethod
    def num_experts(config) -> int:
        return config.n_routed_experts or 0

    def is_sparse(self, config, layer_id: int) -> bool:
        return self.num_experts(config) > 0 and layer_id >= config.first_k_dense_replace

    def make_shared(self, config, layer_id, tp):
        from pdserve.layers.mlp import GatedMLP

        n = getattr(config, "n_shared_experts", 0) or 0
        if not n:
            return None, None
        return GatedMLP(
            config.hidden_size, config.moe_intermediate_size * n, config.hidden_act, tp
        ), None

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights(set_aside_mtp(weights, self.total_layers, self.mtp_weights))


def sigmoid_router(config) -> Router:
    """DeepSeek-V3's routing (``noaux_tc``), GLM-4.5's too."""
    return GroupedSigmoidTopK.of(config)


class DeepseekV2ForCausalLM(DeepseekMoE):
    model_cls = DeepseekModel
    TOPK_METHODS = GroupedSoftmaxTopK.METHODS

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.total_kv_heads = (
            1  # one latent per token, the same on every rank (no KV heads to split)
        )

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        if getattr(config, "kv_lora_rank", None) is None:
            raise ValueError("kv_lora_rank: missing; latent attention needs it")

    def make_router(self, config) -> Router:
        return GroupedSoftmaxTopK(
            config.hidden_size,
            config.n_routed_experts,
            config.num_experts_per_tok,
            getattr(config, "topk_method", "greedy") or "greedy",
            config.n_group or 1,
            config.topk_group or 1,
            config.routed_scaling_factor,
        )

    @staticmethod
    def rope_interleave(config) -> bool:
        return True  # V2 rotates interleaved pairs, always

    def layer_options(self, config) -> dict:
        self.moe_context(config)
        return {"make_mlp": self.make_mlp, "interleave": self.rope_interleave(config)}

    def kv_cache_specs(self) -> list[CacheSpec]:
        return [layer.self_attn.cache_specs for layer in self.model.own_layers]

    def prepack(self, ops, quantization=None, batch_invariant: bool = False) -> int:
        total = super().prepack(ops, quantization, batch_invariant)
        return total + sum(
            m.prepack(ops, batch_invariant) for m in self.modules() if isinstance(m, Float32Linear)
        )

    def enable_decode_stack(self, ops, batch_invariant: bool = False) -> bool:
        return False  # the C++ decode stack is the Llama block


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    SCORING = "sigmoid"
    TOPK_METHODS = ("noaux_tc",)  # grouped sigmoid scores and a correction bias

    @staticmethod
    def rope_interleave(config) -> bool:
        return bool(getattr(config, "rope_interleave", True))

    def make_router(self, config) -> Router:
        return sigmoid_router(config)


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2: V3 with the sparse-attention indexer on every layer (``Indexer``)."""

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        for field in ("index_topk", "index_head_dim", "index_n_heads", "q_lora_rank"):
            if not getattr(config, field, None):
                raise ValueError(f"{field}: missing; DeepSeek-V3.2's indexer needs it")
        kinds = set(getattr(config, "layer_types", None) or ["indexed_attention"])
        if kinds != {"indexed_attention"}:
            raise ValueError(
                f"layer_types: {sorted(kinds)} not supported; supported: indexed_attention"
            )

    @staticmethod
    def rope_interleave(config) -> bool:
        return True  # V3.2's attention rotates interleaved pairs (its indexer, halves)


class Mistral4ForCausalLM(DeepseekV3ForCausalLM):
    """Mistral 4 (``Mistral4ForCausalLM``): DeepSeek-V3's latent attention and MoE layout, with
    softmax expert scores in the model's dtype (groups by the sum of their two best, no
    correction bias: ``GroupedSoftmaxSumTopK``), the queries scaled by position past the
    original context (``llama_4_scaling_beta``), and the experts as transformers saves them: 3-D
    ``gate_up_proj`` [E, 2I, H] (gate then up) and ``down_proj`` [E, H, I]."""

    SCORING = "softmax"
    TOPK_METHODS = ()
    expert_format = "fused"

    def make_router(self, config) -> Router:
        return GroupedSoftmaxSumTopK.of(config)

    def layer_options(self, config) -> dict:
        params = getattr(config, "rope_parameters", None) or {}
        beta = params.get("llama_4_scaling_beta")
        scale = None
        if beta is not None:
            original = params.get("original_max_position_embeddings")
            if not original:
                raise ValueError(
                    "rope_parameters: llama_4_scaling_beta needs original_max_position_embeddings"
                )
            scale = (float(beta), int(original))
        return {**super().layer_options(config), "query_scale": scale}
