"""Where a decode step of a Llama-3.2-1B-shaped model goes, on one core: the C++ decoder stack
against the layer-by-layer path, against the time of the step's matmuls alone.

  python benchmarks/decode_step.py [--batches 8,32,64] [--input-len 128] [--steps 3] [--threads 1]
      [--core 1] [--prefill-threads 2] [--gemv-max-rows 8,64] [--json OUT]

The model: Llama 3.2 1B as its config has it (hidden 2048, 16 layers, 32 query / 8 KV heads of
64, MLP 8192, vocabulary 128,256, tied embeddings) with the SmolLM2 tokenizer and random bf16
weights (``--load-format dummy``); the directory (config and tokenizer, no weights) is written
once under ``~/.cache/pdserve/models`` and can be served with ``pdserve serve --load-format dummy``.

One ``pdserve.Engine`` (bf16, radix cache off) takes the batches in increasing order: requests are
added up to the batch size and prefilled (``--input-len`` random tokens each), then ``--steps``
decode steps are timed through the decoder stack and as many layer by layer, with ``--threads``
torch threads on ``--core`` (the untimed prefills may use more: ``--prefill-threads``), for each
GEMV row limit of ``--gemv-max-rows`` (the GEMV kernel up to that many rows, oneDNN above). Each
step's time is split into: the scheduler's batch choice, the batch tables (``make_forward_batch``),
the decoder layers (the C++ stack, or per kind of kernel on the layer-by-layer path), the LM head,
sampling, and the rest (embedding, RoPE tables, final norm, finishing checks, Python). The matmul
time is the model's own packed matmuls (the kernel each uses at that batch) timed alone at the
batch's rows, best of 3, and the layers' matmuls through oneDNN only (its prepacked copies). ITL at
a
batch = its step time.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import platform
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import _TimedOps, lscpu_model  # noqa: E402

CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    hidden_act="silu",
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    attention_bias=False,
    mlp_bias=False,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="bfloat16",
    initializer_range=0.02,
)


def model_dir(cache_dir: Path, context: int = 8192) -> Path:
    """config.json and the SmolLM2 tokenizer (weights: ``--load-format dummy``); ``context``:
    the model's ``max_position_embeddings`` (Llama-3.2-1B's own is 131072)."""
    from tests.helpers.checkpoints import smollm2_tokenizer_dir

    config = {**CONFIG, "max_position_embeddings": max(context, CONFIG["max_position_embeddings"])}
    key = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:10]
    out = cache_dir / f"llama-3.2-1b-shape-{key}"
    if (out / "config.json").exists():
        return out
    tmp = Path(str(out) + f".tmp{os.getpid()}")
    shutil.copytree(smollm2_tokenizer_dir(), tmp)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    os.replace(tmp, out)
    return out


def timed(totals: collections.Counter, name: str, fn):
    def wrapper(*args, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            totals[name] += time.perf_counter() - t0

    return wrapper


class _TimedStack:
    def __init__(self, stack, totals):
        self.stack, self.totals = stack, totals

    def forward(self, *args):
        return timed(self.totals, "decoder layers (C++ stack)", self.stack.forward)(*args)


def timed_steps(eng, steps: int, stack_on: bool) -> dict:
    """``steps`` decode steps with the split described in the module docstring (mean per step)."""
    sched, runner = eng.scheduler, eng.scheduler.runner
    model = runner.model
    totals: collections.Counter = collections.Counter()
    stack = model.model.decode_stack
    saved = (sched._schedule, runner.make_forward_batch, model.compute_logits, sched.sampler.sample)
    sched._schedule = timed(totals, "schedule", sched._schedule)
    runner.make_forward_batch = timed(totals, "batch tables", runner.make_forward_batch)
    model.compute_logits = timed(totals, "LM head", model.compute_logits)
    sched.sampler.sample = timed(totals, "sampling", sched.sampler.sample)
    impls = [m.impl for m in model.modules() if getattr(m, "impl", None) is not None]
    kernel_totals: collections.Counter = collections.Counter()
    ops = _TimedOps(runner.ops, kernel_totals)
    if stack_on:
        model.model.decode_stack = _TimedStack(stack, totals)
    else:
        model.model.decode_stack = None
        model.use_cpu_kernels(ops)
        runner.attn_backend.ops = ops
        for i in impls:
            i.ops = ops
        onednn = torch.ops.mkldnn._linear_pointwise
        torch.ops.mkldnn._linear_pointwise = timed(kernel_totals, "matmul", onednn)
    walls = []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            sched.step()
            walls.append(time.perf_counter() - t0)
    finally:
        sched._schedule, runner.make_forward_batch, model.compute_logits, sched.sampler.sample = (
            saved
        )
        for attr in ("_schedule", "make_forward_batch", "compute_logits", "sample"):
            for obj in (sched, runner, model, sched.sampler):
                obj.__dict__.pop(attr, None)
        model.model.decode_stack = stack
        if not stack_on:
            torch.ops.mkldnn._linear_pointwise = onednn
            model.use_cpu_kernels(runner.ops)
            runner.attn_backend.ops = runner.ops
            for i in impls:
                i.ops = runner.ops
    wall = sum(walls)
    parts = {k: v / steps * 1e3 for k, v in totals.items()}
    if not stack_on:  # the LM head's GEMV is inside compute_logits, not in the layers' kernels
        parts.update({f"layers: {k}": v / steps * 1e3 for k, v in kernel_totals.items()})
    parts["rest"] = wall / steps * 1e3 - sum(parts.values())
    return {
        "step_ms": statistics.median(walls) * 1e3,
        "steps_ms": [w * 1e3 for w in walls],
        "parts_ms": parts,
    }


def set_gemv_max_rows(eng, rows: int) -> None:
    """The GEMV kernel up to ``rows`` rows, oneDNN above, on both paths (the stack is rebuilt)."""
    from pdserve.layers import linear
    from pdserve.models import cpu_paths

    linear.GEMV_MAX_ROWS = cpu_paths.GEMV_MAX_ROWS = rows
    runner = eng.scheduler.runner
    assert runner.model.enable_decode_stack(runner.ops), "the decoder stack is not enabled"


def matmul_alone(model, rows: int, passes: int = 3) -> dict:
    """The model's packed matmuls at ``rows`` rows, each with the kernel it picks: (layers ms, head
    ms)."""
    impls = [m.impl for m in model.model.modules() if getattr(m, "impl", None) is not None]
    head = model.tied_logits if model.tied_logits is not None else model.lm_head.impl
    xs = {k: torch.randn(rows, k).bfloat16() for k in {i.in_features for i in impls + [head]}}

    def best(fn):
        fn()
        t = float("inf")
        for _ in range(passes):
            t0 = time.perf_counter()
            fn()
            t = min(t, time.perf_counter() - t0)
        return t * 1e3

    onednn = [i for i in impls if getattr(i, "onednn", None) is not None]
    return {
        "layers_ms": best(lambda: [i(xs[i.in_features]) for i in impls]),
        "head_ms": best(lambda: head(xs[head.in_features])),
        "onednn_layers_ms": best(
            lambda: [
                torch.ops.mkldnn._linear_pointwise(
                    xs[i.in_features], i.onednn, None, "none", [], ""
                )
                for i in onednn
            ]
        )
        if onednn
        else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batches", default="8,32,64")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the timed decode steps")
    p.add_argument(
        "--prefill-threads",
        type=int,
        default=None,
        help="torch threads of the untimed prefills (default --threads)",
    )
    p.add_argument(
        "--core",
        type=int,
        default=None,
        help="run the timed steps on this core only (as taskset -c)",
    )
    p.add_argument(
        "--gemv-max-rows",
        default=None,
        help="comma-separated GEMV row limits to compare (default: pdserve's GEMV_MAX_ROWS)",
    )
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "pdserve" / "models")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    a.prefill_threads = a.prefill_threads or a.threads
    torch.set_num_threads(a.prefill_threads)
    import pdserve
    from pdserve.layers import linear

    gemv_rows = (
        [int(g) for g in a.gemv_max_rows.split(",")] if a.gemv_max_rows else [linear.GEMV_MAX_ROWS]
    )
    from pdserve.engine.request import Req, SamplingParams

    path = str(model_dir(a.cache_dir))
    batches = sorted(int(b) for b in a.batches.split(","))
    t0 = time.perf_counter()
    eng = pdserve.Engine(
        model_path=path,
        load_format="dummy",
        dtype="bfloat16",
        torch_num_threads=a.prefill_threads,
        disable_radix_cache=True,
        max_total_tokens=batches[-1] * (a.input_len + 4 * a.steps + 16),
        max_running_requests=batches[-1],
    )
    print(f"loaded in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    sched = eng.scheduler
    model = sched.runner.model
    assert model.model.decode_stack is not None, "the decoder stack is not enabled"
    rng = random.Random(0)
    sp = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 1 << 20, "ignore_eos": True})
    rows = []
    for b in batches:
        while len(sched.running) + len(sched.waiting) < b:
            ids = [rng.randrange(100, 40000) for _ in range(a.input_len)]
            sched.add_request(
                Req(rid=f"r{len(sched.running) + len(sched.waiting)}", input_ids=ids, sampling=sp)
            )
        set_gemv_max_rows(eng, linear.GEMV_MAX_ROWS)
        t0 = time.perf_counter()
        while sched.waiting or any(r.extend_len > 1 for r in sched.running):
            sched.step()
        sched.step()  # one decode step, warm
        print(
            f"batch {b}: prefilled in {time.perf_counter() - t0:.0f} s (load "
            f"{os.getloadavg()[0]:.1f})",
            file=sys.stderr,
        )
        row = {
            "batch": b,
            "load": os.getloadavg()[0],
            "context": statistics.mean(r.seq_len for r in sched.running),
        }
        torch.set_num_threads(a.threads)
        all_cores = os.sched_getaffinity(0)
        if a.core is not None:
            os.sched_setaffinity(0, {a.core})
        for g in gemv_rows:
            set_gemv_max_rows(eng, g)
            row[f"stack gemv<={g}"] = timed_steps(eng, a.steps, stack_on=True)
            row[f"layers gemv<={g}"] = timed_steps(eng, a.steps, stack_on=False)
            row[f"matmul gemv<={g}"] = matmul_alone(model, b)
        torch.set_num_threads(a.prefill_threads)
        os.sched_setaffinity(0, all_cores)
        rows.append(row)
        assert len(sched.running) == b
        if a.json:  # after every batch: a long run interrupted keeps what it measured
            with open(a.json, "w") as f:
                json.dump(
                    {"machine": lscpu_model(), "threads": a.threads, "rows": rows}, f, indent=1
                )

    print(
        f"machine: {platform.machine()}, {lscpu_model()}, {a.threads} torch threads, "
        f"torch {torch.__version__}"
    )
    print(f"model: {path} (Llama-3.2-1B-shaped, random bf16); contexts ~{a.input_len} tokens")
    print(
        "| batch | path | step (ITL) ms | decode tok/s | matmuls alone ms | of step | split (ms "
        "per step) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        for g in gemv_rows:
            m = r[f"matmul gemv<={g}"]
            mm = m["layers_ms"] + m["head_ms"]
            for path in ("stack", "layers"):
                s = r[f"{path} gemv<={g}"]
                split = ", ".join(
                    f"{k} {v:.1f}" for k, v in sorted(s["parts_ms"].items(), key=lambda kv: -kv[1])
                )
                print(
                    f"| {r['batch']} | {path}, GEMV <= {g} rows | {s['step_ms']:.1f} "
                    f"| {r['batch'] / s['step_ms'] * 1e3:.1f} | {mm:.1f} | {mm / s['step_ms']:.2f} "
                    f"| {split} |"
                )
            print(
                f"| {r['batch']} | matmuls alone, GEMV <= {g} rows: layers {m['layers_ms']:.1f} + "
                f"head {m['head_ms']:.1f}; layers in oneDNN only {m['onednn_layers_ms'] or 0:.1f}; "
                f"load {r['load']:.1f} | | | | | |"
            )


if __name__ == "__main__":
    main()
