"""Decode speed with speculation against without, on the demo model and one core.

  python benchmarks/speculative.py [--core 1] [--rounds 2] [--new-tokens 96] [--batches 1,8]
      [--drafts 4] [--algorithms ngram,standalone] [--draft-keep "0-5;0-11,18-29"] [--json OUT]

``pdserve.Engine`` s of the demo model (SmolLM2-135M-Instruct, bf16, prefix cache off): one
plain, one with ``--speculative-algorithm NGRAM --speculative-num-draft-tokens DRAFTS`` and one
per ``--draft-keep`` entry with ``--speculative-algorithm STANDALONE`` whose draft is those of the
demo model's layers with its final norm and head (``pdserve.models.truncate``: there is no
smaller trained model of this tokenizer here), each with one torch thread, the process pinned to
``--core``. Prompt sets, chat-formatted:

- ``summarize``: asked to summarise a passage and quote its key sentences (the answer copies);
- ``code-edit``: asked to rename a variable in a function and give the whole function back;
- ``random``: random token ids, no chat template (drafts rarely match: speculation must not cost).

For every set and batch size (the set's prompts cycled to the batch), the engines generate
``--new-tokens`` greedy tokens per request (``ignore_eos``), in turn (the order rotating) for
``--rounds`` rounds;
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
        "Summarise this passage in three sentences, "
        f"quoting its key sentences word for word:\n\n{PASSAGE}",
        f"Repeat the following passage exactly, then give it a title:\n\n{PASSAGE}",
    ],
    "code-edit": [
        "Rename the variable `total` to `acc` in this function and return the whole "
        f"function:\n\n{CODE}",
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
    ap.add_argument("--algorithms", default="ngram,standalone")
    ap.add_argument("--draft-keep", default="0-5;0-11,18-29")
    ap.add_argument("--json")
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    import pdserve
    from pdserve.models.demo import ensure_demo_model

    path = ensure_demo_model()
    common = dict(model_path=path, torch_num_threads=1, dtype="bfloat16", disable_radix_cache=True)
    engines = {"plain": pdserve.Engine(**common)}
    algorithms = args.algorithms.split(",")
    if "ngram" in algorithms:
        engines["ngram"] = pdserve.Engine(
            **common, speculative_algorithm="NGRAM", speculative_num_draft_tokens=args.drafts
        )
    if "standalone" in algorithms:
        from pdserve.models.truncate import keep_layers, parse_ranges

        for keep in args.draft_keep.split(";"):
            draft = os.path.join(os.path.dirname(path), f"draft-{keep.replace(',', '_')}")
            if not os.path.exists(os.path.join(draft, "model.safetensors")):
                keep_layers(path, draft, parse_ranges(keep))
            engines[f"standalone[{keep}]"] = pdserve.Engine(
                **common,
                speculative_algorithm="STANDALONE",
                speculative_draft_model_path=draft,
                speculative_num_draft_tokens=args.drafts,
            )
    labels = list(engines)
    rows = []
    for name in ("summarize", "code-edit", "random"):
        for batch in (int(b) for b in args.batches.split(",")):
            prompts = prompts_for(name, engines["plain"].tokenizer, batch)
            speeds: dict[str, list[float]] = {label: [] for label in labels}
            outputs: dict[str, list] = {}
            counts = {label: [0, 0] for label in labels}  # verify steps, accepted drafts
            same = True
            for r in range(args.rounds):
                for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
                    tps, outs, counters = timed(engines[label], prompts, args.new_tokens)
                    speeds[label].append(tps)
                    outputs[label] = [o["output_ids"] for o in outs]
                    counts[label][0] += counters["spec_verify_steps"]
                    counts[label][1] += counters["spec_accepted_tokens"]
                same = same and all(outputs[k] == outputs["plain"] for k in labels)
            row = {"set": name, "batch": batch, "identical": same}
            line = (
                f"{name:10s} batch {batch:2d}: plain {statistics.median(speeds['plain']):6.1f} "
                "tok/s"
            )
            for label in labels:
                row[f"{label}_tok_s"] = statistics.median(speeds[label])
                if label == "plain":
                    continue
                steps, accepted = counts[label]
                row[f"{label}_ratio"] = row[f"{label}_tok_s"] / row["plain_tok_s"]
                row[f"{label}_accept_length"] = (steps + accepted) / steps if steps else None
                line += (
                    f", {label} {row[f'{label}_tok_s']:6.1f} tok/s (x{row[f'{label}_ratio']:.2f}, "
                    f"{row[f'{label}_accept_length'] or 0:.2f} tokens/step)"
                )
            rows.append(row)
            print(line + f", identical {same}", flush=True)
    info = {"cpu": lscpu_model(), "machine": platform.machine(), "args": vars(args), "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
