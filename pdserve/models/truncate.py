"""A model's first layers as a checkpoint of its own, with its embeddings, final norm and head:
a draft for speculative decoding (``--speculative-algorithm STANDALONE``) where no smaller trained
model of the same tokenizer exists.

    python -m pdserve.models.truncate SRC DST --layers N
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil

_LAYER = re.compile(r"\.layers\.(\d+)\.")
# per-layer lists some configs hold (cut to the kept layers)
_PER_LAYER = ("layer_types", "sliding_window_pattern_list", "mlp_only_layers")


def first_layers(src: str, dst: str, layers: int) -> str:
    """Write ``src``'s first ``layers`` layers to ``dst`` (config, safetensors, tokenizer)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    total = config.get("num_hidden_layers")
    if not isinstance(total, int) or not 1 <= layers <= total:
        raise ValueError(f"layers: must be in [1, {total}] for {src!r}, got {layers}")
    config["num_hidden_layers"] = layers
    for key in _PER_LAYER:
        if isinstance(config.get(key), list) and len(config[key]) == total:
            config[key] = config[key][:layers]
    tensors = {}
    for path in sorted(glob.glob(os.path.join(src, "*.safetensors"))):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                m = _LAYER.search(name)
                if m is None or int(m.group(1)) < layers:
                    tensors[name] = f.get_tensor(name)
    os.makedirs(dst, exist_ok=True)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in os.listdir(src):
        if name.endswith((".safetensors", ".safetensors.index.json")) or name == "config.json":
            continue
        if os.path.isfile(os.path.join(src, name)):  # tokenizer, generation config, template
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    return dst


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--layers", type=int, required=True)
    a = p.parse_args(argv)
    print(first_layers(a.src, a.dst, a.layers))


if __name__ == "__main__":
    main()
