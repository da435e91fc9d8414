"""A PEFT LoRA adapter as saved by ``save_pretrained``: ``adapter_config.json`` and
``adapter_model.safetensors`` with, per adapted module, ``<module>.lora_A.weight`` [r, in] and
``<module>.lora_B.weight`` [out, r], named under ``base_model.model.``. What pdserve does not run is
refused at load, naming the field: DoRA, trained biases, extra trained modules, per-module ranks
above ``--max-lora-rank``, embeddings and heads as targets."""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass

import torch

from pdserve.kv_events import lora_namespace

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


class AdapterError(ValueError):
    """The adapter cannot be served; the message names the adapter and the reason."""


@dataclass
class Adapter:
    name: str
    path: str
    rank: int
    # module path (the base checkpoint's name, without ".weight") -> (A [r, in], B [out, r] with
    # the scaling folded in), float32
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]
    digest: str  # of the adapter's files: the same adapter keys the same cache namespace

    @property
    def namespace_key(self) -> int:
        """What the adapter adds to the prefix cache's namespace (from the digest)."""
        return lora_namespace(self.digest.encode())


def read_adapter(name: str, path: str, max_rank: int) -> Adapter:
    """The adapter at ``path`` (a local PEFT directory), or AdapterError naming what is wrong."""
    where = f"LoRA adapter {name!r} ({path})"
    config_file = os.path.join(path, CONFIG)
    weights_file = os.path.join(path, WEIGHTS)
    if not os.path.isfile(config_file) or not os.path.isfile(weights_file):
        raise AdapterError(f"{where}: a PEFT adapter directory needs {CONFIG} and {WEIGHTS}")
    with open(config_file, "rb") as f:
        raw_config = f.read()
    try:
        config = json.loads(raw_config)
    except ValueError as e:
        raise AdapterError(f"{where}: {CONFIG} is not JSON ({e})") from None
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{where}: peft_type {config.get('peft_type')!r} is not LORA")
    for field, allowed in (("use_dora", (False, None)), ("bias", ("none", None))):
        if config.get(field) not in allowed:
            raise AdapterError(f"{where}: {field}={config.get(field)!r} is not supported")
    if config.get("modules_to_save"):
        raise AdapterError(
            f"{where}: modules_to_save {config['modules_to_save']} (fully trained modules) "
            "is not supported"
        )
    if config.get("fan_in_fan_out"):
        raise AdapterError(f"{where}: fan_in_fan_out is not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise AdapterError(
            f"{where}: per-module ranks (rank_pattern, alpha_pattern) are not supported"
        )
    rank, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    if not 1 <= rank <= max_rank:
        raise AdapterError(f"{where}: rank r={rank} is outside [1, --max-lora-rank {max_rank}]")
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)

    from safetensors.torch import load_file

    tensors = load_file(weights_file)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, _, leaf = key.removeprefix(PREFIX).rpartition(".lora_")
        if leaf not in ("A.weight", "B.weight") or not module:
            raise AdapterError(f"{where}: tensor {key!r} is not a LoRA A or B weight")
        pairs.setdefault(module, {})[leaf[0]] = tensor.float()
    modules = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{where}: module {module!r} has lora_{''.join(ab)} only")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise AdapterError(
                f"{where}: module {module!r} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                f"not [r={rank}, in] and [out, r={rank}]"
            )
        modules[module] = (a.contiguous(), (b * scaling).contiguous())
    if not modules:
        raise AdapterError(f"{where}: no LoRA weights in {WEIGHTS}")
    h = hashlib.sha256(raw_config)
    with open(weights_file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return Adapter(name, path, rank, modules, h.hexdigest())
