"""What a quantized KV cache (``--kv-cache-dtype int8 | fp8_e4m3 | fp8_e5m2``) costs in accuracy,
against a bf16 KV cache on the same model and compute dtype.

  python benchmarks/kv_quant_quality.py [--model-path DIR] [--dtype bfloat16] [--json out.json]

The engines run in this process (default: the demo model, SmolLM2-135M-Instruct, bf16 compute),
one per KV dtype, without the prefix cache:

- teacher-forced text: a fixed English text and the bf16-KV engine's greedy answers to chat
  questions are scored as prompts; at every position the top-1 token of each quantized engine is
  compared with the bf16-KV engine's, and the logprob each gives the text's next token (mean and
  max |difference|). In a prompt every key is read back from the cache, so each position sees
  the quantized K/V of all the positions before it.
- free-running greedy agreement on the chat questions: identical continuations, and where the
  first differing token comes.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quantization_quality import QUESTIONS, TEXT, chat_ids  # noqa: E402

FORMATS = ("int8", "fp8_e4m3", "fp8_e5m2")


def scored(eng, ids: list[int]) -> tuple[list[float], list[int]]:
    """Per position after the first: the logprob of the text's token and the engine's top-1."""
    out = eng.generate(
        input_ids=ids,
        sampling_params={"temperature": 0, "max_new_tokens": 1},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=1,
    )
    meta = out["meta_info"]
    given = [v for v, _, _ in meta["input_token_logprobs"][1:]]
    tops = [t[0][1] for t in meta["input_top_logprobs"][1:]]
    return given, tops


def teacher_forced(ref, cand, texts: list[list[int]]) -> dict:
    agree = total = 0
    errs = []
    for ids in texts:
        ref_lp, ref_top = scored(ref, ids)
        lp, top = scored(cand, ids)
        total += len(top)
        agree += sum(a == b for a, b in zip(top, ref_top))
        errs += [abs(a - b) for a, b in zip(lp, ref_lp)]
    return {
        "positions": total,
        "top1_agreement": round(agree / total, 4),
        "mean_abs_logprob_error": round(statistics.mean(errs), 5),
        "max_abs_logprob_error": round(max(errs), 4),
    }


def free_running(ref_outs, cand, prompts, new_tokens: int) -> dict:
    sp = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    outs = cand.generate(input_ids=prompts, sampling_params=sp)
    first = []
    for r, c in zip(ref_outs, outs):
        pairs = zip(r["output_ids"], c["output_ids"])
        first.append(next((i for i, (x, y) in enumerate(pairs) if x != y), new_tokens))
    return {
        "identical_continuations": f"{sum(f == new_tokens for f in first)}/{len(prompts)}",
        "first_divergence_median": statistics.median(first),
        "greedy_token_agreement": round(
            sum(
                x == y
                for r, c in zip(ref_outs, outs)
                for x, y in zip(r["output_ids"], c["output_ids"])
            )
            / (new_tokens * len(prompts)),
            4,
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-path", default=None, help="default: the demo model")
    ap.add_argument("--dtype", default="bfloat16", help="compute dtype of every engine")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--questions", type=int, default=12)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    import pdserve
    from pdserve.models.demo import ensure_demo_model

    path = a.model_path or ensure_demo_model()
    common = dict(
        model_path=path,
        dtype=a.dtype,
        torch_num_threads=1,
        max_total_tokens=32768,
        disable_radix_cache=True,
    )
    ref = pdserve.Engine(kv_cache_dtype="bfloat16", **common)
    prompts = [chat_ids(ref.tokenizer, q) for q in QUESTIONS[: a.questions]]
    sp = {"temperature": 0, "max_new_tokens": a.new_tokens, "ignore_eos": True}
    ref_outs = ref.generate(input_ids=prompts, sampling_params=sp)
    texts = [ref.tokenizer.encode(TEXT)] + [p + r["output_ids"] for p, r in zip(prompts, ref_outs)]
    result = {
        "model": path,
        "compute_dtype": a.dtype,
        "reference": "bfloat16 KV",
        "machine": platform.processor() or platform.machine(),
        "texts": len(texts),
        "new_tokens": a.new_tokens,
    }
    for fmt in FORMATS:
        cand = pdserve.Engine(kv_cache_dtype=fmt, **common)
        result[fmt] = {
            "teacher_forced": teacher_forced(ref, cand, texts),
            "free_running": free_running(ref_outs, cand, prompts, a.new_tokens),
        }
        cand.shutdown()
        print(fmt, json.dumps(result[fmt]), flush=True)
    print(json.dumps(result, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
