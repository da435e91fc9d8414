"""Llama-family decoder: Llama (GQA/MQA, llama3 RoPE), Qwen2 (qkv bias, optional sliding window),
Qwen3 (per-head q/k RMSNorm), Mistral (sliding window), whole or as one tensor-parallel rank. Its
blocks (attention, gated MLP, decoder, model) are what other families build on (``gemma.py``).

Module names follow HF checkpoints except where projections are fused: q/k/v live in one
``qkv_proj`` and gate/up in one ``gate_up_proj`` (see ``models/weights.py``, which also shards
them). Tokens are flattened: every activation is [T, ...] for the T new tokens of a
``ForwardBatch``. Under tensor parallelism each rank holds its query heads, KV heads and MLP
columns; o_proj and down_proj sum over the ranks, the embedding and the LM head split the
vocabulary (``TPShards``).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed import SINGLE, Parallel, TPGroup
from pdserve.forward_batch import ForwardBatch
from pdserve.kv_spec import CacheSpec, ChunkedAttention, FullAttention, SlidingWindow
from pdserve.layers.attention.base import AttnLayer
from pdserve.layers.linear import Linear, MergedLinear, PackedBF16, RowParallelLinear
from pdserve.layers.mlp import GatedProjections
from pdserve.layers.norm import ProjectionRMSNorm, RMSNorm
from pdserve.layers.rotary import (
    apply_rotary,
    rope_parameters,
    rotary_embedding,
    rotate_interleaved,
)
from pdserve.layers.vocab import VocabParallelEmbedding
from pdserve.models.cpu_paths import CpuPathsMixin
from pdserve.models.decoder import PRE_NORM, Block, DecoderLayer
from pdserve.models.weights import (
    TPShards,
    checkpoint_weight_names,
    load_weights,
    renamed,
    renamed_part,
)

# per head before RoPE (Qwen3), per head after it (HunYuan), over the whole projections (OLMo 2)
QK_NORMS = (False, True, None, "head", "head_after_rope", "projection")
# First rotary table size; it grows by doubling if a longer sequence arrives.
_ROPE_INITIAL_POSITIONS = 8192


def layer_sliding_window(config, layer_id: int) -> Optional[int]:
    """Sliding window of one layer, or None for full attention.

    Qwen2/Qwen3 only slide when ``use_sliding_window`` is set, and then only on the layers that
    ``layer_types`` marks ``sliding_attention``; Mistral slides on every layer when
    ``sliding_window`` is set.
    """
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_id] == "sliding_attention" else None
    max_window_layers = getattr(config, "max_window_layers", None)
    if max_window_layers is not None and layer_id < max_window_layers:
        return None
    return window


def is_per_layer_type(params) -> bool:
    """Whether ``rope_parameters`` holds one set per layer type (Gemma 3, OLMo 3)."""
    return bool(params) and all(isinstance(v, dict) for v in params.values())


def partial_rope_settings(config) -> dict[str, dict]:
    """One RoPE table over the dims a partial-rotary attention turns: the config's settings less
    ``partial_rotary_factor`` (the attention turns its first part itself)."""
    params = rope_parameters(config)
    params.pop("partial_rotary_factor", None)
    return {"default": params}


def check_layer_types(config) -> None:
    """``config.layer_types`` (families that alternate windowed and full layers): one per layer,
    each a kind this engine runs."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None or len(layer_types) != config.num_hidden_layers:
        raise ValueError(f"layer_types: one per layer expected, got {layer_types!r}")
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(
            f"layer_types: {unknown} not supported; supported: full_attention, sliding_attention"
        )


def norm_eps(config, norm_cls=None) -> float:
    """The epsilon of the decoder's norms: the config field the norm class names
    (``eps_field``: Cohere's LayerNorm reads ``layer_norm_eps`` even where the config also holds
    an ``rms_norm_eps``), else ``rms_norm_eps``, else ``layer_norm_eps``."""
    own = getattr(norm_cls, "eps_field", None)
    for field in ((own,) if own else ()) + ("rms_norm_eps", "layer_norm_eps"):
        if getattr(config, field, None) is not None:
            return float(getattr(config, field))
    raise ValueError("rms_norm_eps: missing from the config (nor layer_norm_eps)")


class LlamaAttention(nn.Module):
    """Self-attention with fused q/k/v. ``scale`` defaults to head_dim^-0.5; ``logit_softcap``,
    ``norm`` (the class of the optional per-head q/k norms) and ``sinks`` (a learned sink logit per
    query head, the parameter ``sinks`` of this rank's heads) are for families that differ."""

    def __init__(
        self,
        config,
        layer_id: int,
        shards: TPShards,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        scale: Optional[float] = None,
        logit_softcap: Optional[float] = None,
        norm: type[nn.Module] = RMSNorm,
        sinks: bool = False,
        uses_rope: Optional[Callable[[Any, int], bool]] = None,
        rotary_fraction: float = 1.0,
        interleaved: bool = False,
        qk_norm_rounds_late: bool = True,
    ):
        super().__init__()
        self.layer_id = layer_id
        self.kv_layer = layer_id - shards.layers[0]  # its index in this stage's KV pool
        self.num_heads = shards.num_heads  # this rank's
        self.num_kv_heads = shards.num_kv_heads
        self.head_dim = shards.head_dim
        self.scale = self.head_dim**-0.5 if scale is None else scale
        self.sliding_window = layer_sliding_window(config, layer_id)
        self.attn = AttnLayer(
            self.kv_layer, self.scale, self.sliding_window, logit_softcap, has_sinks=sinks
        )
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if sinks else None
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(config.hidden_size, [q_size, kv_size, kv_size], bias=qkv_bias)
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, bias=o_bias, tp=shards.attn)
        if qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm: {qk_norm!r}; expected one of {QK_NORMS}")
        # "head" (or True): one norm of head_dim per head; "projection": over the whole q and k
        # projections (OLMo 2), its statistics summed over the attention ranks
        self.qk_norm = "head" if qk_norm is True else (qk_norm or None)
        if self.qk_norm in ("head", "head_after_rope"):
            self.q_norm = norm(self.head_dim, config.rms_norm_eps)
            self.k_norm = norm(self.head_dim, config.rms_norm_eps)
        elif self.qk_norm == "projection":
            late = (
                qk_norm_rounds_late  # OLMo 2 multiplies the weight in float32, OLMoE after rounding
            )
            self.q_norm = ProjectionRMSNorm(q_size, config.rms_norm_eps, shards.attn, late)
            self.k_norm = ProjectionRMSNorm(kv_size, config.rms_norm_eps, shards.attn, late)
        else:
            self.q_norm = self.k_norm = None
        # RoPE on this layer (SmolLM3 and Cohere 2 leave some layers without position encoding),
        # on the first ``rotary_dim`` dims of each head, by halves or by interleaved pairs
        self.use_rope = True if uses_rope is None else bool(uses_rope(config, layer_id))
        self.rotary_dim = int(self.head_dim * rotary_fraction)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(
                f"partial_rotary_factor: {rotary_fraction} of head_dim {self.head_dim} gives "
                f"{self.rotary_dim} rotary dims; need an even number in [2, {self.head_dim}]"
            )
        self.interleaved = interleaved
        self.ops: Optional[ModuleType] = None

    def forward(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], fb: ForwardBatch
    ) -> torch.Tensor:
        t = h.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(h))
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            q, k = self.rotate(q, k, rope)
        if self.qk_norm == "head_after_rope":
            q, k = self.q_norm(q), self.k_norm(k)
        o = fb.attn_backend.forward(self.attn, q, k, v, fb, sinks=self.sinks)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))

    def rotate(self, q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """RoPE on q [T, heads, D] and k [T, kv_heads, D]; ``rope``: cos, sin [T, rotary_dim]."""
        r, whole = self.rotary_dim, self.rotary_dim == self.head_dim
        if self.ops is not None and whole and not self.interleaved:
            self.ops.rotary_embedding(q, k, *rope)  # in place, into the qkv output
            return q, k
        turn = rotate_interleaved if self.interleaved else apply_rotary
        cos, sin = (x.to(q.dtype) for x in rope)  # float32 where the kernels run
        if whole:
            return turn(q, cos, sin), turn(k, cos, sin)
        return (
            torch.cat([turn(q[..., :r], cos, sin), q[..., r:]], dim=-1),
            torch.cat([turn(k[..., :r], cos, sin), k[..., r:]], dim=-1),
        )


def attention_spec(attn: nn.Module) -> CacheSpec:
    """The cache of an attention module (``num_kv_heads``, ``head_dim``, ``attn``: its
    ``AttnLayer``): every key, a sliding window, or an attention chunk."""
    layer = attn.attn
    if layer.sliding_window:
        return SlidingWindow(attn.num_kv_heads, attn.head_dim, layer.sliding_window)
    if layer.attention_chunk:
        return ChunkedAttention(attn.num_kv_heads, attn.head_dim, chunk=layer.attention_chunk)
    return FullAttention(attn.num_kv_heads, attn.head_dim)


class LlamaMLP(GatedProjections):
    """``down(act(gate(x)) * up(x))``; the activation is the config's ``activation_field``; sharded
    by ``TPShards`` (its weights come through the loader's fused projections)."""

    def __init__(self, config, shards: TPShards, activation_field: str = "hidden_act"):
        super().__init__()
        self.set_activation(getattr(config, activation_field, None), activation_field)
        bias = bool(getattr(config, "mlp_bias", False))
        inter = shards.intermediate  # this rank's columns
        self.gate_up_proj = MergedLinear(config.hidden_size, [inter, inter], bias=bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias, tp=shards.tp)


class LlamaDecoderLayer(DecoderLayer):
    """A layer of ``attn_cls`` attention (options ``attn_kwargs``) and the gated MLP, or the
    model's ``make_mlp`` for this layer (MoE families), with ``norm_cls`` norms placed as ``block``
    says (pre-norm by default)."""

    attn_cls: type[nn.Module] = LlamaAttention
    norm_cls: type[nn.Module] = RMSNorm
    activation_field = "hidden_act"  # the config field naming the gated MLP's activation

    def __init__(
        self,
        config,
        layer_id: int,
        shards: TPShards,
        block: Block = PRE_NORM,
        make_mlp: Optional[Callable] = None,
        mlp_name: str = "mlp",
        norm_cls: Optional[type[nn.Module]] = None,
        **attn_kwargs,
    ):
        norm_cls = norm_cls or self.norm_cls
        eps = norm_eps(config, norm_cls)
        super().__init__(
            self.attn_cls(config, layer_id, shards, **attn_kwargs),
            LlamaMLP(config, shards, self.activation_field)
            if make_mlp is None
            else make_mlp(config, layer_id, shards),
            block,
            lambda: norm_cls(config.hidden_size, eps),
            mlp_name,
        )
        if is_per_layer_type(getattr(config, "rope_parameters", None)):
            self.rope_kind = config.layer_types[layer_id]  # its type's RoPE table


def layer_mlps(layer: nn.Module) -> list[nn.Module]:
    """The modules a decoder layer runs through ``run_mlp``, in order (what an idle DP-attention
    group joins): ``layer.dp_mlps`` where a family names them otherwise, else ``[layer.mlp]``."""
    mlps = getattr(layer, "dp_mlps", None)
    return list(mlps) if mlps is not None else [layer.mlp]


def first_attention(layers: Iterable[nn.Module]) -> Optional[nn.Module]:
    """The attention module of the first of ``layers`` that has one (a hybrid's first layer may
    be a linear-attention layer; a pipeline stage may hold none)."""
    return next((layer.self_attn for layer in layers if hasattr(layer, "self_attn")), None)


class LlamaModel(nn.Module):
    """The decoder; in a pipeline stage only its layers (``shards.layers``; the others are
    placeholders, so parameter names stay the checkpoint's) and the embedding where it is used.
    A family changes its blocks through the class attributes and ``rope_settings``."""

    layer_cls: type[nn.Module] = LlamaDecoderLayer
    norm_cls: type[nn.Module] = RMSNorm
    embedding_cls: type[nn.Module] = VocabParallelEmbedding

    def __init__(self, config, shards: TPShards, **attn_kwargs):
        super().__init__()
        self.start, self.end = shards.layers
        self.embed_tokens = (
            self.embedding_cls(shards.vocab_rows, config.hidden_size, shards.vocab[0], shards.attn)
            if shards.embeds
            else None
        )
        self.layers = nn.ModuleList(
            self.layer_cls(config, i, shards, **attn_kwargs)
            if self.start <= i < self.end
            else nn.Identity()
            for i in range(config.num_hidden_layers)
        )
        # the family's norm class (``LlamaForCausalLM.norm_cls``) or the model's
        norm_cls = attn_kwargs.get("norm_cls") or self.norm_cls
        self.norm = norm_cls(config.hidden_size, norm_eps(config, norm_cls))
        attn = first_attention(self.own_layers)
        # the dims RoPE turns (all, or a head's first part)
        head_dim = shards.head_dim if attn is None else getattr(attn, "rotary_dim", attn.head_dim)
        initial = min(config.max_position_embeddings, _ROPE_INITIAL_POSITIONS)
        self.rotaries = nn.ModuleDict(
            {
                kind: rotary_embedding(head_dim, params, initial)
                for kind, params in self.rope_settings(config).items()
            }
        )
        self.ops: Optional[ModuleType] = None
        # the decoder stack in C++ for decode-only batches (bf16 prepacked CPU models)
        self.decode_stack = None
        # layers whose output stream a forward keeps (an EAGLE-3 head reads them), and those kept
        self.capture_layers: tuple[int, ...] = ()
        self.captured: dict[int, torch.Tensor] = {}

    @staticmethod
    def rope_settings(config) -> dict[str, dict]:
        """RoPE parameters by kind (a layer's ``rope_kind``): one table per layer type when the
        config has per-type parameters (Gemma 3, OLMo 3), else one for every layer."""
        params = getattr(config, "rope_parameters", None)
        if not is_per_layer_type(params):
            return {"default": rope_parameters(config)}
        missing = sorted(set(config.layer_types) - set(params))
        if missing:
            raise ValueError(
                f"rope_parameters: no settings for the layer type(s) {missing}; got {params}"
            )
        return {kind: rope_parameters({"rope_parameters": p}) for kind, p in params.items()}

    @property
    def own_layers(self) -> list[nn.Module]:
        return list(self.layers)[self.start : self.end]

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        h, residual = self.forward_layers(fb, self.embed_tokens(fb.input_ids), None)
        h, _ = self.norm(h, residual)
        return h

    def forward_layers(self, fb: ForwardBatch, h: torch.Tensor, residual: Optional[torch.Tensor]):
        """This stage's layers over ``h`` (embeddings, or the previous stage's output and residual
        stream); returns (output, residual) before the final norm."""
        ropes = {}  # kind -> (cos, sin) [T, head_dim]
        for kind, rotary in self.rotaries.items():
            cos, sin = rotary.tables(fb)  # float32; the kernel rounds them as HF does
            ropes[kind] = (cos, sin) if self.ops is not None else (cos.to(h.dtype), sin.to(h.dtype))
        self.captured = {}
        if (
            self.decode_stack is not None
            and fb.is_decode_only
            and not self.capture_layers
            and fb.adapters is None  # LoRA deltas come after the layers' own matmuls
            and h.shape[0] <= self.decode_stack.max_rows()  # its experts' kernels' limit
        ):
            table, lens = fb.int32_tables()  # the stack exists only for one-group models
            cos, sin = ropes["default"]  # float32: the stack exists only with the kernels
            pool = fb.groups[fb.anchor].pool
            return self.decode_stack.forward(h, pool.buffer, table, lens, cos, sin)
        for i, layer in enumerate(self.own_layers, self.start):
            h, residual = layer(h, residual, ropes.get(layer.rope_kind), fb)
            h = self.after_layer(i, h)
            if i in self.capture_layers:
                self.captured[i] = h if residual is None else h + residual
            if fb.layer_done is not None:
                fb.layer_done(i)
        return h, residual

    def after_layer(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """A layer's output (before the residual add) as the next layer reads it: itself, or,
        for a vision-language decoder, with image features added (``vision_language.py``)."""
        return h

    def idle_forward(self, dp) -> None:
        """A DP-attention group with no tokens this step: join every layer's MLP collectives."""
        empty = torch.empty((0, self.norm.weight.shape[0]), dtype=self.norm.weight.dtype)
        for layer in self.own_layers:
            for mlp in layer_mlps(layer):
                run = getattr(mlp, "run", None)
                run(empty, dp) if run is not None else mlp(dp.gather(empty))


class LlamaForCausalLM(CpuPathsMixin, nn.Module):
    """``model(fb) -> hidden [T, hidden_size]`` (final norm applied);
    ``compute_logits(hidden [N, hidden_size]) -> [N, vocab_size]`` float32 (every rank gets the
    whole vocabulary's logits)."""

    model_cls: type[nn.Module] = LlamaModel
    # where each layer's norms sit (``models/decoder.py``); None: the layers place their own
    block: Optional[Block] = PRE_NORM
    # the class of every layer's norms and the final one (None: the model's, RMSNorm for Llama)
    norm_cls: Optional[type[nn.Module]] = None
    qk_norm: bool | str = False  # per-head q/k norms (True, "head") or over the projections
    # checkpoint name prefix -> this model's (a family whose files name a module differently)
    checkpoint_prefixes: dict[str, str] = {}
    # part of a checkpoint name -> ours (the first match, once)
    checkpoint_renames: dict[str, str] = {}

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        """(bias of q/k/v, bias of o_proj)."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def attention_options(self, config) -> dict:
        """Keyword arguments of every layer's attention (``LlamaAttention``)."""
        qkv_bias, o_bias = self.attention_biases(config)
        return dict(qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=self.qk_norm)

    def layer_options(self, config) -> dict:
        """Keyword arguments of every decoder layer: its block and the attention's (MoE families
        add their MLPs)."""
        block = {} if self.block is None else {"block": self.block}
        norm = {} if self.norm_cls is None else {"norm_cls": self.norm_cls}
        return {**block, **norm, **self.attention_options(config)}

    def __init__(
        self, config, tp: TPGroup = SINGLE, par: Optional[Parallel] = None, moe: Any = None
    ):
        super().__init__()
        par = Parallel(world=tp, tp=tp, attn=tp) if par is None else par
        self.config = config
        self.par = par
        self.moe_options = (
            moe  # MoE families' options (``layers/moe/context.py``); dense ones ignore it
        )
        self.tp = par.attn  # the logits' vocabulary is split over the attention group
        self.shards = TPShards.of(config, par.tp, par.attn, par.pp_rank, par.pp_size)
        self.model = self.model_cls(config, self.shards, **self.layer_options(config))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # Tied: the logits reuse the embedding matrix; no shared Parameter, which would come apart
        # when the loader materialises the model from the meta device.
        self.lm_head = (
            None
            if self.tie_word_embeddings or not self.shards.has_head
            else Linear(config.hidden_size, self.shards.vocab_rows, bias=False)
        )
        # tied embeddings on a prepacked CPU model: the logits' own packed copy of the embedding
        self.tied_logits: Optional[PackedBF16] = None
        attn = first_attention(self.model.own_layers) or self.shards
        self.num_layers = self.model.end - self.model.start  # this stage's (its KV pool's)
        self.total_layers = config.num_hidden_layers
        self.num_heads = attn.num_heads  # this rank's
        self.num_kv_heads = attn.num_kv_heads  # this rank's (its KV pool's)
        self.total_kv_heads = self.shards.total_kv_heads
        self.head_dim = attn.head_dim
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.first_layer = self.model.start
        self.num_attention_heads = config.num_attention_heads

    # ---- the model interface (models/base.py) ------------------------------------------------
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        return self.model(fb)

    def prefix_namespace(self, seq_len: int) -> int:
        rotaries = getattr(self.model, "rotaries", {})
        return max((r.variant(seq_len) for r in rotaries.values()), default=0)

    def kv_cache_specs(self) -> list[CacheSpec]:
        return [attention_spec(layer.self_attn) for layer in self.model.own_layers]

    def attention_layers(self) -> list[AttnLayer]:
        return [layer.self_attn.attn for layer in self.model.own_layers]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward_layers(self, fb, h, residual):
        return self.model.forward_layers(fb, h, residual)

    def capture_aux(self, layers: Iterable[int]) -> None:
        """Keep the output stream of ``layers`` at every forward (``aux_hidden``)."""
        bad = [i for i in layers if not 0 <= i < self.total_layers]
        if bad:
            raise ValueError(f"layers {bad}: outside the model's {self.total_layers} layers")
        self.model.capture_layers = tuple(layers)

    def aux_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last forward's kept layer outputs in ``capture_aux``'s order, concatenated
        ([T, layers * hidden]); ``hidden`` (the final hidden states) when none are kept."""
        kept = self.model.captured
        if not kept:
            return hidden
        return torch.cat([kept[i] for i in self.model.capture_layers], dim=-1)

    def final_norm(self, h: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
        return self.model.norm(h, residual)[0]

    def idle_forward(self, dp) -> None:
        self.model.idle_forward(dp)

    expert_recorder = None  # MoE families set theirs

    def moe_blocks(self) -> list:
        return []  # dense; ``MoEForCausalLM`` lists its blocks

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            local = self.lm_head(hidden).float()  # a no-op copy when the head outputs float32
        elif self.tied_logits is not None:
            local = self.tied_logits(hidden).float()
        else:
            local = F.linear(hidden, self.model.embed_tokens.weight).float()
        if self.tp.size == 1:
            return local
        return self.tp.all_gather_last_dim(local)[
            :, : self.vocab_size
        ]  # vocabulary slices in rank order

    # ---- weights -----------------------------------------------------------------------------
    def checkpoint_weight_names(self) -> set[str]:
        """HF names of every weight this model needs from a checkpoint."""
        back = {ours: theirs for theirs, ours in self.checkpoint_prefixes.items()}
        parts = {ours: theirs for theirs, ours in self.checkpoint_renames.items()}
        return {renamed_part(renamed(n, back), parts) for n in checkpoint_weight_names(self)}

    def own_weight_name(self, name: str) -> str:
        """A checkpoint weight's name as this model's loader reads it (its renames applied)."""
        return renamed_part(renamed(name, self.checkpoint_prefixes), self.checkpoint_renames)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy HF-named weights (tensors or safetensors slices) into this rank's shard."""
        if self.checkpoint_prefixes or self.checkpoint_renames:
            weights = ((self.own_weight_name(n), w) for n, w in weights)
        load_weights(self, weights, self.shards, tied_head=self.tie_word_embeddings)


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        return True, False


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is Llama with a sliding window on every layer (``layer_sliding_window``)."""
