"""Engine flags: dtype and KV-cache dtype choice, quantization, attention backend, prefill
budget."""

from __future__ import annotations

import argparse

import pytest
import torch

from pdserve.config import ServerArgs
from pdserve.engine.precision import (
    choose_compute_dtype,
    choose_kv_cache_dtype,
    measure_linear_times,
)
from tests.helpers.checkpoints import as_bf16_checkpoint, build_tiny_checkpoint


def parse(argv: list[str]) -> ServerArgs:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(
        parser.parse_args(["--model-path", "m", "--device", "cpu", *argv])
    )


def test_flags_parse_and_default():
    a = parse([])
    assert (a.dtype, a.kv_cache_dtype, a.attention_backend, a.quantization) == (
        "auto",
        "auto",
        "auto",
        None,
    )
    assert a.max_prefill_tokens == a.chunked_prefill_size  # unset: one chunk per batch
    a = parse(
        [
            "--kv-cache-dtype",
            "bfloat16",
            "--attention-backend",
            "torch",
            "--quantization",
            "w8a8_int8",
            "--max-prefill-tokens",
            "8192",
        ]
    )
    assert (a.kv_cache_dtype, a.attention_backend, a.quantization, a.max_prefill_tokens) == (
        "bfloat16",
        "torch",
        "w8a8_int8",
        8192,
    )


@pytest.mark.parametrize(
    "kw, field, needle",
    [
        (dict(kv_cache_dtype="int4"), "kv_cache_dtype", "must be one of"),
        (dict(attention_backend="flash"), "attention_backend", "must be one of"),
        (dict(quantization="awq"), "quantization", "must be one of"),
        (dict(quantization="w8a8_int8", dtype="float32"), "quantization", "computes in bfloat16"),
        (dict(max_prefill_tokens=0), "max_prefill_tokens", "must be >= 1"),
    ],
)
def test_bad_values_name_the_field(kw, field, needle):
    with pytest.raises(ValueError, match=field) as e:
        ServerArgs(model_path="m", device="cpu", **kw)
    assert needle in str(e.value)


def _config(path: str):
    from pdserve.models.loader import load_config

    return load_config(path)


def test_dtype_choice(tmp_path):
    fp32 = _config(build_tiny_checkpoint("llama"))
    # a float32 checkpoint stays float32 (the HF-exact mode); an explicit dtype forces
    assert choose_compute_dtype("auto", "cpu", fp32, None)[0] == torch.float32
    assert choose_compute_dtype("bfloat16", "cpu", fp32, None) == (
        torch.bfloat16,
        "--dtype bfloat16",
    )
    assert choose_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert choose_kv_cache_dtype("float32", torch.bfloat16) == torch.float32
    # a bf16 checkpoint: decided by timing the model's own shapes; the reason says what was measured
    # (with pdserve's kernels, as a server has them: without oneDNN bf16 they are what is probed)
    from pdserve import kernels

    ops = kernels.load()
    onednn = kernels.onednn_bf16()[0]
    dst = as_bf16_checkpoint(build_tiny_checkpoint("llama"), str(tmp_path / "bf16"))
    dtype, why = choose_compute_dtype("auto", "cpu", _config(str(dst)), ops)
    times = measure_linear_times(_config(str(dst)), ops, onednn=onednn)
    assert dtype in (torch.bfloat16, torch.float32)
    assert why.startswith("measured:") and "prepacked bf16" in why and "float32" in why, why
    assert ("oneDNN + GEMV" if onednn else "pdserve kernels") in why, why
    assert times["float32"] > 0 and times["bfloat16"] > 0


def test_prefill_budget_caps_batch_and_request():
    """--max-prefill-tokens bounds a batch's prefill tokens, --chunked-prefill-size each
    request's."""
    import pdserve

    eng = pdserve.Engine(
        model_path=build_tiny_checkpoint("llama"),
        torch_num_threads=1,
        max_total_tokens=8192,
        chunked_prefill_size=64,
        max_prefill_tokens=160,
    )
    from pdserve.engine.request import Req, SamplingParams

    sched = eng.scheduler
    for i in range(3):
        sched.add_request(
            Req(
                rid=f"r{i}",
                input_ids=list(range(100, 300)),
                sampling=SamplingParams.from_dict({"max_new_tokens": 1}),
            )
        )
    batch = sched._schedule()
    assert [ext for _, ext in batch] == [64, 64, 32]  # 160 tokens, no request above 64
    sched.abort("")
    sched.drain()
    assert eng.check_integrity()["in_use_pages"] == 0


def test_float32_compute_with_bf16_kv_on_both_attention_backends():
    """--dtype float32 --kv-cache-dtype bfloat16: the CPU backend (whose flash kernel is bf16
    throughout) takes its float32 paths and agrees with the torch backend token for token."""
    import pdserve

    outs = []
    for backend in ("cpu", "torch"):
        eng = pdserve.Engine(
            model_path=build_tiny_checkpoint("llama"),
            torch_num_threads=1,
            max_total_tokens=4096,
            dtype="float32",
            kv_cache_dtype="bfloat16",
            attention_backend=backend,
        )
        assert eng.scheduler.runner.pool.dtype == torch.bfloat16
        outs.append(
            eng.generate(
                input_ids=list(range(100, 160)),
                sampling_params={"temperature": 0, "max_new_tokens": 8},
            )["output_ids"]
        )
    assert outs[0] == outs[1]


def test_sglang_sampling_seed_is_the_seed():
    from pdserve.engine.request import SamplingParams

    assert SamplingParams.from_dict({"sampling_seed": 7}).seed == 7
    assert SamplingParams.from_dict({"sampling_seed": 7, "seed": 7}).seed == 7
    with pytest.raises(ValueError, match="sampling_seed: 7 and seed: 8 disagree"):
        SamplingParams.from_dict({"sampling_seed": 7, "seed": 8})
    with pytest.raises(ValueError, match="seed: must be an integer"):
        SamplingParams.from_dict({"sampling_seed": "x"})
