"""Random-weight HF checkpoints of realistic size for the benchmarks: written one safetensors shard
per decoder layer (memory stays at one layer's weights) into a temporary directory, published by a
rename once complete, with the SmolLM2 tokenizer (the models' own are not available offline)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def write_sharded(
    out: Path, config: dict, layer_tensors: Callable[[int], dict], top_tensors: Callable[[], dict]
) -> Path:
    """``out`` with ``config``'s ``num_hidden_layers`` shards of ``layer_tensors(i)`` and one of
    ``top_tensors()`` (embedding, final norm, LM head); returns ``out`` (built once)."""
    from safetensors.torch import save_file

    from tests.helpers.checkpoints import smollm2_tokenizer_dir

    if (out / "model.safetensors.index.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        n = config["num_hidden_layers"]
        names = [f"model-{k + 1:05d}-of-{n + 1:05d}.safetensors" for k in range(n + 1)]
        weight_map, total = {}, 0
        for k in range(n + 1):
            tensors = layer_tensors(k) if k < n else top_tensors()
            save_file(tensors, str(tmp / names[k]), metadata={"format": "pt"})
            for name, t in tensors.items():
                weight_map[name] = names[k]
                total += t.numel() * t.element_size()
            print(f"wrote {names[k]} ({len(tensors)} tensors)", file=sys.stderr, flush=True)
            del tensors
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
        )
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(
            json.dumps({"bos_token_id": 1, "eos_token_id": 2})
        )
        for f in Path(smollm2_tokenizer_dir()).iterdir():
            if not f.name.startswith("."):
                shutil.copy(f, tmp / f.name)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
