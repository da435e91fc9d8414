"""The CPU fast paths of a Llama-family model (``CpuPathsMixin``): pdserve's kernels for the
per-token ops, prepacked matmuls, and the C++ decoder stack for decode steps (dense MLPs, and the
sparse MLPs of the MoE families whose router and experts it runs)."""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch

from pdserve.kv_spec import specs_of
from pdserve.layers.linear import (
    GEMV_MAX_ROWS,
    Linear,
    PackedBF16,
    PackedF32,
    PackedW8A8,
    prepack_linears,
)
from pdserve.layers.mlp import GatedMLP
from pdserve.layers.moe.fused import PackedExperts
from pdserve.layers.moe.layer import SparseMoE
from pdserve.layers.moe.router import SoftmaxTopK
from pdserve.layers.norm import RMSNorm
from pdserve.models.decoder import PRE_NORM
from pdserve.quantization.experts import QuantizedExperts
from pdserve.quantization.int8_matmul import Int8ChannelLinear
from pdserve.quantization.matmul import NO_ROW_LIMIT, QuantizedLinear


class CpuPathsMixin:
    """Mixed into ``LlamaForCausalLM``; expects ``self.model`` (the decoder), ``self.lm_head``
    (or None when tied), ``self.tied_logits``, ``self.shards`` and ``self.par``."""

    def use_cpu_kernels(self, ops: ModuleType) -> None:
        """Run norms, RoPE and SiLU-mul with pdserve's CPU kernels (``pdserve.kernels``)."""
        for module in self.modules():
            if hasattr(module, "ops"):
                module.ops = ops

    def prepack(
        self,
        ops: Optional[ModuleType],
        quantization: Optional[str] = None,
        batch_invariant: bool = False,
    ) -> int:
        """Prepack every matmul for bf16 on CPU, or int8 with ``quantization="w8a8_int8"`` (the LM
        head stays bf16); with ``batch_invariant`` the matmuls of a float32 model too
        (``PackedF32``); see ``layers/linear.py``. Returns packed bytes."""
        # the weights' dtype (a later pipeline stage has no embedding; a layer loaded quantized
        # has its matmul already)
        dtype = next(
            (m.weight.dtype for m in self.modules() if isinstance(m, Linear) and m.impl is None),
            torch.bfloat16,
        )
        total = prepack_linears(
            self,
            ops,
            float32_out=(self.lm_head,) if self.lm_head is not None else (),
            quantization=quantization,
            dtype=dtype,
            batch_invariant=batch_invariant,
        )
        if (
            self.tie_word_embeddings
            and self.shards.has_head
            and (dtype != torch.float32 or batch_invariant)
        ):
            weight = self.model.embed_tokens.weight
            self.tied_logits = (
                PackedF32(weight, None, ops)
                if dtype == torch.float32
                else PackedBF16(weight, None, ops, float32_out=True)
            )
            total += self.tied_logits.nbytes
        return total

    def enable_decode_stack(self, ops: ModuleType, batch_invariant: bool = False) -> bool:
        """Run decode-only batches through ``ops.DecodeModel`` (after ``prepack`` with ``ops``): the
        same kernels as the layer-by-layer path, without Python between them. Single-rank models
        only (the stack has no collectives), whole models (no pipeline stage), one cache group;
        a sparse MLP only where ``_sparse_parts`` takes it; returns whether it was enabled."""
        specs = {s for entry in self.kv_cache_specs() for s in specs_of(entry)}
        if self.par.world.size > 1 or len(specs) > 1:
            return False  # the stack has no collectives and reads one pool (one cache group)
        if any(layer.has_sinks or layer.logit_softcap for layer in self.attention_layers()):
            return False  # its attention kernel has no sinks and no soft-cap
        layers = self.model.own_layers
        if not all(_stack_runs(layer) for layer in layers):
            return False
        dense = [layer.mlp for layer in layers if not isinstance(layer.mlp, SparseMoE)]
        if any(getattr(mlp, "activation", None) != "silu" for mlp in dense):
            return False  # its MLP kernel is SiLU-and-mul
        sparse = {
            i: _sparse_parts(layer.mlp)
            for i, layer in enumerate(layers)
            if isinstance(layer.mlp, SparseMoE)
        }
        if any(parts is None for parts in sparse.values()):
            return False
        if any(
            _stack_matmul(m.impl) is None for m in self.model.modules() if isinstance(m, Linear)
        ):
            return False  # its matmuls: the bf16, int8 and panel (FP8, MXFP4, int4) kernels
        first = self.model.layers[0].self_attn
        # batch invariant: the GEMV kernel at every batch size, as the layer-by-layer path runs
        stack = ops.DecodeModel(
            first.num_heads,
            first.num_kv_heads,
            first.head_dim,
            self.model.norm.eps,
            first.scale,
            1 << 62 if batch_invariant else GEMV_MAX_ROWS,
        )

        for i, layer in enumerate(self.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            stack.add_layer(
                layer.input_layernorm.weight.data,
                layer.post_attention_layernorm.weight.data,
                _parts(attn.qkv_proj),
                _parts(attn.o_proj),
                [] if i in sparse else _parts(mlp.gate_up_proj),
                [] if i in sparse else _parts(mlp.down_proj),
                None if attn.q_norm is None else attn.q_norm.weight.data,
                None if attn.k_norm is None else attn.k_norm.weight.data,
                attn.attn.span or 0,  # a window, or an attention chunk as -C
            )
            if i in sparse:
                stack.set_moe(i, *sparse[i])
        self.model.decode_stack = stack
        return True


def _parts(linear: Linear) -> list:
    """``DecodeModel``'s form of a layer's matmul (``_stack_matmul`` of its ``impl``)."""
    impl = _stack_matmul(linear.impl)
    if isinstance(impl, QuantizedLinear):
        p = impl.panels()
        bias = impl._bias_in(torch.bfloat16)
        dims = [p.block_k, impl.out_features, p.max_rows, p.amx_min_rows, p.codes]
        return [None, None, bias, p.packed, p.scale, torch.tensor(dims, dtype=torch.int64)]
    if isinstance(impl, PackedW8A8):
        bias = None if impl.bias is None else impl.bias.to(torch.bfloat16)
        return [
            None,
            None,
            bias,
            impl.packed,
            impl.colsum,
            impl.scale,
            torch.tensor(impl.out_features),
        ]
    return _bf16_parts(impl)


def _bf16_parts(impl: PackedBF16) -> list:
    if impl.onednn is None:  # batch invariant: GEMV only
        return [impl.vnni, None, impl.bias, torch.tensor(impl.out_features)]
    return [impl.vnni, impl.onednn, impl.bias]


def _stack_matmul(impl):
    """The matmul the C++ stack runs for a layer's ``impl`` (a compressed-tensors int8 layer's
    ``PackedW8A8``), or None where it has no kernel for it."""
    if isinstance(impl, Int8ChannelLinear):
        impl = impl.packed
    if isinstance(impl, (PackedBF16, PackedW8A8)):
        return impl
    if isinstance(impl, QuantizedLinear) and impl.panels() is not None:
        return impl
    return None


def _sparse_parts(block: SparseMoE) -> Optional[tuple]:
    """``DecodeModel.set_moe``'s arguments for ``block`` after the layer index, or None where the
    stack would not compute what ``SparseMoE.run`` does on one rank: a router other than
    ``SoftmaxTopK``, an expert norm, weights on the input, experts copied or recorded, routed
    experts returned, experts on kernels the stack does not call, a shared expert other than a
    SiLU ``GatedMLP``."""
    ctx = block.ctx
    router = getattr(block, block.router_name)
    placement = ctx.placement
    if (
        type(router) is not SoftmaxTopK
        or block.expert_norm is not None
        or block.weights_on_input
        or ctx.a2a
        or ctx.observers
        or ctx.options.capture_routed_experts
        or placement.ep_size != 1
        or list(placement.physical_to_logical[block.layer_id]) != list(range(router.num_experts))
    ):
        return None
    if router.invariant is not None:  # the batch-invariant GEMV (float32 logits: not taken)
        if not isinstance(router.invariant, PackedBF16):
            return None
        gate = _bf16_parts(router.invariant)
    elif router.fp32_logits:
        return None
    else:  # at::linear over the weight, as F.linear
        gate = [router.weight.data, None if router.bias is None else router.bias.data]
    route = (gate, router.top_k, router.renormalize, router.cast_back)
    impl = block.experts.impl
    if isinstance(impl, QuantizedExperts) and impl.fused is not None:
        experts = (impl.fused, impl.amx_min_rows, impl.fused_max_rows, [], None, None, "", 0, 0)
    elif isinstance(impl, PackedExperts):
        tensors = [impl.w13, impl.w2]
        if impl.quantization is not None:
            tensors += [impl.w13_colsum, impl.w13_scale, impl.w2_colsum, impl.w2_scale]
        experts = (None, -1, NO_ROW_LIMIT, tensors, impl.b13, impl.b2)
        experts += (impl.activation, impl.alpha, impl.limit)
    else:
        return None
    shared = ([], [], [])
    if block.has_shared:  # its matmuls are among the model's Linear modules the caller checks
        mlp = getattr(block, block.shared_name)
        gate = block.shared_expert_gate if block.has_shared_gate else None
        if type(mlp) is not GatedMLP or mlp.activation != "silu":
            return None
        shared = (
            _parts(mlp.gate_up_proj),
            _parts(mlp.down_proj),
            [] if gate is None else _parts(gate),
        )
    return route + experts + shared


def _stack_runs(layer) -> bool:
    """Whether the C++ stack computes ``layer`` as it is: Llama's pre-norm block of RMSNorms,
    whole-head RoPE by halves on the layer, q/k norms per head if any."""
    attn = getattr(layer, "self_attn", None)
    return (
        getattr(layer, "block", None) == PRE_NORM
        and type(layer.input_layernorm) is RMSNorm
        and getattr(attn, "use_rope", False)
        and attn.rotary_dim == attn.head_dim
        and not attn.interleaved
        and getattr(attn, "qk_norm", None) in (None, "head")
        and (attn.q_norm is None or type(attn.q_norm) is RMSNorm)
    )
