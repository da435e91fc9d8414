"""Batch-1 decode on the Qwen3-MoE benchmark model: pdserve against llama.cpp on the same core.

  python benchmarks/compare_llamacpp_moe.py [--core 1] [--rounds 2] [--prompt-len 128]
      [--new-tokens 64]

The model is ``compare_vllm_moe.py``'s (5.3 B parameters, 64 experts top 8, random bf16
weights), converted once to a bf16 GGUF by llama.cpp's own ``convert_hf_to_gguf.py`` (which maps
Qwen3MoeForCausalLM to its ``qwen3moe`` architecture): the same weights on both sides. The
contenders, their workers and llama-cpp-python's build are ``compare_llamacpp.py``'s: one
request, greedy, one thread under ``taskset -c CORE``, each in its own process, in alternating
order for ``--rounds`` rounds; decode speed = tokens after the first / time from the first to
the last token.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import compare_llamacpp as cl  # noqa: E402
import compare_vllm_moe  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--core", default="1")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "pdserve" / "models")
    ap.add_argument("--venv", type=Path, default=cl.CACHE / "llamacpp-venv")
    ap.add_argument("--contenders", default="llama.cpp bf16,pdserve bf16")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    model = str(compare_vllm_moe.ensure_model(a.cache_dir))
    py = cl.ensure_llama_cpp(a.venv)
    gguf = cl.bf16_gguf(model)
    ids = list(range(1000, 1000 + a.prompt_len))  # the same token ids for every contender
    known = {
        "llama.cpp bf16": [str(py), "-c", cl.LLAMA_WORKER, str(gguf)],
        "pdserve bf16": [sys.executable, "-c", cl.PDSERVE_WORKER, model],
        "pdserve w8a8_int8": [sys.executable, "-c", cl.PDSERVE_WORKER, model],
    }
    extra = {"pdserve bf16": ["bfloat16"], "pdserve w8a8_int8": ["w8a8"]}
    names = a.contenders.split(",")
    for n in names:
        if n not in known:
            ap.error(f"--contenders: unknown {n!r}; known: {', '.join(known)}")
    samples: dict[str, list[float]] = {k: [] for k in names}
    for r in range(a.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            cmd = known[name] + [json.dumps(ids), str(a.new_tokens)] + extra.get(name, [])
            samples[name].append(cl.run(cmd, a.core))
            print(
                f"round {r + 1}: {name}: {samples[name][-1]:.2f} tok/s", file=sys.stderr, flush=True
            )
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next(
        (ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")),
        "?",
    )
    print(
        f"machine: {platform.machine()}, {model_name}, taskset -c {a.core}; model "
        f"{Path(model).name}; prompt {a.prompt_len} tokens, {a.new_tokens} generated, "
        f"{a.rounds} rounds (alternating order)"
    )
    base = statistics.median(samples[names[0]])
    print(f"| contender | decode tok/s (median) | all rounds | vs {names[0]} |")
    print("|---|---|---|---|")
    for name, xs in samples.items():
        med = statistics.median(xs)
        print(f"| {name} | {med:.2f} | {', '.join(f'{x:.2f}' for x in xs)} | {med / base:.2f} |")
    if a.json:
        Path(a.json).write_text(json.dumps(samples, indent=2))


if __name__ == "__main__":
    main()
