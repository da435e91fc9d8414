"""The LoRA adapters one scheduler rank holds: each adapter's (A, B) pairs cut to this rank's share
and attached to the linear layers they adapt (``layer.LinearLora``), under a slot number the
forward's rows name (``layer.active``). Loading and unloading happen between forwards, on every
rank of the server for the same call."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pdserve.layers.linear import Linear, MergedLinear, RowParallelLinear
from pdserve.lora.adapter import Adapter, AdapterError, read_adapter
from pdserve.lora.layer import LinearLora
from pdserve.models.weights import FUSED

logger = logging.getLogger(__name__)

# what a LoRA may not adapt here: the vocabulary's rows (embeddings, the head)
NOT_ADAPTED = ("embed_tokens", "lm_head")


@dataclass
class Loaded:
    adapter: Adapter
    slot: int


class LoraManager:
    def __init__(self, model: torch.nn.Module, max_rank: int, max_loaded: int):
        self.model = model
        self.shards = model.shards
        self.max_rank = max_rank
        self.max_loaded = max_loaded
        self.loaded: dict[str, Loaded] = {}
        self.names: dict[int, str] = {}  # namespace key -> adapter name (the KV events')
        self.modules = dict(model.named_modules())

    # ---- what requests see ----------------------------------------------------------------
    def slot(self, name: str) -> int:
        """The slot of adapter ``name`` (KeyError naming the loaded ones otherwise)."""
        if name not in self.loaded:
            have = ", ".join(sorted(self.loaded)) or "none"
            raise KeyError(f"LoRA adapter {name!r} is not loaded here (loaded: {have})")
        return self.loaded[name].slot

    def namespace_key(self, name: str) -> int:
        return self.loaded[name].adapter.namespace_key

    def describe(self) -> list[dict]:
        return [
            {"name": n, "path": x.adapter.path, "rank": x.adapter.rank, "digest": x.adapter.digest}
            for n, x in sorted(self.loaded.items())
        ]

    # ---- load / unload ----------------------------------------------------------------------
    def load(self, name: str, path: str) -> Adapter:
        if name in self.loaded:
            raise AdapterError(f"LoRA adapter {name!r} is already loaded (unload it first)")
        if len(self.loaded) >= self.max_loaded:
            raise AdapterError(
                f"LoRA adapter {name!r}: {len(self.loaded)} adapters are loaded, the most "
                f"--max-loaded-loras allows"
            )
        adapter = read_adapter(name, path, self.max_rank)
        used = {x.slot for x in self.loaded.values()}
        slot = next(i for i in range(len(used) + 1) if i not in used)
        placed: list[LinearLora] = []
        try:
            for module_path, (a, b) in adapter.modules.items():
                target = self._place(adapter, module_path, a, b, slot)
                if target is not None:
                    placed.append(target)
        except (AdapterError, ValueError) as e:
            for target in placed:
                target.drop(slot)
            raise AdapterError(str(e)) from None
        self.loaded[name] = Loaded(adapter, slot)
        self.names[adapter.namespace_key] = name
        logger.info(
            "LoRA adapter %s loaded from %s (rank %d, slot %d)", name, path, adapter.rank, slot
        )
        return adapter

    def unload(self, name: str) -> None:
        self.slot(name)  # KeyError naming it
        gone = self.loaded.pop(name)
        self.names.pop(gone.adapter.namespace_key, None)
        slot = gone.slot
        for module in self.modules.values():
            lora = getattr(module, "lora", None)
            if lora is not None:
                lora.drop(slot)
        logger.info("LoRA adapter %s unloaded", name)

    def _place(self, adapter: Adapter, module_path: str, a, b, slot: int):
        """Attach one module's pair to this rank's layer; None where the layer is another
        pipeline stage's."""
        where = f"LoRA adapter {adapter.name!r}: module {module_path!r}"
        weight = f"{module_path}.weight"
        own = getattr(self.model, "own_weight_name", None)
        name = own(weight) if own is not None else weight
        if name is None or any(n in module_path.split(".") for n in NOT_ADAPTED):
            raise AdapterError(f"{where}: only the model's linear layers can be adapted")
        if not self.shards.holds(name):
            return None
        path = name.removesuffix(".weight")
        module, part = self.modules.get(path), 0
        parent, _, proj = path.rpartition(".")
        if not isinstance(module, Linear) and proj in FUSED:
            merged, part = FUSED[proj]
            module = self.modules.get(f"{parent}.{merged}")
            if not isinstance(module, MergedLinear):
                module = None
        if not isinstance(module, Linear):
            raise AdapterError(f"{where}: not a linear layer of this model that LoRA can adapt")
        if isinstance(module, RowParallelLinear):  # this rank's input columns of A, B whole
            a = self.shards.shard(name, a)
        else:  # this rank's output rows of B, A whole
            b = self.shards.shard(name, b)
        if a.shape[1] != module.in_features:
            raise AdapterError(
                f"{where}: A takes {a.shape[1]} inputs here, the layer {module.in_features}"
            )
        if module.lora is None:
            sizes = (
                module.output_sizes if isinstance(module, MergedLinear) else [module.out_features]
            )
            module.lora = LinearLora(sizes)
        module.lora.set(slot, part, a.contiguous(), b.contiguous())
        return module.lora
