"""A Jamba-shaped model against a dense Llama of the same width and active size, side by side in
one run.

  python benchmarks/jamba.py [--contexts 1024,8192] [--batches 1,16] [--max-batch-tokens 33000]
      [--threads 1] [--dtype bfloat16] [--steps 8] [--json OUT]

The Jamba model has Jamba's layout at a CPU's scale (``JambaForCausalLM``): hidden 768, 16 layers,
attention (12 query heads, 4 KV heads of 64, no positions) on one layer in eight (layers 4 and 12)
and Mamba version 1 mixers on the others (inner size 1,536, state 16, convolution 4, time step rank
48), a sparse MLP on every other layer (16 experts of 1,024, top 2) and a dense one (1,024) on the
rest. The dense model is a Llama of the same width and depth whose MLP (1,536) is the Jamba layers'
mean active size. Both use the SmolLM2 vocabulary and random weights (``--load-format dummy``),
through the offline ``pdserve.Engine`` (``--threads`` torch threads), one model after the other:
prefill tok/s of one prompt per context, decode tok/s per batch and context (the median of the
decode-only forwards), and the cache a request holds at each context (``benchmarks/hybrid.py``).
The Mamba layers run in torch (no C++ kernel yet): their extend is a token-by-token recurrence.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import hybrid  # noqa: E402

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 768, 16, 12, 4, 64
EXPERTS, MLP = 16, 1024


def model_dirs(dtype: str) -> dict[str, str]:
    import transformers

    common = dict(
        vocab_size=49152,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=262144,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
        dtype=dtype,
    )
    configs = {
        "jamba": (
            transformers.JambaConfig(
                **common,
                intermediate_size=MLP,
                num_experts=EXPERTS,
                num_experts_per_tok=2,
                attn_layer_period=8,
                attn_layer_offset=4,
                expert_layer_period=2,
                expert_layer_offset=1,
                mamba_d_state=16,
                mamba_d_conv=4,
                mamba_expand=2,
                mamba_dt_rank=HIDDEN // 16,
            ),
            "JambaForCausalLM",
        ),
        "dense": (
            transformers.LlamaConfig(**common, head_dim=HEAD_DIM, intermediate_size=3 * MLP // 2),
            "LlamaForCausalLM",
        ),
    }
    return hybrid.config_dirs(configs, "jamba-layout")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--max-batch-tokens", type=int, default=33000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args()
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    dirs = model_dirs(args.dtype)
    result = {
        "command": " ".join(sys.argv),
        "machine": subprocess.run(["lscpu"], capture_output=True, text=True).stdout,
        "python": platform.python_version(),
        "runs": [hybrid.run_engine(name, path, args) for name, path in dirs.items()],
    }
    jamba, dense = result["runs"]
    for kind in ("prefill", "decode"):
        for j, d in zip(jamba[kind], dense[kind]):
            print(
                f"{kind} {j.get('batch', 1)}x{j['context']}: jamba {j['tok_s']:.1f} tok/s, "
                f"dense {d['tok_s']:.1f} tok/s, ratio {j['tok_s'] / d['tok_s']:.2f}"
            )
    for j, d in zip(jamba["cache"], dense["cache"]):
        print(
            f"cache per request at {j['context']}: jamba {j['total'] / 2**20:.2f} MiB "
            f"(state {j['state_bytes'] / 2**20:.2f}), dense {d['total'] / 2**20:.2f} MiB, "
            f"ratio {j['total'] / d['total']:.3f}"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
