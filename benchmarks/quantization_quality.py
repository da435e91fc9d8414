"""What ``--quantization w8a8_int8`` costs in accuracy, against bf16 on the same model.

  python benchmarks/quantization_quality.py [--model-path DIR] [--new-tokens 64] [--json out.json]

The engines (bf16, w8a8_int8, and float32 for scale: what bf16 itself costs) run in this process
on the same prompts (chat questions through the model's chat template), greedy:

- free-running agreement: how many of the greedy continuations are identical, and at which
  position the first differing token comes (a continuation that diverges once rarely meets again);
- teacher-forced agreement: the reference's continuation is fed to the other engine as a prompt,
  and at every position its top-1 token is compared with the one the reference chose, with the
  logprob it gives that token (so one early divergence does not count for all later tokens);
- perplexity of a fixed English text under each engine (prompt logprobs).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics

import torch

QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Give three tips for learning a new language.",
    "What is the difference between a virus and a bacterium?",
    "Summarise the plot of Romeo and Juliet.",
    "What causes the seasons on Earth?",
    "Suggest a name for a coffee shop by the river.",
    "How does a refrigerator keep food cold?",
    "What is 17 times 23?",
    "Describe a healthy breakfast.",
    "What are prime numbers?",
    "Write a short thank-you note to a teacher.",
    "How many legs does a spider have, and why?",
    "What is machine learning?",
    "Translate 'good morning' into Spanish and German.",
    "Why do leaves change colour in autumn?",
    "List the planets of the solar system in order.",
    "How should I prepare for a job interview?",
    "What is the boiling point of water at sea level?",
    "Explain what a database index is.",
    "Tell me a fun fact about octopuses.",
]

TEXT = (
    "The river rose early that spring, and by the end of March the lower fields were under water. "
    "Farmers moved their animals to the hills and waited, as their parents had done before them. "
    "In the town, the baker kept his ovens going through the night, because the road to the mill "
    "was closed and nobody knew when the next delivery of flour would come. Children walked to the "
    "old bridge after school to watch the brown water carry branches, fence posts and once a small "
    "boat with nobody in it. When the water finally went down, the fields were covered with a thin "
    "layer of silt, and the summer that followed gave the best harvest anyone could remember."
)


def chat_ids(tokenizer, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True
    )
    return ids if isinstance(ids, list) else ids["input_ids"]


def compare(ref, cand, prompts: list[list[int]], new_tokens: int) -> dict:
    """Agreement of engine ``cand`` with engine ``ref`` (greedy) on ``prompts``."""
    sp = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    outs_ref = ref.generate(input_ids=prompts, sampling_params=sp)
    outs_c = cand.generate(input_ids=prompts, sampling_params=sp)
    identical, first_diff = 0, []
    for r, c in zip(outs_ref, outs_c):
        diff = next(
            (i for i, (x, y) in enumerate(zip(r["output_ids"], c["output_ids"])) if x != y), None
        )
        identical += diff is None
        first_diff.append(new_tokens if diff is None else diff)
    # teacher forcing: the candidate scores the reference's continuation token by token
    agree = total = 0
    lp_gap = []
    for ids, r in zip(prompts, outs_ref):
        full = ids + r["output_ids"]
        kw = dict(
            sampling_params={"temperature": 0, "max_new_tokens": 1},
            return_logprob=True,
            logprob_start_len=len(ids) - 1,
        )
        out = cand.generate(input_ids=full, top_logprobs_num=1, **kw)
        ref_out = ref.generate(input_ids=full, **kw)
        tops = out["meta_info"]["input_top_logprobs"]
        given, ref_given = (
            out["meta_info"]["input_token_logprobs"],
            ref_out["meta_info"]["input_token_logprobs"],
        )
        for k, tok in enumerate(r["output_ids"]):  # entry k + 1 predicts token len(ids) + k
            total += 1
            agree += tops[k + 1][0][1] == tok
            lp_gap.append(given[k + 1][0] - ref_given[k + 1][0])
    return {
        "identical_continuations": f"{identical}/{len(prompts)}",
        "first_divergence_median": statistics.median(first_diff),
        "first_divergence_mean": round(statistics.mean(first_diff), 1),
        "teacher_forced_top1_agreement": round(agree / total, 4),
        "teacher_forced_positions": total,
        "logprob_of_ref_token_mean_diff": round(statistics.mean(lp_gap), 4),
        "logprob_of_ref_token_mean_abs_diff": round(statistics.mean(abs(x) for x in lp_gap), 4),
        "sample": [outs_ref[0]["text"][:160], outs_c[0]["text"][:160]],
    }


def perplexity(eng) -> float:
    ids = eng.tokenizer.encode(TEXT)
    out = eng.generate(
        input_ids=ids,
        sampling_params={"temperature": 0, "max_new_tokens": 1},
        return_logprob=True,
        logprob_start_len=0,
    )
    lps = [v for v, _, _ in out["meta_info"]["input_token_logprobs"][1:]]
    return math.exp(-sum(lps) / len(lps))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model-path", default=None, help="default: the demo model (SmolLM2-135M-Instruct)"
    )
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    import pdserve
    from pdserve.models.demo import ensure_demo_model

    path = a.model_path or ensure_demo_model()
    common = dict(
        model_path=path, torch_num_threads=1, max_total_tokens=32768, disable_radix_cache=True
    )
    engines = {
        "bfloat16": pdserve.Engine(dtype="bfloat16", **common),
        "w8a8_int8": pdserve.Engine(quantization="w8a8_int8", **common),
        "float32": pdserve.Engine(dtype="float32", **common),
    }
    prompts = [chat_ids(engines["bfloat16"].tokenizer, q) for q in QUESTIONS]
    result = {
        "model": path,
        "prompts": len(prompts),
        "new_tokens": a.new_tokens,
        "machine": platform.processor() or platform.machine(),
        "perplexity": {name: round(perplexity(e), 3) for name, e in engines.items()},
    }
    # the int8 cost, and for scale the cost of bf16 itself against float32
    result["w8a8_int8 vs bfloat16"] = compare(
        engines["bfloat16"], engines["w8a8_int8"], prompts, a.new_tokens
    )
    result["bfloat16 vs float32"] = compare(
        engines["float32"], engines["bfloat16"], prompts, a.new_tokens
    )
    print(json.dumps(result, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
