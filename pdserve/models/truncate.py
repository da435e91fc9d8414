"""Some of a model's layers as a checkpoint of its own, with its embeddings, final norm and
head: a draft for speculative decoding (``--speculative-algorithm STANDALONE``) where no smaller
trained model of the same tokenizer exists. The first N layers (``--layers N``), or any of them
(``--keep 0-7,22-29``: skipping middle layers keeps more of the model's predictions than cutting
its end, as in self-speculative decoding).

    python -m pdserve.models.truncate SRC DST --layers N | --keep RANGES
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
    return keep_layers(src, dst, list(range(layers)))


def parse_ranges(text: str) -> list[int]:
    """``"0-7,22-29"`` -> [0, ..., 7, 22, ..., 29]."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def keep_layers(src: str, dst: str, layers: list[int]) -> str:
    """Write ``src``'s layers ``layers`` (ascending, renumbered from 0) to ``dst``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    total = config.get("num_hidden_layers")
    if (
        not isinstance(total, int)
        or not layers
        or layers != sorted(set(layers))
        or not 0 <= layers[0] <= layers[-1] < total
    ):
        raise ValueError(
            f"layers: must be distinct ascending layers of [0, {total}) for {src!r}, got {layers}"
        )
    config["num_hidden_layers"] = len(layers)
    for key in _PER_LAYER:
        if isinstance(config.get(key), list) and len(config[key]) == total:
            config[key] = [config[key][i] for i in layers]
    new_id = {old: new for new, old in enumerate(layers)}
    tensors = {}
    for path in sorted(glob.glob(os.path.join(src, "*.safetensors"))):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                m = _LAYER.search(name)
                if m is None:
                    tensors[name] = f.get_tensor(name)
                elif int(m.group(1)) in new_id:
                    renamed = (
                        f"{name[: m.start()]}.layers.{new_id[int(m.group(1))]}.{name[m.end() :]}"
                    )
                    tensors[renamed] = f.get_tensor(name)
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
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--layers", type=int, help="the first N layers")
    which.add_argument("--keep", help="layers to keep, e.g. 0-7,22-29")
    a = p.parse_args(argv)
    keep = list(range(a.layers)) if a.layers is not None else parse_ranges(a.keep)
    print(keep_layers(a.src, a.dst, keep))


if __name__ == "__main__":
    main()
