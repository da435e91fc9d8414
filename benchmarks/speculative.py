"""Decode speed with n-gram speculation against without, on the demo model and one core.

  python benchmarks/speculative.py [--core 1] [--rounds 2] [--new-tokens 96] [--batches 1,8]
      [--drafts 4] [--json OUT]

Two ``pdserve.Engine`` s of the demo model (SmolLM2-135M-Instruct, bf16, prefix cache off), one
plain and one with ``--speculative-algorithm NGRAM --speculative-num-draft-tokens DRAFTS``, each
with one torch thread, the process pinned to ``--core``. Prompt sets, chat-formatted:

- ``summarize``: asked to summarise a passage and quote its key sentences (the answer copies);
- ``code-edit``: asked to rename a variable in a function and give the whole function back;
- ``random``: random token ids, no chat template (drafts rarely match: speculation must not cost).

For every set and batch size (the set's prompts cycled to the batch), both engines generate
``--new-tokens`` greedy tokens per request (``ignore_eos``), alternately for ``--rounds`` rounds;
decode speed = generated tokens after the first / time after the first step (the prefill and
first token are timed apart and excluded). Reported: tokens/s of each, their ratio, the mean
tokens per verify step (acceptance length), and whether the outputs were identical (they must
be: greedy verification keeps the plain tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import lscpu_model  # noqa: E402

PASSAGE = (
    "The river town grew around a wooden bridge that was rebuilt three times in a century. "
    "Each flood carried part of it away, and each time the townspeople argued about whether to "
    "build in stone. Stone was expensive and the quarry was two days away by cart. In the end a "
    "merchant paid for the stone bridge on the condition that it carry his name. The bridge has "
    "stood for ninety years, and most people in the town no longer know who the merchant was."
)
CODE = """def mean_of_positive(values):
    total = 0
    count = 0
    for v in values:
        if v > 0:
            total += v
            count += 1
    if count == 0:
        return 0.0
    return total / count
"""
SETS = {
    "summarize": [
        f"Summarise this passage in three sentences, quoting its key sentences word for word:\n\n{PASSAGE}",
        f"Repeat the following passage exactly, then give it a title:\n\n{PASSAGE}",
    ],
    "code-edit": [
        f"Rename the variable `total` to `acc` in this function and return the whole function:\n\n{CODE}",
        f"Add a docstring to this function and return the whole function:\n\n{CODE}",
    ],
}


def prompts_for(name: str, tokenizer, n: int) -> list[list[int]]:
    if name == "random":
        rng = random.Random(0)
        return [[rng.randrange(100, 40000) for _ in range(120)] for _ in range(n)]
    chats = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for text in SETS[name]
    ]
    return [list(chats[i % len(chats)]) for i in range(n)]


def timed(eng, prompts: list[list[int]], new: int) -> tuple[float, list, dict]:
    """(decode tokens/s after the first token, outputs, speculation counters)."""
    sched = eng.scheduler
    before = dict(sched.stats)
    first = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}
    eng.generate(input_ids=prompts, sampling_params=first)  # warm the same shapes' prefill
    t0 = time.perf_counter()
    outs = eng.generate(
        input_ids=prompts,
        sampling_params={"temperature": 0, "max_new_tokens": new, "ignore_eos": True},
    )
    total = time.perf_counter() - t0
    t1 = time.perf_counter()
    eng.generate(input_ids=prompts, sampling_params=first)
    prefill = time.perf_counter() - t1
    counters = {k: sched.stats[k] - before[k] for k in sched.stats}
    return len(prompts) * (new - 1) / max(total - prefill, 1e-9), outs, counters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--core", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--drafts", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    import pdserve
    from pdserve.models.demo import ensure_demo_model

    path = ensure_demo_model()
    common = dict(model_path=path, torch_num_threads=1, dtype="bfloat16", disable_radix_cache=True)
    plain = pdserve.Engine(**common)
    spec = pdserve.Engine(
        **common, speculative_algorithm="NGRAM", speculative_num_draft_tokens=args.drafts
    )
    rows = []
    for name in ("summarize", "code-edit", "random"):
        for batch in (int(b) for b in args.batches.split(",")):
            prompts = prompts_for(name, plain.tokenizer, batch)
            speeds: dict[str, list[float]] = {"plain": [], "ngram": []}
            same, steps, accepted = True, 0, 0
            for r in range(args.rounds):
                order = [("plain", plain), ("ngram", spec)]
                for label, eng in order if r % 2 == 0 else order[::-1]:
                    tps, outs, counters = timed(eng, prompts, args.new_tokens)
                    speeds[label].append(tps)
                    if label == "plain":
                        ref = [o["output_ids"] for o in outs]
                    else:
                        got = [o["output_ids"] for o in outs]
                        steps += counters["spec_verify_steps"]
                        accepted += counters["spec_accepted_tokens"]
                same = same and got == ref
            row = {
                "set": name,
                "batch": batch,
                "plain_tok_s": statistics.median(speeds["plain"]),
                "ngram_tok_s": statistics.median(speeds["ngram"]),
                "accept_length": (steps + accepted) / steps if steps else None,
                "identical": same,
            }
            row["ratio"] = row["ngram_tok_s"] / row["plain_tok_s"]
            rows.append(row)
            print(
                f"{name:10s} batch {batch:2d}: plain {row['plain_tok_s']:7.1f} tok/s, "
                f"ngram {row['ngram_tok_s']:7.1f} tok/s, ratio {row['ratio']:.2f}, "
                f"tokens/step {row['accept_length'] or 0:.2f}, identical {same}",
                flush=True,
            )
    info = {"cpu": lscpu_model(), "machine": platform.machine(), "args": vars(args), "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
