"""A Llama-4-shaped model against a dense Llama of the same width and active size, side by side in
one run.

  python benchmarks/llama4.py [--contexts 1024,8192] [--batches 1,16] [--max-batch-tokens 33000]
      [--threads 1] [--dtype bfloat16] [--steps 8] [--cache-contexts 1000,8000,30000,130000]
      [--dense-by-layer] [--json OUT]

The Llama 4 model has Scout's layout at a CPU's scale (``Llama4ForCausalLM``): hidden 768, 16
layers, 12 query heads and 4 KV heads of 64, every layer sparse (16 experts of 512, top 1, the
sigmoid weight on the expert's input, a shared expert of 512), RoPE with attention chunks of 8,192
on three layers in four and the fourth without RoPE, seeing every key. The dense model is a Llama of
the same width and depth whose MLP (1,024) has the Llama 4 layer's active size (the shared expert
and one routed expert). Both use the SmolLM2 vocabulary and random weights (``--load-format
dummy``), through the offline ``pdserve.Engine`` (``--threads`` torch threads), one model after the
other: prefill tok/s of one prompt per context, decode tok/s per batch and context (the median of
the decode-only forwards, ``benchmarks/hybrid.py``'s clock), and the cache a request holds while
its next token is computed at each of ``--cache-contexts``, by the engine's own cache specs
(``CacheSpec.pages_kept``: a chunked layer keeps only its current chunk's pages). With
``--dense-by-layer`` the dense model runs a third time without its C++ decode stack (the whole
decoder step in one kernel call, which the MoE families do not have), layer by layer as the Llama 4
model runs.
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
EXPERTS, EXPERT_MLP, CHUNK = 16, 512, 8192


def model_dirs(dtype: str) -> dict[str, str]:
    import transformers

    common = dict(
        vocab_size=49152,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=262144,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
        dtype=dtype,
    )
    configs = {
        "llama4": (
            transformers.Llama4TextConfig(
                **common,
                intermediate_size=EXPERT_MLP,
                intermediate_size_mlp=2 * EXPERT_MLP,
                num_local_experts=EXPERTS,
                num_experts_per_tok=1,
                interleave_moe_layer_step=1,
                attention_chunk_size=CHUNK,
                rope_parameters=dict(rope_type="default", rope_theta=500000.0),
            ),
            "Llama4ForCausalLM",
        ),
        "dense": (
            transformers.LlamaConfig(
                **common, intermediate_size=2 * EXPERT_MLP, rope_theta=500000.0
            ),
            "LlamaForCausalLM",
        ),
    }
    return hybrid.config_dirs(configs, "llama4-scout-layout")


def cache_bytes(runner, context: int) -> dict:
    """Bytes a request of ``context`` tokens holds while its next token is computed, per group
    kind, from the engine's cache specs and pools."""
    page = runner.args.page_size
    out: dict = {}
    for g, pool in zip(runner.cache_groups, runner.pools):
        item = pool.nbytes // pool.num_pages  # a page of every layer of the group
        out[g.kind] = out.get(g.kind, 0) + g.spec.pages_kept(context, page) * item
    out["total"] = sum(out.values())
    return out


def run_engine(name: str, path: str, args, stack: bool = True) -> dict:
    from pdserve import kernels
    from pdserve.models.llama import LlamaForCausalLM

    if not stack:  # the decoder layer by layer, as the MoE families run it
        LlamaForCausalLM.enable_decode_stack = lambda self, ops, batch_invariant=False: False
    out = hybrid.run_engine(name, path, args, cache_of=cache_bytes, cache_at=args.cache_contexts)
    ops = kernels.load()
    out["isa"] = ops.isa_tier() if ops is not None else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--max-batch-tokens", type=int, default=33000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--cache-contexts", default="1000,8000,30000,130000")
    ap.add_argument("--dense-by-layer", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    args.cache_contexts = [int(x) for x in args.cache_contexts.split(",")]
    dirs = model_dirs(args.dtype)
    result = {
        "command": " ".join(sys.argv),
        "machine": subprocess.run(["lscpu"], capture_output=True, text=True).stdout,
        "python": platform.python_version(),
        "runs": [run_engine(name, path, args) for name, path in dirs.items()],
    }
    if args.dense_by_layer:
        result["runs"].append(run_engine("dense-by-layer", dirs["dense"], args, stack=False))
    llama4, dense = result["runs"][:2]
    for kind in ("prefill", "decode"):
        for a, b in zip(llama4[kind], dense[kind]):
            print(
                f"{kind} {a.get('batch', 1)}x{a['context']}: llama4 {a['tok_s']:.1f} tok/s, "
                f"dense {b['tok_s']:.1f} tok/s, ratio {a['tok_s'] / b['tok_s']:.2f}"
            )
    if args.dense_by_layer:
        for a, b in zip(llama4["decode"], result["runs"][2]["decode"]):
            print(
                f"decode {a['batch']}x{a['context']}: llama4 {a['tok_s']:.1f} tok/s, dense layer "
                f"by layer {b['tok_s']:.1f} tok/s, ratio {a['tok_s'] / b['tok_s']:.2f}"
            )
    for a, b in zip(llama4["cache"], dense["cache"]):
        print(
            f"cache per request at {a['context']}: llama4 {a['total'] / 2**20:.1f} MiB "
            f"(chunked layers {a.get('chunked_attention', 0) / 2**20:.1f}), "
            f"dense {b['total'] / 2**20:.1f} MiB, ratio {a['total'] / b['total']:.2f}"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
