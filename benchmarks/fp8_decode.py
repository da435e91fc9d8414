"""Decode speed of a Llama-3.2-1B-shaped model served from FP8 block weights (as the "-FP8"
checkpoints publish them) against the same model in bf16, one engine after the other in one run:

    python benchmarks/fp8_decode.py [--batches 1,8] [--new 64] [--input-len 32] [--threads 1]
        [--repeat 3]

The model: ``benchmarks/decode_step.py``'s config (hidden 2048, 16 layers, 32 / 8 heads of 64,
MLP 8192, vocabulary 128,256, tied embeddings) with random bf16 weights
(``compare_llamacpp.llama_1b_checkpoint``), and its FP8 version written once beside it: every
q/k/v/o/gate/up/down weight in e4m3 with a float32 scale per 128x128 block
(``tests/helpers/checkpoints.fp8_block_quantize``), embeddings and norms in bf16.

Each engine computes in bf16 (the FP8 layers on ``linear_fp8``, the bf16 ones on the GEMV /
oneDNN; both through the C++ decoder stack), radix cache off, ``--threads`` torch threads. Per
batch size: ``B`` random prompts of ``--input-len`` tokens generate 1 token and then ``--new``
tokens (greedy, ``ignore_eos``); decode tok/s = B (new - 1) / (time(new) - time(1)), best of
``--repeat``. Printed: tok/s of each and the FP8 / bf16 ratio, and the weight bytes each holds."""

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


def fp8_checkpoint(src: str) -> str:
    """``src`` with its projections in FP8 e4m3 128x128 blocks, written once beside it."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from tests.helpers.checkpoints import FP8_PROJECTIONS, fp8_block_quantize

    out = Path(src + "-fp8")
    if (out / "model.safetensors").exists():
        return str(out)
    tmp = Path(str(out) + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {}
    files = sorted(Path(src).glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                t = st.get_tensor(name)
                proj = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
                if name.endswith(".weight") and t.dim() == 2 and proj in FP8_PROJECTIONS:
                    q, scale = fp8_block_quantize(t, (128, 128))
                    tensors[name] = q
                    tensors[name[: -len("weight")] + "weight_scale_inv"] = scale
                else:
                    tensors[name] = t.to(torch.bfloat16) if t.is_floating_point() else t
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for f in Path(src).iterdir():
        if f.suffix != ".safetensors" and f.name not in (
            "config.json",
            "model.safetensors.index.json",
        ):
            shutil.copy(f, tmp / f.name)
    cfg = json.loads((Path(src) / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    os.replace(tmp, out)
    return str(out)


def decode_rates(
    path: str, batches: list[int], new: int, input_len: int, threads: int, repeat: int
):
    import random

    import pdserve

    eng = pdserve.Engine(
        model_path=path,
        dtype="bfloat16",
        torch_num_threads=threads,
        disable_radix_cache=True,
        max_total_tokens=max(batches) * (input_len + new) + 1024,
    )
    try:
        model = eng.scheduler.runner.model
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
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    from compare_llamacpp import llama_1b_checkpoint

    from pdserve import kernels

    batches = [int(b) for b in a.batches.split(",")]
    bf16 = llama_1b_checkpoint()
    fp8 = fp8_checkpoint(bf16)
    print(f"kernels: ISA {kernels.load().isa()}; {a.threads} thread(s)")
    for name, path in (("bf16", bf16), ("fp8", fp8)):
        size = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
        print(f"{name}: {path} ({size / 2**30:.2f} GiB of safetensors)")
    results = {}
    for name, path in (("bf16", bf16), ("fp8", fp8)):
        results[name], stack = decode_rates(path, batches, a.new, a.input_len, a.threads, a.repeat)
        print(f"{name}: C++ decoder stack {'on' if stack else 'off'}")
    print("| batch | bf16 tok/s | FP8 tok/s | FP8 / bf16 |\n|---|---|---|---|")
    for b in batches:
        r16, r8 = results["bf16"][b], results["fp8"][b]
        print(f"| {b} | {r16:.1f} | {r8:.1f} | {r8 / r16:.2f} |")


if __name__ == "__main__":
    main()
