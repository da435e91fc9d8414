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

Quantized contenders: ``llama.cpp Q4_0`` / ``llama.cpp Q8_0`` are llama.cpp's own quantization of
that GGUF (``llama_model_quantize``, the LM head left in bf16 as the published quantized
checkpoints leave it; the router stays float); ``pdserve w4a16`` serves
``quantized_decode.int4_checkpoint``'s compressed-tensors int4 version of the same weights (a
scale per 128, the head in bf16; ``pdserve w4a8`` the same with ``--int4-int8-activations``, as
llama.cpp's Q4_0 multiplies int8 activations), ``pdserve fp8`` its FP8 block version
(``quantized_decode.fp8_checkpoint``, 128x128 blocks). Closest types, not the same bits: Q4_0 has
an fp16 scale per 32 weights (4.5 bits a weight), the int4 checkpoint a bf16 scale per 128 (4.125);
Q8_0 an fp16 scale per 32 (8.5), FP8 a float32 scale per 128x128 block (8.0). ``--model gpt-oss``
(``quantized_decode.gpt_oss_checkpoint``) with ``llama.cpp MXFP4`` (its ``MXFP4_MOE``: the experts
in MXFP4) against ``pdserve mxfp4`` (the experts as GPT-OSS publishes them): the same format;
``pdserve mxfp4-a8`` with ``--mxfp4-int8-activations``, as llama.cpp's MXFP4 multiplies int8
activations.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import compare_llamacpp as cl  # noqa: E402
import compare_vllm_moe  # noqa: E402
import quantized_decode  # noqa: E402

QUANTIZE_WORKER = r"""
import ctypes, sys
import llama_cpp
src, dst, ftype = sys.argv[1], sys.argv[2], sys.argv[3]
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype)
p.nthread = 2
p.quantize_output_tensor = False  # the LM head stays as it is (bf16)
sys.exit(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p)))
"""


def quantized_gguf(py: Path, gguf: Path, ftype: str) -> Path:
    """``gguf`` quantized by llama.cpp to ``ftype`` (Q4_0, Q8_0...), the LM head kept; made once."""
    out = gguf.with_name(gguf.name.replace("-bf16.gguf", f"-{ftype}-head-bf16.gguf"))
    if not out.exists():
        tmp = out.with_suffix(f".tmp{os.getpid()}")
        subprocess.run([str(py), "-c", QUANTIZE_WORKER, str(gguf), str(tmp), ftype], check=True)
        os.replace(tmp, out)
    return out


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
    ap.add_argument(
        "--model",
        choices=("qwen3-moe", "gpt-oss"),
        default="qwen3-moe",
        help="gpt-oss: quantized_decode.py's GPT-OSS-20B shape cut to 12 layers x 8 experts, for "
        "the MXFP4 contenders",
    )
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.model == "gpt-oss":
        model = quantized_decode.gpt_oss_checkpoint()
    else:
        model = str(compare_vllm_moe.ensure_model(a.cache_dir))
    py = cl.ensure_llama_cpp(a.venv)
    ids = list(range(1000, 1000 + a.prompt_len))  # the same token ids for every contender

    def llama(path) -> list[str]:
        return [str(py), "-c", cl.LLAMA_WORKER, str(path)]

    def pdserve(path: str, variant: str) -> list[str]:
        return [sys.executable, "-c", cl.PDSERVE_WORKER, path, variant]

    known = {  # each contender's command, made (with its weights) only when asked for
        "llama.cpp bf16": lambda: llama(cl.bf16_gguf(model)),
        "llama.cpp Q4_0": lambda: llama(quantized_gguf(py, cl.bf16_gguf(model), "Q4_0")),
        "llama.cpp Q8_0": lambda: llama(quantized_gguf(py, cl.bf16_gguf(model), "Q8_0")),
        # its experts in MXFP4, the rest as the bf16 GGUF has it (llama.cpp's MXFP4_MOE)
        "llama.cpp MXFP4": lambda: llama(quantized_gguf(py, cl.bf16_gguf(model), "MXFP4_MOE")),
        "pdserve bf16": lambda: pdserve(model, "bfloat16"),
        "pdserve w8a8_int8": lambda: pdserve(model, "w8a8"),
        "pdserve w4a16": lambda: pdserve(quantized_decode.int4_checkpoint(model), "bfloat16"),
        "pdserve w4a8": lambda: pdserve(quantized_decode.int4_checkpoint(model), "w4a8"),
        "pdserve fp8": lambda: pdserve(quantized_decode.fp8_checkpoint(model), "bfloat16"),
        "pdserve mxfp4": lambda: pdserve(quantized_decode.mxfp4_checkpoint(model), "bfloat16"),
        "pdserve mxfp4-a8": lambda: pdserve(quantized_decode.mxfp4_checkpoint(model), "mxfp4-a8"),
    }
    names = a.contenders.split(",")
    for n in names:
        if n not in known:
            ap.error(f"--contenders: unknown {n!r}; known: {', '.join(known)}")
    commands = {n: known[n]() for n in names}
    samples: dict[str, list[float]] = {k: [] for k in names}
    for r in range(a.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            # the worker's arguments: path, ids, new tokens, then the variant
            cmd = commands[name][:4] + [json.dumps(ids), str(a.new_tokens)] + commands[name][4:]
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
