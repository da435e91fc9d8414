"""What pdserve does on the CPU it runs on: ``python -m tests.helpers.isa_probe MODEL_DIR`` prints
one JSON line (the kernels' tier and tiers, oneDNN's bf16, ``--dtype auto``'s choice, and the
tokens and logprobs of a deterministic bf16 engine). Run by tests under qemu-user emulating a CPU
this host is not (tests/e2e/test_isa_tiers.py), and beside it on this host."""

from __future__ import annotations

import json
import sys

import torch

PROMPT = list(range(100, 140))


def probe(model_path: str) -> dict:
    import pdserve
    from pdserve import kernels
    from pdserve.engine.precision import choose_compute_dtype
    from pdserve.models.loader import load_config

    torch.set_num_threads(1)
    ops = kernels.load()
    onednn, why_not = kernels.onednn_bf16()
    dtype, why = choose_compute_dtype("auto", "cpu", load_config(model_path), ops)
    eng = pdserve.Engine(
        model_path=model_path,
        dtype="bfloat16",
        torch_num_threads=1,
        max_total_tokens=2048,
        enable_deterministic_inference=True,
    )
    try:
        out = eng.generate(
            input_ids=PROMPT,
            return_logprob=True,
            sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True},
        )
    finally:
        eng.shutdown()
    return {
        "isa": ops.isa(),
        "tiers": ops.available_isas(),
        "features": ops.cpu_features(),
        "onednn_bf16": onednn,
        "onednn_why_not": why_not,
        "auto_dtype": str(dtype).replace("torch.", ""),
        "auto_why": why,
        "output_ids": out["output_ids"],
        "logprobs": [lp for lp, *_ in out["meta_info"]["output_token_logprobs"]],
    }


if __name__ == "__main__":
    print(json.dumps(probe(sys.argv[1])))
