"""Where the experts live: physical expert slots over the expert-parallel ranks.

A layer has ``num_experts`` logical experts (the checkpoint's) and ``num_experts + redundant``
physical slots (``--ep-num-redundant-experts``): the extra slots hold copies of hot experts.
Rank ``r`` of ``ep_size`` holds the contiguous slots ``[r*S, (r+1)*S)``, S = slots / ep_size,
each filled with one logical expert (``physical_to_logical``). Without a placement file the
layout is trivial: slot i holds expert ``i % num_experts`` (SGLang's ``--init-expert-location
trivial``; with redundant slots the first experts get a second copy, round-robin). A placement
file or a recorded distribution gives another layout (``placement_file.py``, ``eplb.py``).

A batch's pairs (token, k) routed to a logical expert with several copies are dealt over its
copies in token order: the j-th pair of the batch routed to expert e goes to copy ``j % copies``.
Deterministic for a batch (every rank that sees the same batch picks the same slots, which the
all-reduce dispatch needs), and within a batch each copy gets its share to one token. Every copy
holds the same weights, so the choice never changes what a token computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoEModelInfo:
    """What a placement or a distribution must agree with: the checkpoint's architecture, its
    decoder layer count, its logical experts per MoE layer and which layer ids are MoE layers."""

    architecture: str
    num_layers: int
    num_experts: int
    moe_layers: tuple[int, ...]


@dataclass
class ExpertPlacement:
    num_experts: int
    ep_size: int
    # per MoE layer (by the model's layer id): physical slot -> logical expert
    physical_to_logical: dict[int, list[int]]
    num_redundant: int = 0

    @classmethod
    def trivial(
        cls, layers: list[int], num_experts: int, ep_size: int, num_redundant: int = 0
    ) -> "ExpertPlacement":
        """Slot i holds expert ``i % num_experts``."""
        slots = num_experts + num_redundant
        check_divides(slots, ep_size)
        return cls(
            num_experts,
            ep_size,
            {layer: [i % num_experts for i in range(slots)] for layer in layers},
            num_redundant,
        )

    @property
    def num_slots(self) -> int:
        if self.physical_to_logical:
            return len(next(iter(self.physical_to_logical.values())))
        return self.num_experts + self.num_redundant  # a stage without MoE layers

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.ep_size

    def rank_slots(self, layer: int, ep_rank: int) -> list[int]:
        """Logical expert of each slot ``ep_rank`` holds in ``layer``, in slot order."""
        s = self.slots_per_rank
        return self.physical_to_logical[layer][ep_rank * s : (ep_rank + 1) * s]

    def dispatch_table(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(copies [E, max_copies] int64 physical slots, padded with the first copy; counts [E])
        for ``layer``."""
        copies: list[list[int]] = [[] for _ in range(self.num_experts)]
        for slot, logical in enumerate(self.physical_to_logical[layer]):
            copies[logical].append(slot)
        width = max(len(c) for c in copies)
        table = torch.tensor([c + [c[0]] * (width - len(c)) for c in copies], dtype=torch.int64)
        return table, torch.tensor([len(c) for c in copies], dtype=torch.int64)

    def rank_loads(self, layer: int, slot_counts: list[int]) -> list[int]:
        """Tokens each EP rank ran in ``layer``, from the tokens of each physical slot."""
        s = self.slots_per_rank
        return [sum(slot_counts[r * s : (r + 1) * s]) for r in range(self.ep_size)]

    def logical_counts(self, layer: int, slot_counts: list[int]) -> list[int]:
        """Tokens per logical expert of ``layer``: the sum over its copies."""
        out = [0] * self.num_experts
        for slot, logical in enumerate(self.physical_to_logical[layer]):
            out[logical] += slot_counts[slot]
        return out


def check_divides(num_slots: int, ep_size: int) -> None:
    if num_slots % ep_size:
        raise ValueError(
            f"ep_size: {ep_size} does not divide the {num_slots} expert slots of the model "
            "(experts plus --ep-num-redundant-experts)"
        )


def imbalance(loads: list[float]) -> float:
    """Max over mean of per-rank loads (1.0: balanced); 1.0 when nothing ran."""
    mean = sum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean > 0 else 1.0


def to_physical(ids: torch.Tensor, table: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Logical ids [T, K] -> physical slots [T, K]: the j-th pair routed to expert e (in token
    order) takes copy ``j % copies[e]``."""
    if table.shape[1] == 1:
        return table[ids, 0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    per_expert = torch.bincount(flat, minlength=table.shape[0])
    first = torch.cumsum(per_expert, 0) - per_expert  # where each expert's pairs start in ``order``
    nth = torch.empty_like(flat)
    nth[order] = (
        torch.arange(flat.numel(), dtype=flat.dtype, device=flat.device) - first[flat[order]]
    )
    return table[flat, nth % counts[flat]].view_as(ids)
