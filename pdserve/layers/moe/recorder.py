"""Expert load accounting (``--expert-distribution-recorder-mode stat``): tokens per MoE layer
per physical expert slot, counted on the routing this rank is responsible for.

The recorder is an observer of the model's ``MoEContext`` (``layer.py`` calls it with the
logical ids [T, K] of the routing it counts): every (token, k) pair counts 1 on the slot that
``to_physical`` sends it to, so the counts are exact per copy of an expert, and the logical
counts are the sums over the copies. Who counts what: with the ``none`` backend every rank of a
stage routes the same gathered tokens and only tp rank 0 observes; with ``torch`` each rank
observes its own share; a pipeline stage observes its own layers. A server's totals are
therefore the sum of every rank's counts (``server/expert_api.py`` gathers them).

Cost per MoE layer per step: a gather (plus a sort when the layer has copies) and one
``torch.bincount`` added into an int64 [layers, slots] tensor; no Python per token.

Two views: ``counts`` since start-up (the Prometheus counters), and the record window that
``start`` / ``stop`` / ``dump`` control (SGLang's ``/start_expert_distribution_record`` and
friends): a dump returns the window and starts a new one.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from pdserve.layers.moe.placement import ExpertPlacement, MoEModelInfo, imbalance, to_physical


class ExpertRecorder:
    def __init__(self, info: MoEModelInfo, placement: ExpertPlacement):
        self.info = info
        self.placement = placement
        # [num_layers, slots]: tokens since start-up (rows of layers counted elsewhere stay 0)
        self.counts = torch.zeros(
            (info.num_layers, placement.num_slots), dtype=torch.int64, device="cpu"
        )
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.recording = False
        self._since: Optional[torch.Tensor] = None  # counts at the window's start (None: no window)
        self._until: Optional[torch.Tensor] = None  # counts at stop

    def observe(self, layer_id: int, ids: torch.Tensor) -> None:
        if self.counts.device != ids.device:  # count where the routing runs: no copy per layer
            self.counts = self.counts.to(ids.device)
        table = self._tables.get(layer_id)
        if table is None:
            with torch.device("cpu"):
                copies, n = self.placement.dispatch_table(layer_id)
            table = self._tables[layer_id] = (copies.to(ids.device), n.to(ids.device))
        slots = to_physical(ids, *table)
        self.counts[layer_id] += torch.bincount(
            slots.reshape(-1), minlength=self.placement.num_slots
        )

    # ---- the record window ---------------------------------------------------------------------
    def snapshot(self) -> torch.Tensor:
        """The counts since start-up, on the CPU."""
        return self.counts.to("cpu", copy=True)

    def start(self) -> None:
        self._since, self._until = self.snapshot(), None
        self.recording = True

    def stop(self) -> None:
        if self.recording:
            self._until = self.snapshot()
        self.recording = False

    def window(self) -> torch.Tensor:
        """[num_layers, slots] tokens of the record window (zeros before the first start)."""
        if self._since is None:
            return torch.zeros(self.counts.shape, dtype=torch.int64)
        end = self.snapshot() if self.recording else self._until
        return end - self._since

    def restart_window(self) -> None:
        """After a dump: the next window starts now (empty while stopped)."""
        if self._since is not None:
            self._since = self.snapshot() if self.recording else self._until.clone()

    # ---- what this rank reports --------------------------------------------------------------
    def report(self, window: bool) -> dict:
        """This rank's slot counts and placement of its stage's MoE layers (JSON-ready)."""
        counts = self.window() if window else self.snapshot()
        layers = sorted(self.placement.physical_to_logical)
        return {
            "counts": {str(layer): counts[layer].tolist() for layer in layers},
            "placement": {
                str(layer): self.placement.physical_to_logical[layer] for layer in layers
            },
        }

    def summary(self, counts: dict[int, list[int]], placement: dict[int, list[int]]) -> dict:
        """Per MoE layer, from every rank's reports (slot counts summed, each stage's placement):
        logical counts, slot counts, tokens per EP rank and their imbalance."""
        local = self.placement
        p = ExpertPlacement(self.info.num_experts, local.ep_size, placement, local.num_redundant)
        out: dict[str, dict[str, Any]] = {
            "logical_count": {},
            "physical_count": {},
            "placement": {},
            "rank_load": {},
            "imbalance": {},
        }
        for layer in sorted(counts):
            key, slots = str(layer), counts[layer]
            loads = p.rank_loads(layer, slots)
            out["logical_count"][key] = p.logical_counts(layer, slots)
            out["physical_count"][key] = slots
            out["placement"][key] = placement[layer]
            out["rank_load"][key] = loads
            out["imbalance"][key] = round(imbalance(loads), 6)
        return out
