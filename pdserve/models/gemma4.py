"""Gemma 4 text (``Gemma4ForCausalLM``), whole or as one tensor-parallel rank, as HF transformers
computes it:

- layers of two kinds by ``config.layer_types``: sliding-window (``sliding_window``) and full
  attention, each kind with its own ``head_dim`` and KV heads (the configuration's per-layer
  view: a full layer's are ``global_head_dim`` and, with ``attention_k_eq_v``,
  ``num_global_key_value_heads``) and its own RoPE (``rope_parameters`` per kind; the full
  layers' ``proportional`` one turns a quarter of the dims): two cache groups;
- attention (``gemma4_attention.py``) of scale 1; q and k normalised per head (Gemma 4's RMSNorm,
  ``layers/norm.py``: the weight as it is, in float32), v by an RMSNorm without weight; RoPE on q
  and k;
- ``attention_k_eq_v``: a full layer has no ``v_proj``; its values are the key projection,
  normalised as values (no weight, no RoPE), so keys and values still differ and the cache keeps
  both (``FullAttention``);
- ``num_kv_shared_layers``: the last layers keep no cache and compute no keys; each attends over
  the cache of the last earlier layer of its kind (its ``AttnLayer`` names that layer and does
  not store); their spec is None: no pages, nothing for PD to move; with ``use_double_wide_mlp``
  their MLP is twice ``intermediate_size``;
- per-layer inputs (``hidden_size_per_layer_input`` P > 0): a second embedding
  (``embed_tokens_per_layer``, [vocab, layers * P], times sqrt(P)) plus a projection of the
  embeddings (``per_layer_model_projection`` times hidden**-0.5, then a P-wide norm), their sum
  times 2**-0.5; each layer ends with ``x + norm(W_up(gelu(W_gate(x)) * input_i))``;
- four norms around attention and MLP (Gemma's sandwich), the MoE block beside the MLP with
  ``enable_moe_block`` (``gemma4_moe.py``), each layer's output times its ``layer_scalar``;
- the embedding times sqrt(hidden) rounded to the weight's dtype, tied LM head, final logits
  soft-capped (``final_logit_softcapping``).

Tensor parallelism splits query heads, each kind's KV heads (replicated when fewer than the ranks)
and MLP columns; the per-layer embedding is split by vocabulary rows, its projections are
replicated. Between prefill and decode servers of different TP sizes every group's pages are
sliced by the largest kind's KV head count (``total_kv_heads``), which slices the other kind right
when each side's TP size splits its heads too (16 and 4 KV heads over 1, 2 or 4 ranks); where it
replicates them decode's registration is refused (its pages' size differs from the slice).
Pipeline stages are refused when the model has per-layer inputs or shared KV (both need the whole
stack on one stage). Quantized checkpoints are refused; ``Gemma4ForConditionalGeneration``
checkpoints serve their text model (``models/multimodal.py``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from pdserve.distributed import SINGLE, Parallel, TPGroup
from pdserve.forward_batch import ForwardBatch
from pdserve.kv_spec import CacheSpec, FullAttention, SlidingWindow
from pdserve.layers.linear import Linear
from pdserve.layers.mlp import ACTIVATIONS, GatedMLP
from pdserve.layers.norm import Gemma4RMSNorm
from pdserve.layers.rotary import rope_parameters, rotary_embedding
from pdserve.models.decoder import run_mlp
from pdserve.models.gemma import ScaledEmbedding
from pdserve.models.gemma4_attention import Gemma4Attention, kv_sources, layer_config
from pdserve.models.gemma4_moe import CHECKPOINT_RENAMES, Gemma4Router, check_moe_config
from pdserve.models.llama import LlamaModel, check_layer_types
from pdserve.models.moe import MoEForCausalLM
from pdserve.models.weights import TPShards

_ROPE_INITIAL_POSITIONS = 8192


class PerLayerEmbedding(ScaledEmbedding):
    """``embed_tokens_per_layer``: rows times sqrt(P), split by vocabulary rows over ``tp`` (the
    ranks' rows summed); it loads its own rows of the checkpoint's table."""

    def __init__(self, vocab: int, width: int, per_layer: int, tp: TPGroup):
        rows = -(-vocab // tp.size)
        super().__init__(rows, width, tp.rank * rows, tp)
        self.scale, self.vocab = per_layer**0.5, vocab

    def checkpoint_names(self) -> list[str]:
        return ["weight"]

    def load_checkpoint(self, name: str, src: Any) -> None:
        if name != "weight":
            raise ValueError(f"unexpected weight {name!r}")
        rows = self.weight.shape[0]
        part = src[self.start : min(self.start + rows, self.vocab)]
        if tuple(part.shape[1:]) != tuple(self.weight.shape[1:]):
            raise ValueError(
                f"weight: expected rows of {self.weight.shape[1]}, got {tuple(part.shape[1:])}"
            )
        self.weight.data.zero_()  # the last rank's padding rows
        self.weight.data[: part.shape[0]].copy_(part)


class Gemma4DecoderLayer(nn.Module):
    """Attention and MLP between Gemma's four norms, the MoE block beside the MLP (``make_moe``),
    the per-layer input, the output scalar. The stream is explicit: a layer takes and returns it
    whole (the scalar multiplies all of it)."""

    def __init__(
        self, config, layer_id: int, shards: TPShards, sources, make_moe=None, mlp_tp=SINGLE
    ):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        source = sources[layer_id]
        feeds = layer_id in sources
        self.self_attn = Gemma4Attention(config, layer_id, shards, source, feeds)
        self.rope_kind = self.self_attn.kind
        wide = 2 if config.use_double_wide_mlp and source is not None else 1
        self.mlp = GatedMLP(
            hidden, wide * config.intermediate_size, config.hidden_activation, mlp_tp
        )
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            setattr(self, name, Gemma4RMSNorm(hidden, eps))
        self.moe = make_moe(config, layer_id, shards) if make_moe is not None else None
        if self.moe is not None:
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
        self.dp_mlps = [self.mlp] + ([self.moe] if self.moe is not None else [])
        per_layer = config.hidden_size_per_layer_input or 0
        if per_layer:
            self.act = ACTIVATIONS[config.hidden_activation]
            self.per_layer_input_gate = Linear(hidden, per_layer, bias=False)
            self.per_layer_projection = Linear(per_layer, hidden, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))

    def forward(self, x, per_layer: Optional[torch.Tensor], rope, fb: ForwardBatch, stored: dict):
        a = self.self_attn(self.input_layernorm(x), rope, fb, stored)
        x = x + self.post_attention_layernorm(a)
        h = run_mlp(self.mlp, self.pre_feedforward_layernorm(x), fb)
        if self.moe is not None:  # the router and the experts read the stream itself
            moe = self.post_feedforward_layernorm_2(run_mlp(self.moe, x, fb))
            h = self.post_feedforward_layernorm_1(h) + moe
        x = x + self.post_feedforward_layernorm(h)
        if per_layer is not None:
            g = self.act(self.per_layer_input_gate(x)) * per_layer
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return x * self.layer_scalar


class Gemma4Model(LlamaModel):
    """The decoder; every layer's output is the whole stream (no residual is carried)."""

    layer_cls = Gemma4DecoderLayer
    norm_cls = Gemma4RMSNorm
    embedding_cls = ScaledEmbedding

    def __init__(self, config, shards: TPShards, **layer_options):
        super().__init__(config, shards, **layer_options)
        # RoPE per layer kind, over that kind's head_dim
        kinds = config.layer_types
        initial = min(config.max_position_embeddings, _ROPE_INITIAL_POSITIONS)
        self.rotaries = nn.ModuleDict(
            {
                kind: rotary_embedding(
                    layer_config(config, kinds.index(kind)).head_dim,
                    rope_parameters({"rope_parameters": config.rope_parameters[kind]}),
                    initial,
                )
                for kind in sorted(set(kinds))
            }
        )
        self.per_layer = config.hidden_size_per_layer_input or 0
        if self.per_layer:
            n, hidden = config.num_hidden_layers, config.hidden_size
            width = n * self.per_layer
            self.embed_tokens_per_layer = PerLayerEmbedding(
                config.vocab_size_per_layer_input, width, self.per_layer, shards.attn
            )
            self.per_layer_model_projection = Linear(hidden, width, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(self.per_layer, config.rms_norm_eps)

    def per_layer_inputs(self, ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[T, layers, P]: each token's input to each layer."""
        shape = (ids.shape[0], -1, self.per_layer)
        own = self.embed_tokens_per_layer(ids).view(shape)
        projected = self.per_layer_model_projection(embeds) * embeds.shape[-1] ** -0.5
        return (self.per_layer_projection_norm(projected.view(shape)) + own) * 2.0**-0.5

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        h, _ = self.forward_layers(fb, self.embed_tokens(fb.input_ids), None)
        return self.norm(h)

    def forward_layers(self, fb: ForwardBatch, h: torch.Tensor, residual: Optional[torch.Tensor]):
        """This stage's layers over ``h`` (the embeddings on the first stage); ``residual`` is
        always None (each layer returns the whole stream)."""
        ple = self.per_layer_inputs(fb.input_ids, h) if self.per_layer else None
        # HF rounds the tables to the activations' dtype
        ropes = {k: tuple(t.to(h.dtype) for t in r.tables(fb)) for k, r in self.rotaries.items()}
        stored: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # keys and values layers share
        self.captured = {}
        for i, layer in enumerate(self.own_layers, self.start):
            h = layer(h, None if ple is None else ple[:, i], ropes[layer.rope_kind], fb, stored)
            if i in self.capture_layers:
                self.captured[i] = h
            if fb.layer_done is not None:
                fb.layer_done(i)
        return h, None


def check_config(config, par: Parallel) -> None:
    """What the HF configs allow but this implementation does not do."""
    if getattr(config, "quantization_config", None):
        raise ValueError("quantization_config: quantized Gemma 4 checkpoints are not supported")
    if config.use_bidirectional_attention == "all":
        raise ValueError("use_bidirectional_attention: 'all' is not supported; only causal text")
    check_layer_types(config)
    check_moe_config(config)
    per_layer = config.hidden_size_per_layer_input or 0
    if per_layer and config.vocab_size_per_layer_input < config.vocab_size:
        raise ValueError(
            f"vocab_size_per_layer_input: {config.vocab_size_per_layer_input} rows for a "
            f"vocabulary of {config.vocab_size}; every token needs its per-layer row"
        )
    if par.pp_size > 1 and (per_layer or config.num_kv_shared_layers):
        raise ValueError(
            f"pp_size: {par.pp_size}; a Gemma 4 model with per-layer inputs or shared KV layers "
            "runs on one pipeline stage (every layer reads the embeddings, the last ones the "
            "caches of earlier ones)"
        )


class Gemma4ForCausalLM(MoEForCausalLM):
    """``Gemma4ForCausalLM`` (the MoE facets of ``MoEForCausalLM`` used only with
    ``enable_moe_block``)."""

    model_cls = Gemma4Model
    expert_format = "fused"
    router_name = "router"
    checkpoint_renames = CHECKPOINT_RENAMES

    def __init__(self, config, tp: TPGroup = SINGLE, par: Optional[Parallel] = None, moe=None):
        nn.Module.__init__(self)
        par = Parallel(world=tp, tp=tp, attn=tp) if par is None else par
        check_config(config, par)
        self.config, self.par, self.moe_options, self.tp = config, par, moe, par.attn
        first = layer_config(config, 0)  # the sizes every layer shares (heads, vocabulary)
        self.shards = TPShards.of(first, par.tp, par.attn, par.pp_rank, par.pp_size)
        options: dict = {"sources": kv_sources(config), "mlp_tp": par.tp}
        if config.enable_moe_block:  # the MLP beside it split as a MoE model's dense layers
            options.update(make_moe=self.make_moe, mlp_tp=self.moe_context(first).dense_tp())
        self.model = self.model_cls(config, self.shards, **options)
        self.tie_word_embeddings = bool(config.tie_word_embeddings)
        self.lm_head = (
            None
            if self.tie_word_embeddings or not self.shards.has_head
            else Linear(config.hidden_size, self.shards.vocab_rows, bias=False)
        )
        self.tied_logits = None
        attn = self.model.own_layers[0].self_attn
        self.num_layers = self.model.end - self.model.start
        self.total_layers = config.num_hidden_layers
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_dim = attn.head_dim
        # PD slices every group's pages by the largest kind's KV heads (module docstring)
        kv = {layer_config(config, i).num_key_value_heads for i in range(self.total_layers)}
        self.total_kv_heads = max(kv)
        self.hidden_size, self.vocab_size = config.hidden_size, config.vocab_size
        self.first_layer = self.model.start
        self.num_attention_heads = config.num_attention_heads
        self.final_logit_softcap: Optional[float] = config.final_logit_softcapping

    # ---- MoE (``MoEForCausalLM``) ----------------------------------------------------------------
    def is_sparse(self, config, layer_id: int) -> bool:
        return bool(config.enable_moe_block)

    @staticmethod
    def expert_intermediate(config) -> int:
        return config.moe_intermediate_size

    def make_router(self, config) -> Gemma4Router:
        return Gemma4Router(
            config.hidden_size, config.num_experts, config.top_k_experts, config.rms_norm_eps
        )

    def expert_options(self, config) -> dict:
        return {"activation": "gelu_tanh"}

    def make_moe(self, config, layer_id: int, shards: TPShards) -> nn.Module:
        block = self.make_mlp(config, layer_id, shards)  # a SparseMoE
        block.expert_norm = Gemma4RMSNorm(config.hidden_size, config.rms_norm_eps)
        return block

    # ---- the model interface -----------------------------------------------------------------
    def kv_cache_specs(self) -> list[Optional[CacheSpec]]:
        specs: list[Optional[CacheSpec]] = []
        for layer in self.model.own_layers:
            a = layer.self_attn
            if a.source is not None:
                specs.append(None)  # it reads the cache of layer ``a.source``
                continue
            total = a.total_kv_heads if a.total_kv_heads != self.total_kv_heads else 0
            specs.append(
                FullAttention(a.num_kv_heads, a.head_dim, total_kv_heads=total)
                if a.window is None
                else SlidingWindow(a.num_kv_heads, a.head_dim, a.window, total_kv_heads=total)
            )
        return specs

    def final_norm(self, h: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
