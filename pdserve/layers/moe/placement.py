"""Where the experts live: physical expert slots over the expert-parallel ranks.

A layer has ``num_experts`` logical experts (the checkpoint's) and ``num_experts + redundant``
physical slots (``--ep-num-redundant-experts``): the extra slots hold copies of hot experts.
Rank ``r`` of ``ep_size`` holds the contiguous slots ``[r*S, (r+1)*S)``, S = slots / ep_size,
each filled with one logical expert (``physical_to_logical``). Without a placement file the
layout is trivial: slot i holds expert i (SGLang's ``--init-expert-location trivial``).

A token routed to a logical expert with several copies goes to copy ``token_index % copies``:
deterministic for a batch, and it spreads a hot expert's tokens over its copies. Every copy holds
the same weights, so the choice never changes what a token computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ExpertPlacement:
    num_experts: int
    ep_size: int
    # per MoE layer (by the model's layer id): physical slot -> logical expert
    physical_to_logical: dict[int, list[int]]

    @classmethod
    def trivial(cls, layers: list[int], num_experts: int, ep_size: int) -> "ExpertPlacement":
        check_divides(num_experts, ep_size)
        return cls(num_experts, ep_size, {layer: list(range(num_experts)) for layer in layers})

    @property
    def num_slots(self) -> int:
        return len(next(iter(self.physical_to_logical.values()))) if self.physical_to_logical else self.num_experts

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.ep_size

    def rank_slots(self, layer: int, ep_rank: int) -> list[int]:
        """Logical expert of each slot ``ep_rank`` holds in ``layer``, in slot order."""
        s = self.slots_per_rank
        return self.physical_to_logical[layer][ep_rank * s:(ep_rank + 1) * s]

    def dispatch_table(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(copies [E, max_copies] int64 physical slots, padded with the first copy; counts [E])
        for ``layer``."""
        copies: list[list[int]] = [[] for _ in range(self.num_experts)]
        for slot, logical in enumerate(self.physical_to_logical[layer]):
            copies[logical].append(slot)
        width = max(len(c) for c in copies)
        table = torch.tensor([c + [c[0]] * (width - len(c)) for c in copies], dtype=torch.int64)
        return table, torch.tensor([len(c) for c in copies], dtype=torch.int64)


def check_divides(num_slots: int, ep_size: int) -> None:
    if num_slots % ep_size:
        raise ValueError(f"ep_size: {ep_size} does not divide the {num_slots} expert slots of the model "
                         "(experts plus --ep-num-redundant-experts)")


def to_physical(ids: torch.Tensor, table: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Logical ids [T, K] -> physical slots [T, K]: copy ``t % copies`` of each token's expert."""
    if table.shape[1] == 1:
        return table[ids, 0]
    t = torch.arange(ids.shape[0], dtype=torch.int64).unsqueeze(1).expand_as(ids)
    return table[ids, t % counts[ids]]
