"""Llama-family decoder: Llama (GQA/MQA, llama3 RoPE), Qwen2 (qkv bias, optional sliding window),
Qwen3 (per-head q/k RMSNorm), Mistral (sliding window).

Module names follow HF checkpoints except where projections are fused: q/k/v live in one
``qkv_proj`` and gate/up in one ``gate_up_proj`` (see ``_FUSED``). Tokens are flattened: every
activation is [T, ...] for the T new tokens of a ``ForwardBatch``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.forward_batch import ForwardBatch
from pdserve.layers.linear import GEMV_MAX_ROWS, Linear, MergedLinear, PackedBF16, PackedW8A8, prepack_linears
from pdserve.layers.norm import RMSNorm
from pdserve.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters

# HF projection name -> (our fused module, shard index in it)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# HF weights that carry no parameters of ours
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
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


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_id: int, qkv_bias: bool, o_bias: bool, qk_norm: bool):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim ** -0.5
        self.sliding_window = layer_sliding_window(config, layer_id)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(config.hidden_size, [q_size, kv_size, kv_size], bias=qkv_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=o_bias)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.ops: Optional[ModuleType] = None

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], fb: ForwardBatch) -> torch.Tensor:
        t = h.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(h))
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.ops is not None:
            self.ops.rotary_embedding(q, k, *rope)  # in place, into the qkv output
        else:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        o = fb.attn_backend.forward(self.layer_id, q, k, v, fb, self.scale, self.sliding_window)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act: only 'silu' is supported, got {config.hidden_act!r}")
        bias = bool(getattr(config, "mlp_bias", False))
        inter = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [inter, inter], bias=bias)
        self.down_proj = Linear(inter, config.hidden_size, bias=bias)
        self.ops: Optional[ModuleType] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.ops is not None and gate_up.dim() == 2:
            act = gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))
            self.ops.silu_and_mul(act, gate_up)
            return self.down_proj(act)
        gate, up = self.gate_up_proj.split(gate_up)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, **attn_kwargs):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, **attn_kwargs)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, residual, rope, fb):
        """Pre-norm block; ``residual`` is the stream before this block's input norm (None for the
        first layer). Returns (mlp output, residual) with the add deferred to the next norm."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, rope, fb)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config, **attn_kwargs):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, **attn_kwargs) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = self.layers[0].self_attn.head_dim
        initial = min(config.max_position_embeddings, _ROPE_INITIAL_POSITIONS)
        self.rotary = RotaryEmbedding(head_dim, rope_parameters(config), initial)
        self.ops: Optional[ModuleType] = None
        # the decoder stack in C++ for decode-only batches (bf16 prepacked CPU models)
        self.decode_stack = None

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        h = self.embed_tokens(fb.input_ids)
        self.rotary.reserve(max(fb.seq_lens), h.device)
        cos, sin = self.rotary(fb.positions)  # float32; the kernel rounds them as HF does
        rope = (cos, sin) if self.ops is not None else (cos.to(h.dtype), sin.to(h.dtype))
        if self.decode_stack is not None and fb.is_decode_only:
            table, lens = fb.int32_tables()
            h, residual = self.decode_stack.forward(h, fb.kv_pool.buffer, table, lens, cos, sin)
            h, _ = self.norm(h, residual)
            return h
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, rope, fb)
        h, _ = self.norm(h, residual)
        return h


class LlamaForCausalLM(nn.Module):
    """``model(fb) -> hidden [T, hidden_size]`` (final norm applied);
    ``compute_logits(hidden [N, hidden_size]) -> [N, vocab_size]`` float32."""

    qk_norm = False

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        """(bias of q/k/v, bias of o_proj)."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def __init__(self, config):
        super().__init__()
        self.config = config
        qkv_bias, o_bias = self.attention_biases(config)
        self.model = LlamaModel(config, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=self.qk_norm)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # Tied: the logits reuse the embedding matrix; no shared Parameter, which would come apart
        # when the loader materialises the model from the meta device.
        self.lm_head = None if self.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)
        # tied embeddings on a prepacked CPU model: the logits' own packed copy of the embedding
        self.tied_logits: Optional[PackedBF16] = None
        attn = self.model.layers[0].self_attn
        self.num_layers = config.num_hidden_layers
        self.num_heads = attn.num_heads
        self.num_kv_heads = attn.num_kv_heads
        self.head_dim = attn.head_dim
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        return self.model(fb)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(hidden).float()  # a no-op copy when the head outputs float32
        if self.tied_logits is not None:
            return self.tied_logits(hidden).float()
        return F.linear(hidden, self.model.embed_tokens.weight).float()

    # ---- CPU fast paths --------------------------------------------------------------------------
    def use_cpu_kernels(self, ops: ModuleType) -> None:
        """Run norms, RoPE and SiLU-mul with pdserve's CPU kernels (``pdserve.kernels``)."""
        for module in self.modules():
            if hasattr(module, "ops"):
                module.ops = ops

    def enable_decode_stack(self, ops: ModuleType) -> None:
        """Run decode-only batches through ``ops.DecodeModel`` (after ``prepack`` with ``ops``): the
        same kernels as the layer-by-layer path, without Python between them."""
        first = self.model.layers[0].self_attn
        stack = ops.DecodeModel(first.num_heads, first.num_kv_heads, first.head_dim,
                                self.model.norm.eps, first.scale, GEMV_MAX_ROWS)

        def parts(linear: Linear) -> list:
            impl = linear.impl
            if isinstance(impl, PackedW8A8):
                bias = None if impl.bias is None else impl.bias.to(torch.bfloat16)
                return [None, None, bias, impl.packed, impl.colsum, impl.scale, torch.tensor(impl.out_features)]
            return [impl.vnni, impl.onednn, impl.bias]

        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            stack.add_layer(
                layer.input_layernorm.weight.data, layer.post_attention_layernorm.weight.data,
                parts(attn.qkv_proj), parts(attn.o_proj), parts(mlp.gate_up_proj), parts(mlp.down_proj),
                None if attn.q_norm is None else attn.q_norm.weight.data,
                None if attn.k_norm is None else attn.k_norm.weight.data,
                attn.sliding_window or 0,
            )
        self.model.decode_stack = stack

    def prepack(self, ops: Optional[ModuleType], quantization: Optional[str] = None) -> int:
        """Prepack every matmul for bf16 on CPU, or int8 with ``quantization="w8a8_int8"`` (the LM
        head stays bf16); see ``layers/linear.py``. Returns packed bytes."""
        total = prepack_linears(self, ops, float32_out=(self.lm_head,) if self.lm_head is not None else (),
                                quantization=quantization)
        if self.tie_word_embeddings:
            self.tied_logits = PackedBF16(self.model.embed_tokens.weight, None, ops, float32_out=True)
            total += self.tied_logits.nbytes
        return total

    # ---- weights -----------------------------------------------------------------------------
    def checkpoint_weight_names(self) -> set[str]:
        """HF names of every weight this model needs from a checkpoint."""
        fused = {}
        for proj, (module, shard) in _FUSED.items():
            fused.setdefault(module, {})[shard] = proj
        names = set()
        for name, _ in self.named_parameters():
            module_path, _, leaf = name.rpartition(".")
            parent, _, module = module_path.rpartition(".")
            if module in fused:
                names.update(f"{parent}.{proj}.{leaf}" for proj in fused[module].values())
            else:
                names.add(name)
        return names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the model. Every needed weight must come and nothing unknown
        may (``ValueError`` naming the weights otherwise)."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            module_path, _, leaf = name.rpartition(".")
            parent, _, proj = module_path.rpartition(".")
            if proj in _FUSED:
                module, shard = _FUSED[proj]
                target = f"{parent}.{module}"
                if f"{target}.{leaf}" not in params:
                    raise ValueError(f"unexpected weight {name!r} in checkpoint")
                try:
                    self.get_submodule(target).load_shard(shard, leaf, tensor)
                except ValueError as e:
                    raise ValueError(f"weight {name!r}: {e}") from None
            else:
                param = params.get(name)
                if param is None:
                    raise ValueError(f"unexpected weight {name!r} in checkpoint")
                if param.shape != tensor.shape:
                    raise ValueError(f"weight {name!r}: expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}")
                param.data.copy_(tensor)
            loaded.add(name)
        missing = sorted(self.checkpoint_weight_names() - loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing weight(s): {shown}")


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        return True, False


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is Llama with a sliding window on every layer (``layer_sliding_window``)."""
