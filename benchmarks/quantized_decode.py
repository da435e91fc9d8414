"""Decode speed of a model served from quantized weights as their makers publish them against the
same model in bf16, one engine after the other in one run:

    python benchmarks/quantized_decode.py [--format fp8|mxfp4|int4] [--batches 1,8] [--new 64]
        [--input-len 32] [--threads 1] [--repeat 3]

``fp8``: ``benchmarks/decode_step.py``'s Llama-3.2-1B-shaped config (hidden 2048, 16 layers, 32 / 8
heads of 64, MLP 8192, vocabulary 128,256, tied embeddings) with random bf16 weights
(``compare_llamacpp.llama_1b_checkpoint``), and its FP8 version written once beside it: every
q/k/v/o/gate/up/down weight in e4m3 with a float32 scale per 128x128 block
(``tests/helpers/checkpoints.fp8_block_quantize``), embeddings and norms in bf16.

``mxfp4``: a GPT-OSS-20B-shaped model cut to 12 layers and 8 experts a layer (hidden 2880, 64 / 8
heads of 64, experts of 2880, top 4 as published, so a token reads what it reads in GPT-OSS-20B
per layer; vocabulary 201,088, head untied) with random bf16 weights, and its MXFP4 version
written once beside it: the experts as GPT-OSS publishes them
(``tests/helpers/checkpoints.mxfp4_quantize``), attention, router, embeddings and head in bf16.

``int4``: ``benchmarks/compare_vllm_moe.py``'s Qwen3-MoE-shaped model (hidden 2048, 16 layers,
64 experts top 8 of 768, 32 / 4 heads of 128, vocabulary 49,152, head untied; random bf16
weights) and its W4A16 version written once beside it as RedHatAI's "-quantized.w4a16" releases
are: every attention and expert projection in compressed-tensors' ``pack-quantized`` int4 with a
scale per output and group of 128 (``tests/helpers/checkpoints.int4_compressed``), the router,
norms, embeddings and head in bf16.

Each engine computes in bf16 (the FP8 layers on ``linear_fp8``, the bf16 ones on the GEMV /
oneDNN; both through the C++ decoder stack), radix cache off, ``--threads`` torch threads. Per
batch size: ``B`` random prompts of ``--input-len`` tokens generate 1 token and then ``--new``
tokens (greedy, ``ignore_eos``); decode tok/s = B (new - 1) / (time(new) - time(1)), best of
``--repeat``. Printed: tok/s of each and the quantized / bf16 ratio."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def quantized_beside(src: str, suffix: str, convert, quant: dict) -> str:
    """``src`` with each tensor through ``convert(name, tensor)`` (a dict of the tensors it
    becomes) and ``quant`` as its ``quantization_config``, written once beside it."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out = Path(src + suffix)
    if (out / "model.safetensors").exists():
        return str(out)
    tmp = Path(str(out) + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {}
    for f in sorted(Path(src).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                tensors.update(convert(name, st.get_tensor(name)))
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for f in Path(src).iterdir():
        if f.suffix != ".safetensors" and f.name not in (
            "config.json",
            "model.safetensors.index.json",
        ):
            shutil.copy(f, tmp / f.name)
    cfg = json.loads((Path(src) / "config.json").read_text())
    cfg["quantization_config"] = quant
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    os.replace(tmp, out)
    return str(out)


def fp8_checkpoint(src: str) -> str:
    """``src`` with its projections in FP8 e4m3 128x128 blocks, written once beside it."""
    import torch

    from tests.helpers.checkpoints import FP8_PROJECTIONS, fp8_block_quantize

    def convert(name, t):
        proj = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if name.endswith(".weight") and t.dim() == 2 and proj in FP8_PROJECTIONS:
            q, scale = fp8_block_quantize(t, (128, 128))
            return {name: q, name[: -len("weight")] + "weight_scale_inv": scale}
        return {name: t.to(torch.bfloat16) if t.is_floating_point() else t}

    quant = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    return quantized_beside(src, "-fp8", convert, quant)


GPT_OSS_SHAPE = dict(
    hidden_size=2880,
    intermediate_size=2880,
    num_hidden_layers=12,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_local_experts=8,
    num_experts_per_tok=4,
    vocab_size=201088,
    sliding_window=128,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def gpt_oss_checkpoint() -> str:
    """The GPT-OSS-shaped config above with random bf16 weights, saved once."""
    import torch
    from compare_llamacpp import CACHE, llama_1b_checkpoint
    from transformers import AutoModelForCausalLM, GptOssConfig

    out = CACHE / "models" / "gpt-oss-20b-shape-12l-8e-weights"
    if (out / "config.json").exists():
        return str(out)
    tmp = Path(str(out) + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(0)
    cfg = GptOssConfig(**GPT_OSS_SHAPE)
    cfg.architectures = ["GptOssForCausalLM"]
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(tmp)
    del model
    # the Llama-shaped model's tokenizer: any serves the random prompt ids
    for f in Path(llama_1b_checkpoint()).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, tmp / f.name)
    os.replace(tmp, out)
    return str(out)


def mxfp4_checkpoint(src: str) -> str:
    """``src`` with its experts in MXFP4 as GPT-OSS publishes them, written once beside it."""
    from tests.helpers.checkpoints import MXFP4_CONFIG, mxfp4_quantize

    def convert(name, t):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4_quantize(t.float().transpose(1, 2))
            return {name + "_blocks": blocks, name + "_scales": scales}
        return {name: t}

    return quantized_beside(src, "-mxfp4", convert, MXFP4_CONFIG)


def int4_checkpoint(src: str, group: int = 128) -> str:
    """``src`` with its attention and expert projections in int4 (W4A16, a scale per ``group``),
    written once beside it."""
    from tests.helpers.checkpoints import FP8_PROJECTIONS, int4_compressed, int4_compressed_config

    def convert(name, t):
        proj = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if name.endswith(".weight") and t.dim() == 2 and proj in FP8_PROJECTIONS:
            base = name[: -len("weight")]
            return {base + key: value for key, value in int4_compressed(t, group).items()}
        return {name: t}

    return quantized_beside(src, f"-w4a16-g{group}", convert, int4_compressed_config(group))


def decode_rates(
    path: str,
    batches: list[int],
    new: int,
    input_len: int,
    threads: int,
    repeat: int,
    python_experts: bool = False,
    int8_activations: bool = False,
    fmt: str = "int4",
):
    import random

    import pdserve
    from pdserve.quantization.experts import QuantizedExperts

    eng = pdserve.Engine(
        model_path=path,
        dtype="bfloat16",
        torch_num_threads=threads,
        disable_radix_cache=True,
        max_total_tokens=max(batches) * (input_len + new) + 1024,
        **({f"{fmt}_int8_activations": True} if int8_activations else {}),
    )
    try:
        model = eng.scheduler.runner.model
        if python_experts:  # the Python loop over the experts' matmuls, as before the C++ one
            for m in model.modules():
                if isinstance(getattr(m, "impl", None), QuantizedExperts):
                    m.impl.fused = None
        stack = getattr(model.model, "decode_stack", None) is not None
        rates = {}
        rng = random.Random(0)
        for b in batches:
            prompts = [[rng.randrange(1000, 30000) for _ in range(input_len)] for _ in range(b)]

            def run(n: int) -> float:
                sp = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
                t0 = time.perf_counter()
                eng.generate(input_ids=prompts, sampling_params=sp)
                return time.perf_counter() - t0

            run(2)  # warm-up
            best = min(run(new) - run(1) for _ in range(repeat))
            rates[b] = b * (new - 1) / best
        return rates, stack
    finally:
        eng.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--format", choices=("fp8", "mxfp4", "int4"), default="fp8")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--python-experts",
        action="store_true",
        help="also run the quantized model with its experts on the Python loop over their matmuls",
    )
    ap.add_argument(
        "--int8-activations",
        action="store_true",
        help="int4 / mxfp4: also run with --int4-int8-activations (W4A8) or "
        "--mxfp4-int8-activations",
    )
    a = ap.parse_args()
    from compare_llamacpp import llama_1b_checkpoint

    from pdserve import kernels

    batches = [int(b) for b in a.batches.split(",")]
    if a.format == "fp8":
        bf16 = llama_1b_checkpoint()
        quantized = fp8_checkpoint(bf16)
    elif a.format == "mxfp4":
        bf16 = gpt_oss_checkpoint()
        quantized = mxfp4_checkpoint(bf16)
    else:
        from compare_llamacpp import CACHE
        from compare_vllm_moe import ensure_model

        bf16 = str(ensure_model(CACHE / "models"))
        quantized = int4_checkpoint(bf16)
    q = a.format
    print(f"kernels: ISA {kernels.load().isa()}; {a.threads} thread(s)")
    for name, path in (("bf16", bf16), (q, quantized)):
        size = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
        print(f"{name}: {path} ({size / 2**30:.2f} GiB of safetensors)")
    runs = [("bf16", bf16, {}), (q, quantized, {})]
    if a.python_experts:
        runs.append((f"{q}, Python expert loop", quantized, {"python_experts": True}))
    if a.int8_activations:
        if q not in ("int4", "mxfp4"):
            ap.error("--int8-activations: for --format int4 or mxfp4")
        runs.append((f"{q}, int8 activations", quantized, {"int8_activations": True, "fmt": q}))
    results = {}
    for name, path, options in runs:
        results[name], stack = decode_rates(
            path, batches, a.new, a.input_len, a.threads, a.repeat, **options
        )
        print(f"{name}: C++ decoder stack {'on' if stack else 'off'}")
    names = [name for name, _, _ in runs]
    print(
        "| batch | "
        + " | ".join(f"{n} tok/s" for n in names)
        + " | "
        + " | ".join(f"{n} / bf16" for n in names[1:])
        + " |"
    )
    print("|---" * (2 * len(names)) + "|")
    for b in batches:
        rates = [results[n][b] for n in names]
        ratios = [r / rates[0] for r in rates[1:]]
        print(
            f"| {b} | "
            + " | ".join(f"{r:.1f}" for r in rates)
            + " | "
            + " | ".join(f"{x:.2f}" for x in ratios)
            + " |"
        )


if __name__ == "__main__":
    main()
