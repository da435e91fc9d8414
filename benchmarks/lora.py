"""LoRA decode cost: a batch's decode step with 1, 4 and 16 adapters mixed in it, against the base
model alone, side by side in one run.

  python benchmarks/lora.py [--batches 1,16] [--adapters 1,4,16] [--rank 16] [--threads 1]
      [--dtype bfloat16] [--steps 24] [--repeats 3] [--json OUT]

The base is a Llama of hidden 1024 (8 layers, 16 query heads and 8 KV heads of 64, MLP 2816,
the SmolLM2 vocabulary of 49,152), random weights (``--load-format dummy``) in ``--dtype``; the
adapters are PEFT LoRA adapters of rank ``--rank`` on all seven projections (q, k, v, o, gate,
up, down), written by PEFT with random A and B. One ``pdserve.Engine`` holds all of them; for each
batch size B and each adapter count N, B requests (64-token prompts, ``--steps`` + 1 new tokens)
run with their adapters assigned round-robin from N of them (N = 0: the base model for every
request). The decode step is the median time of the runner's decode-only forwards; the
configurations alternate, ``--repeats`` times, and the table gives each one's median step, its
tok/s (B / step) and its ratio to the base model's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.hybrid import ForwardClock, config_dirs, prompts  # noqa: E402

HIDDEN, LAYERS, HEADS, KV_HEADS, MLP = 1024, 8, 16, 8, 2816
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def base_dir(dtype: str) -> str:
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        intermediate_size=MLP,
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
        dtype=dtype,
    )
    return config_dirs({"base": (cfg, "LlamaForCausalLM")}, "lora-1024")["base"]


def adapter_dirs(base: str, count: int, rank: int) -> list[str]:
    """``count`` PEFT adapters over the base's shapes (random, made once under the temp dir)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    out = [
        os.path.join(tempfile.gettempdir(), f"pdserve-bench-lora-r{rank}-{i}") for i in range(count)
    ]
    missing = [d for d in out if not os.path.exists(os.path.join(d, "adapter_model.safetensors"))]
    if missing:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base))
        for i, d in enumerate(out):
            if d not in missing:
                continue
            torch.manual_seed(i)
            peft = get_peft_model(
                model,
                LoraConfig(
                    r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False
                ),
            )
            peft.save_pretrained(d)
            model = peft.unload()
    return out


def lscpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return platform.processor()
    keep = ("Model name", "CPU family", "Model:", "CPU(s):", "Flags")
    return "\n".join(line for line in out.splitlines() if line.startswith(keep))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--adapters", default="1,4,16")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    counts = [0] + [int(x) for x in args.adapters.split(",")]

    import pdserve

    base = base_dir(args.dtype)
    adapters = adapter_dirs(base, max(counts), args.rank)
    eng = pdserve.Engine(
        model_path=base,
        load_format="dummy",
        dtype=args.dtype,
        torch_num_threads=args.threads,
        max_total_tokens=max(batches) * 128 + 4096,
        max_running_requests=max(batches),
        disable_radix_cache=True,
        lora_paths=[f"a{i}={d}" for i, d in enumerate(adapters)],
        max_loaded_loras=max(len(adapters), 1),
    )
    clock = ForwardClock(eng.scheduler.runner)
    sp = {"temperature": 0, "max_new_tokens": args.steps + 1, "ignore_eos": True}
    eng.generate(input_ids=prompts(2, 16, 0), sampling_params=sp, lora_path=[None, "a0"])
    steps: dict[tuple[int, int], list[float]] = {(b, n): [] for b in batches for n in counts}
    for rep in range(args.repeats):
        for b in batches:
            for n in counts:
                names = [None if n == 0 else f"a{i % n}" for i in range(b)]
                clock.decode.clear()
                eng.generate(input_ids=prompts(b, 64, rep), sampling_params=sp, lora_path=names)
                steps[b, n].append(statistics.median(clock.decode))
                print(f"batch {b}, {n} adapters: {steps[b, n][-1] * 1e3:.1f} ms", file=sys.stderr)
    rows = []
    for b in batches:
        base_step = statistics.median(steps[b, 0])
        for n in counts:
            step = statistics.median(steps[b, n])
            rows.append(
                {
                    "batch": b,
                    "adapters": n,
                    "step_ms": step * 1e3,
                    "tok_s": b / step,
                    "vs_base": base_step / step,
                }
            )
    print(f"{lscpu()}\nrank {args.rank}, {args.threads} thread(s), {args.dtype}\n")
    print("| batch | adapters in it | decode step ms | tok/s | tok/s vs base |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['adapters'] or 'none (base)'} | {r['step_ms']:.1f} | "
            f"{r['tok_s']:.1f} | {r['vs_base']:.2f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
