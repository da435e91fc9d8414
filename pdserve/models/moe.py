"""Mixture-of-experts decoders on the Llama blocks: Qwen3-MoE, Qwen2-MoE and Mixtral.

The attention is their dense relatives' (Qwen3: per-head q/k norms; Qwen2: q/k/v biases;
Mixtral: Llama's, with Mistral's optional sliding window); the MLP of a sparse layer is a
``SparseMoE`` (``layers/moe/``), HF's formulas:

- Qwen3-MoE: softmax router, top-k, renormalised when ``norm_topk_prob``, weights cast back to the
  model dtype; a layer is sparse iff it is not in ``mlp_only_layers`` and
  ``(layer + 1) % decoder_sparse_step == 0``; the other layers have a dense MLP of
  ``intermediate_size``;
- Qwen2-MoE: the same router and layer rule, plus a shared expert of
  ``shared_expert_intermediate_size`` gated by ``sigmoid(shared_expert_gate(x))``;
- Mixtral: every layer sparse, always renormalised, weights kept in float32; checkpoint names
  ``block_sparse_moe.experts.E.w1/w2/w3`` (w1 gate, w3 up, w2 down).

Dense layers of these models are tensor-parallel as in Llama, or replicated with
``--moe-dense-tp-size 1``. Expert parallelism and the dispatch backend: ``layers/moe/context.py``.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from pdserve.distributed import SINGLE, shard_range
from pdserve.layers.linear import Linear
from pdserve.layers.mlp import GatedMLP
from pdserve.layers.moe.context import MoEContext, MoEOptions
from pdserve.layers.moe.experts import Experts
from pdserve.layers.moe.layer import SparseMoE
from pdserve.layers.moe.placement import ExpertPlacement, MoEModelInfo
from pdserve.layers.moe.placement_file import initial_placement
from pdserve.layers.moe.recorder import ExpertRecorder
from pdserve.layers.moe.router import Router, mixtral_router, qwen_router
from pdserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from pdserve.models.weights import TPShards


class MoEDecoderLayer(LlamaDecoderLayer):
    """A Llama block whose MLP is the model's choice for this layer (``MoEForCausalLM.make_mlp``),
    registered under the checkpoint's name (``mlp``, or ``block_sparse_moe`` for Mixtral)."""


MixtralDecoderLayer = MoEDecoderLayer  # its MLP is registered as ``block_sparse_moe``


class MoEModel(LlamaForCausalLM.model_cls):
    layer_cls = MoEDecoderLayer


class MixtralModel(MoEModel):
    layer_cls = MixtralDecoderLayer


class MoEForCausalLM(LlamaForCausalLM):
    """The shared part: which layers are sparse, the MoE context, the MLP of each layer."""

    model_cls = MoEModel
    mlp_name = "mlp"
    expert_format = "per_expert"

    # ---- what a family defines --------------------------------------------------------------
    @staticmethod
    def num_experts(config) -> int:
        return config.num_experts

    @staticmethod
    def expert_intermediate(config) -> int:
        return config.moe_intermediate_size

    def is_sparse(self, config, layer_id: int) -> bool:
        step = getattr(config, "decoder_sparse_step", 1) or 1
        return (
            layer_id not in (getattr(config, "mlp_only_layers", None) or [])
            and self.num_experts(config) > 0
            and (layer_id + 1) % step == 0
        )

    def make_router(self, config) -> Router:
        return qwen_router(config)

    def make_shared(
        self, config, layer_id: int, tp
    ) -> tuple[Optional[nn.Module], Optional[Linear]]:
        return None, None

    router_name = "gate"
    shared_name = "shared_expert"

    def expert_options(self, config) -> dict:
        """Keyword arguments of ``Experts`` beyond the layout (activation, biases)."""
        return {}

    # ---- construction ---------------------------------------------------------------------
    def layer_options(self, config) -> dict:
        self.moe_context(config)
        return {
            **super().layer_options(config),
            "make_mlp": self.make_mlp,
            "mlp_name": self.mlp_name,
        }

    def moe_context(self, config) -> MoEContext:
        if getattr(self, "_moe_ctx", None) is None:
            options = self.moe_options if isinstance(self.moe_options, MoEOptions) else MoEOptions()
            ctx = MoEContext(self.par, options)
            num = self.num_experts(config)
            ctx.check(num)
            start, end = TPShards.of(
                config, self.par.tp, self.par.attn, self.par.pp_rank, self.par.pp_size
            ).layers
            layers = [i for i in range(start, end) if self.is_sparse(config, i)]
            ctx.placement = self.expert_placement(config, layers, ctx)
            # --expert-distribution-recorder-mode stat: tokens per layer per expert slot
            self.expert_recorder = None
            if options.record_experts:
                self.expert_recorder = ExpertRecorder(self.moe_info(config), ctx.placement)
                ctx.observers.append(self.expert_recorder.observe)
            self._moe_ctx = ctx
        return self._moe_ctx

    def moe_info(self, config) -> MoEModelInfo:
        """The facts a placement or a recorded distribution must agree with."""
        arch = (getattr(config, "architectures", None) or [type(self).__name__])[0]
        n = config.num_hidden_layers
        return MoEModelInfo(
            arch,
            n,
            self.num_experts(config),
            tuple(i for i in range(n) if self.is_sparse(config, i)),
        )

    def expert_placement(self, config, layers: list[int], ctx: MoEContext) -> ExpertPlacement:
        """``--init-expert-location`` (trivial, a placement or a distribution file) for this stage's
        MoE ``layers``, with ``--ep-num-redundant-experts`` extra slots (``placement_file.py``)."""
        o = ctx.options
        return initial_placement(
            o.init_expert_location,
            self.moe_info(config),
            layers,
            ctx.ep_size,
            o.num_redundant_experts,
        )

    def make_mlp(self, config, layer_id: int, shards: TPShards) -> nn.Module:
        ctx = self._moe_ctx
        if not self.is_sparse(config, layer_id):
            if ctx.options.dense_tp_size == 1:
                return GatedMLP(
                    config.hidden_size, config.intermediate_size, config.hidden_act, SINGLE
                )
            return LlamaMLP(config, shards)
        try:
            inter = shard_range(self.expert_intermediate(config), ctx.moe_tp_rank, ctx.moe_tp_size)
        except ValueError as e:
            raise ValueError(
                f"ep_size: {e} (expert intermediate size {self.expert_intermediate(config)}, "
                f"--tp-size {ctx.tp.size} / --ep-size {ctx.ep_size} ranks per expert)"
            ) from None
        runner = "loop" if ctx.options.runner == "loop" else "grouped_mm"
        experts = Experts(
            config.hidden_size,
            inter,
            ctx.placement.rank_slots(layer_id, ctx.ep_rank),
            fmt=self.expert_format,
            runner=runner,
            down_bias_here=ctx.moe_tp_rank == 0,
            **self.expert_options(config),
        )
        shared, gate = self.make_shared(config, layer_id, SINGLE if ctx.a2a else ctx.tp)
        return SparseMoE(
            layer_id,
            self.make_router(config),
            experts,
            ctx,
            router_name=self.router_name,
            shared=shared,
            shared_gate=gate,
            shared_name=self.shared_name,
        )

    def moe_blocks(self) -> list[SparseMoE]:
        return sorted(
            (m for m in self.modules() if isinstance(m, SparseMoE)), key=lambda m: m.layer_id
        )

    # ---- CPU fast paths ---------------------------------------------------------------------
    def prepack(
        self, ops, quantization: Optional[str] = None, batch_invariant: bool = False
    ) -> int:
        total = super().prepack(ops, quantization, batch_invariant)
        if getattr(self, "_moe_ctx", None) is None:  # a family's dense form: no MoE layers
            return total
        for block in self.moe_blocks():
            total += getattr(block, block.router_name).prepack(ops, batch_invariant)
        runner = self._moe_ctx.options.runner
        if runner in ("auto", "fused") or batch_invariant:
            for block in self.moe_blocks():
                packed = block.experts.prepack(ops, quantization, batch_invariant)
                if packed == 0 and runner == "fused":
                    raise ValueError(
                        "moe_runner_backend: 'fused' needs pdserve's CPU kernels, which are "
                        "not available here (see the log); use 'auto'"
                    )
                total += packed
        return total


class Qwen3MoeForCausalLM(MoEForCausalLM):
    qk_norm = True


class Qwen2MoeForCausalLM(MoEForCausalLM):
    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        return True, False

    def make_shared(self, config, layer_id, tp):
        size = getattr(config, "shared_expert_intermediate_size", 0) or 0
        if not size:
            return None, None
        shared = GatedMLP(config.hidden_size, size, config.hidden_act, tp)
        return shared, Linear(config.hidden_size, 1, bias=False)


class LocalExperts:
    """Mixtral's and GPT-OSS's config names: every layer sparse, ``num_local_experts`` experts of
    ``intermediate_size`` (mixed in before ``MoEForCausalLM``)."""

    @staticmethod
    def num_experts(config) -> int:
        return config.num_local_experts

    @staticmethod
    def expert_intermediate(config) -> int:
        return config.intermediate_size

    def is_sparse(self, config, layer_id: int) -> bool:
        return True


class MixtralForCausalLM(LocalExperts, MoEForCausalLM):
    model_cls = MixtralModel
    mlp_name = "block_sparse_moe"
    expert_format = "mixtral"

    def make_router(self, config) -> Router:
        return mixtral_router(config)
