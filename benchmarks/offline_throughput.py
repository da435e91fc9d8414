"""Offline engine throughput on the demo model: pdserve against HF transformers and against the
matmul roofline of the same machine, with where a decode step's time goes.

  python benchmarks/offline_throughput.py [--model-path DIR] [--num-prompts 64] [--input-len 128]
      [--output-len 64] [--threads 1] [--hf-batch1-prompts 8] [--profile] [--json out.json]

Workload: N prompts x IN random tokens x OUT output tokens, greedy, ignore_eos, radix cache off,
all submitted at once. Contenders, one after the other in this process:

- pdserve ``--dtype auto`` (the dtype it picks is printed), ``--dtype float32`` and
  ``--quantization w8a8_int8``: total output tok/s, and the decode phase alone (the run minus
  its prefill, timed by a separate run with one output token);
- HF transformers ``generate`` in the checkpoint's dtype, batched (one call of N) and at batch 1
  (a subset of the prompts, it is slow).

Roofline: the matmuls of one decode step at batch N (every layer and the LM head) are timed with
the fastest bf16 GEMM on this machine (oneDNN with prepacked weights, best of several passes);
N / that time is the decode tok/s a step made of nothing but those matmuls would reach, and the
decode tok/s of each contender is reported as a fraction of it.

``--profile``: one decode step at batch N through the layer-by-layer path (the C++ decoder stack
runs the same kernels without Python between them), every kernel call timed, the step's time
split by kind of work (matmuls, attention, norms, RoPE, SiLU-mul, the rest).
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import random
import subprocess
import time

import torch


def lscpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next(
        (ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?"
    )


def hf_generate(path, prompts, out_len, batch):
    from transformers import AutoConfig, AutoModelForCausalLM

    from pdserve.models.loader import resolve_dtype

    dtype = resolve_dtype(AutoConfig.from_pretrained(path), "auto")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    t0 = time.perf_counter()
    n_tokens = 0
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            ids = torch.tensor(chunk)  # equal lengths: no padding needed
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=out_len,
                min_new_tokens=out_len,
                do_sample=False,
                pad_token_id=0,
            )
            n_tokens += (out.shape[1] - ids.shape[1]) * len(chunk)
    return n_tokens / (time.perf_counter() - t0)


def pdserve_run(path, prompts, out_len, threads, **kw) -> dict:
    import pdserve

    eng = pdserve.Engine(
        model_path=path,
        torch_num_threads=threads,
        max_total_tokens=1 << 17,
        disable_radix_cache=True,
        **kw,
    )
    sp = lambda n: {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}  # noqa: E731
    eng.generate(input_ids=prompts[:2], sampling_params=sp(4))  # warm-up
    t0 = time.perf_counter()
    eng.generate(input_ids=prompts, sampling_params=sp(1))
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = eng.generate(input_ids=prompts, sampling_params=sp(out_len))
    total = time.perf_counter() - t0
    n = sum(len(o["output_ids"]) for o in outs)
    runner = eng.scheduler.runner
    return {
        "engine": eng,
        "dtype": str(runner.dtype).replace("torch.", "")
        + (f"+{kw['quantization']}" if kw.get("quantization") else ""),
        "tok_s": n / total,
        "decode_tok_s": len(prompts) * (out_len - 1) / (total - prefill),
        "prefill_s": prefill,
        "total_s": total,
        "ids": [o["output_ids"] for o in outs],
    }


def matmul_roofline(hf_config, rows: int, passes: int = 5) -> dict:
    """Time of the matmuls of one decode step at ``rows`` rows in prepacked bf16: oneDNN where it
    has bf16 here, else pdserve's own bf16 kernel (``PackedBF16`` without oneDNN)."""
    from pdserve import kernels
    from pdserve.engine.precision import _layer_shapes
    from pdserve.layers.linear import PackedBF16

    gen = torch.Generator().manual_seed(0)
    shapes = _layer_shapes(hf_config)
    onednn = kernels.onednn_bf16()[0]

    def matmul(n: int, k: int):
        w = (torch.randn(n, k, generator=gen) * 0.02).bfloat16()
        if not onednn:
            return PackedBF16(w, None, kernels.load(), onednn=False)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    packed = [matmul(n, k) for n, k in shapes]
    head = matmul(hf_config.vocab_size, hf_config.hidden_size)
    xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for _, k in shapes}
    xs[hf_config.hidden_size] = torch.randn(rows, hf_config.hidden_size, generator=gen).bfloat16()

    def step():
        for _ in range(hf_config.num_hidden_layers):
            for (_, k), mm in zip(shapes, packed):
                mm(xs[k])
        head(xs[hf_config.hidden_size])

    step()
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    flops = (
        2
        * rows
        * (
            hf_config.num_hidden_layers * sum(n * k for n, k in shapes)
            + hf_config.vocab_size * hf_config.hidden_size
        )
    )
    return {"step_s": best, "gflop_per_s": flops / best / 1e9, "tok_s": rows / best}


KINDS = {  # kernel (pdserve.kernels function or matmul impl) -> kind of work
    "linear_vnni": "matmul",
    "linear_w8a8": "matmul",
    "onednn": "matmul",
    "paged_attention_bf16": "attention",
    "paged_decode_attention": "attention",
    "rms_norm": "norm",
    "rotary_embedding": "rope",
    "silu_and_mul": "silu_mul",
}


class _TimedOps:
    """Stands in for the kernels module and adds up the time spent in each kind of kernel."""

    def __init__(self, ops, totals):
        self._ops, self._totals = ops, totals

    def __getattr__(self, name):
        fn = getattr(self._ops, name)
        kind = KINDS.get(name)
        if kind is None or not callable(fn):
            return fn

        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self._totals[kind] += time.perf_counter() - t0

        return timed


def profile_decode_step(eng, prompts) -> list[tuple[str, float]]:
    """Split of one decode step at batch len(prompts), run layer by layer so that each kernel can be
    timed: matmuls, attention, norms, RoPE, SiLU-mul, and the rest (KV writes, sampling, Python)."""
    from pdserve.engine.request import Req, SamplingParams
    from pdserve.layers import linear as lin

    runner = eng.scheduler.runner
    model = runner.model
    totals: collections.Counter = collections.Counter()
    timed = _TimedOps(runner.ops, totals)
    stack, model.model.decode_stack = model.model.decode_stack, None
    impls = [m.impl for m in model.modules() if getattr(m, "impl", None) is not None]
    impls += [model.tied_logits] if model.tied_logits is not None else []
    saved = {id(i): i.ops for i in impls}
    onednn = torch.ops.mkldnn._linear_pointwise

    def timed_onednn(*args):
        t0 = time.perf_counter()
        try:
            return onednn(*args)
        finally:
            totals["matmul"] += time.perf_counter() - t0

    sched = eng.scheduler
    sp = {
        "temperature": 0,
        "max_new_tokens": 10_000,
        "ignore_eos": True,
    }  # nobody finishes before the profiled step
    for i, ids in enumerate(prompts):
        sched.add_request(
            Req(rid=f"profile-{i}", input_ids=ids, sampling=SamplingParams.from_dict(sp))
        )
    while sched.waiting or any(r.extend_len > 1 for r in sched.running) or not sched.running:
        sched.step()  # prefill (chunked) until every request decodes
    sched.step()  # one decode step, warm
    model.use_cpu_kernels(timed)
    runner.attn_backend.ops = timed
    for i in impls:
        i.ops = timed
    lin_ops = lin.torch.ops.mkldnn
    dense = lin.F.linear

    def timed_dense(*args):
        t0 = time.perf_counter()
        try:
            return dense(*args)
        finally:
            totals["matmul"] += time.perf_counter() - t0

    try:
        lin_ops._linear_pointwise = timed_onednn
        lin.F.linear = timed_dense
        t0 = time.perf_counter()
        sched.step()
        wall = time.perf_counter() - t0
    finally:
        lin_ops._linear_pointwise = onednn
        lin.F.linear = dense
        model.use_cpu_kernels(runner.ops)
        runner.attn_backend.ops = runner.ops
        for i in impls:
            i.ops = saved[id(i)]
        model.model.decode_stack = stack
    assert len(sched.running) == len(prompts), "the profiled step did not decode the whole batch"
    sched.abort("")
    sched.drain()
    split = [(k, v / wall) for k, v in totals.most_common()]
    split.append(("other (KV writes, sampling, Python)", max(0.0, 1 - sum(v for _, v in split))))
    return split + [("step ms", wall * 1e3)]  # noqa: RUF005


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-path", default=None, help="default: the demo model")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--hf-batch1-prompts", type=int, default=8)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from pdserve.models.demo import ensure_demo_model
    from pdserve.models.loader import load_config

    path = a.model_path or ensure_demo_model()
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, 40000) for _ in range(a.input_len)] for _ in range(a.num_prompts)
    ]
    roof = matmul_roofline(load_config(path), a.num_prompts)
    rows = []
    profiles = {}
    for name, kw in (
        ("pdserve auto", {}),
        ("pdserve float32", {"dtype": "float32"}),
        ("pdserve w8a8_int8", {"quantization": "w8a8_int8"}),
    ):
        r = pdserve_run(path, prompts, a.output_len, a.threads, **kw)
        if a.profile:
            profiles[f"{name} ({r['dtype']})"] = profile_decode_step(r["engine"], prompts)
        del r["engine"]
        rows.append(
            {"contender": name, **r, "roofline_fraction": r["decode_tok_s"] / roof["tok_s"]}
        )
    hf_b = hf_generate(path, prompts, a.output_len, batch=a.num_prompts)
    hf_1 = hf_generate(path, prompts[: a.hf_batch1_prompts], a.output_len, batch=1)
    rows.append({"contender": "HF transformers batched", "tok_s": hf_b})
    rows.append({"contender": "HF transformers batch 1", "tok_s": hf_1})

    print(
        f"machine: {platform.machine()}, {lscpu_model()}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}"
    )
    print(
        f"workload: {a.num_prompts} prompts x {a.input_len} in x {a.output_len} out, greedy, "
        f"ignore_eos; {path}"
    )
    print(
        f"matmul roofline at batch {a.num_prompts}: {roof['gflop_per_s']:.0f} GFLOP/s prepacked "
        f"bf16, a decode step of matmuls only = {roof['step_s'] * 1e3:.1f} ms = "
        f"{roof['tok_s']:.0f} tok/s"
    )
    print("| contender | dtype | out tok/s | decode tok/s | of roofline | prefill s | total s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "decode_tok_s" in r:
            print(
                f"| {r['contender']} | {r['dtype']} | {r['tok_s']:.1f} | {r['decode_tok_s']:.1f} "
                f"| {r['roofline_fraction']:.2f} | {r['prefill_s']:.2f} | {r['total_s']:.2f} |"
            )
        else:
            print(f"| {r['contender']} | checkpoint | {r['tok_s']:.1f} | | | | |")
    for name, split in profiles.items():
        print(f"\none decode step at batch {a.num_prompts}, layer-by-layer path, {name}:")
        for kind, value in split:
            print(
                f"  {kind:<36} "
                + (f"{value:.1f}" if kind == "step ms" else f"{value * 100:5.1f} %")
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"roofline": roof, "rows": rows, "profiles": profiles}, f, indent=1)


if __name__ == "__main__":
    main()
