"""How one server runs its MoE layers: the expert-parallel layout, the dispatch backend, the
expert placement and who watches the routing (``--ep-size``, ``--moe-a2a-backend``,
``--moe-dense-tp-size``, ``--moe-runner-backend``, ``--init-expert-location``,
``--ep-num-redundant-experts``; SGLang's flags).

Ranks: the MoE layers run over the pipeline stage's ``tp`` ranks. ``ep_size`` expert groups
split the experts by slot (``placement.py``); inside a group of ``tp_size / ep_size`` ranks each
expert's intermediate dimension is split (TP inside the expert group). ``ep_rank = tp_rank //
(tp_size / ep_size)``.

Backends:

- ``none``: every rank sees every token of the step (under DP attention the groups' tokens are
  gathered first, as for the dense MLP), runs its experts' share and the float32 partial sums are
  all-reduced over ``tp``: one all-gather and one all-reduce of [tokens, hidden] per layer.
- ``torch``: each rank routes its own tokens (its DP group's, split over the attention group's
  ranks) and sends each token only to the ranks that hold one of its experts
  (``all_to_all_single``, counts first, then rows with their slot ids and weights); the
  experts' weighted outputs come back the same way. Needs ``ep_size == tp_size``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from pdserve.distributed import SINGLE, Parallel, TPGroup
from pdserve.layers.moe.placement import ExpertPlacement

A2A_BACKENDS = ("none", "torch")
RUNNER_BACKENDS = ("auto", "fused", "grouped_mm", "loop")


@dataclass
class MoEOptions:
    """The MoE part of the server arguments (``ServerArgs.moe_options()``)."""

    ep_size: int = 1
    a2a_backend: str = "none"
    dense_tp_size: Optional[int] = None  # None: the dense layers are tensor-parallel like attention
    runner: str = "auto"
    init_expert_location: str = "trivial"
    num_redundant_experts: int = 0
    record_experts: bool = False  # --expert-distribution-recorder-mode stat
    capture_routed_experts: bool = False  # --enable-return-routed-experts


# observer(layer_id, logical ids [N, K] int64) for the routing this rank counts
Observer = Callable[[int, "object"], None]


@dataclass
class MoEContext:
    par: Parallel
    options: MoEOptions
    placement: Optional[ExpertPlacement] = None
    observers: list[Observer] = field(default_factory=list)
    # per layer id: this DP group's routed ids [T, K] of the step (``capture_routed_experts``)
    captured: dict[int, object] = field(default_factory=dict)

    @property
    def tp(self) -> TPGroup:
        return self.par.tp

    @property
    def ep_size(self) -> int:
        return self.options.ep_size

    @property
    def moe_tp_size(self) -> int:
        return self.tp.size // self.ep_size

    @property
    def ep_rank(self) -> int:
        return self.tp.rank // self.moe_tp_size

    @property
    def moe_tp_rank(self) -> int:
        return self.tp.rank % self.moe_tp_size

    @property
    def a2a(self) -> bool:
        return self.options.a2a_backend == "torch" and self.tp.size > 1

    def dense_tp(self) -> TPGroup:
        """The ranks a dense MLP of a MoE model is split over: ``tp``, or none with
        ``--moe-dense-tp-size 1`` (replicated: each rank runs its own tokens, no collective)."""
        return SINGLE if self.options.dense_tp_size == 1 else self.tp

    def check(self, num_experts: int) -> None:
        o = self.options
        if o.ep_size < 1 or self.tp.size % o.ep_size:
            raise ValueError(
                f"ep_size: {o.ep_size} must divide the tensor-parallel size {self.tp.size}"
            )
        slots = num_experts + o.num_redundant_experts
        if slots % o.ep_size:
            raise ValueError(
                f"ep_size: {o.ep_size} does not divide the model's {num_experts} experts"
                + (f" plus {o.num_redundant_experts} redundant" if o.num_redundant_experts else "")
            )
        if o.a2a_backend == "torch" and o.ep_size != self.tp.size:
            raise ValueError(
                f"moe_a2a_backend: 'torch' dispatches to whole experts and needs --ep-size equal "
                f"to --tp-size ({self.tp.size}), got --ep-size {o.ep_size}"
            )


SINGLE_MOE = MoEContext(Parallel(), MoEOptions())
