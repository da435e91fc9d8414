"""A Mamba2 hybrid against a dense model of the same width, side by side in one run.

  python benchmarks/hybrid.py [--contexts 1024,8192] [--batches 1,32] [--max-batch-tokens 40000]
      [--threads 2] [--dtype bfloat16] [--steps 8] [--pd] [--json OUT]

The hybrid has Granite-4.0-H-350M's published sizes (``GraniteMoeHybridForCausalLM``: hidden
768, 32 layers, 12 query heads, Mamba2 inner size 1536 in 48 heads of 32, one group, state 128,
conv 4, shared MLP 2048, scan blocks 256), with 4 attention layers (4 KV heads of 64) at 5, 15,
25 and 31 (the larger Granite 4 hybrids' one in ten; the placement is ours); the dense model is a
Llama of the same width and depth (hidden 768, 32 layers, 12 heads, 4 KV heads, MLP 2048). Both use
the SmolLM2 vocabulary (49,152 rows instead of 100,352) and random weights
(``--load-format dummy``), in ``--dtype``. Through the offline ``pdserve.Engine`` (``--threads``
torch threads), for each model in turn:

- prefill tok/s: one prompt of each context length, one output token;
- decode tok/s at each batch and context: B prompts of the context length run for ``--steps`` + 1
  output tokens; the median time of the runner's decode-only forwards (every row one new token)
  is the step (skipped where B x context passes ``--max-batch-tokens``: the prefill alone would
  take minutes);
- cache bytes per request at each context: the pages of the paged groups and the per-request
  state, from the engine's cache groups (what decode holds and what PD moves).

With ``--pd``: a 1P1D pair of each model (local transfer backend, one torch thread each) serves
one request per context length; the prefill's record of the transfer gives the bytes moved and
the seconds from the first send to the end, and the time from the last chunk's forward to the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HIDDEN, LAYERS, HEADS, KV_HEADS, MLP = 768, 32, 12, 4, 2048
ATTENTION_AT = (5, 15, 25, 31)


def model_dirs(dtype: str) -> dict[str, str]:
    import transformers

    common = dict(
        vocab_size=49152,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=32768,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
        dtype=dtype,
    )
    configs = {
        "hybrid": (
            transformers.GraniteMoeHybridConfig(
                **common,
                intermediate_size=MLP,
                shared_intermediate_size=MLP,
                num_local_experts=0,
                layer_types=["attention" if i in ATTENTION_AT else "mamba" for i in range(LAYERS)],
                position_embedding_type="rope",
                attention_multiplier=0.015625,
                embedding_multiplier=12.0,
                residual_multiplier=0.246,
                logits_scaling=3.0,
                mamba_n_heads=48,
                mamba_d_head=32,
                mamba_n_groups=1,
                mamba_d_state=128,
                mamba_d_conv=4,
                mamba_expand=2,
                mamba_chunk_size=256,
            ),
            "GraniteMoeHybridForCausalLM",
        ),
        "dense": (
            transformers.LlamaConfig(**common, intermediate_size=MLP, rope_theta=10000.0),
            "LlamaForCausalLM",
        ),
    }
    return config_dirs(configs, "granite4-350m-shape")


def config_dirs(configs: dict, tag: str) -> dict[str, str]:
    """A directory per ``name: (config, architecture)`` with the config and the SmolLM2 tokenizer
    (weights: ``--load-format dummy``), made once under the temp dir."""
    from tests.helpers.checkpoints import smollm2_tokenizer_dir

    out = {}
    for name, (cfg, arch) in configs.items():
        d = os.path.join(tempfile.gettempdir(), f"pdserve-bench-{name}-{tag}")
        if not os.path.exists(os.path.join(d, "config.json")):
            os.makedirs(d, exist_ok=True)
            cfg.architectures = [arch]
            cfg.save_pretrained(d)
            for f in os.listdir(smollm2_tokenizer_dir()):
                if not f.startswith("."):
                    subprocess.run(["cp", os.path.join(smollm2_tokenizer_dir(), f), d], check=True)
        out[name] = d
    return out


def cache_bytes(runner, context: int) -> dict:
    """Bytes one request of ``context`` tokens holds: pages of paged groups, the state."""
    page = runner.args.page_size
    pages = -(-context // page)
    kv = state = 0
    for g, pool in zip(runner.cache_groups, runner.pools):
        item = torch_bytes(pool)
        if g.spec.per_request:
            state += item
        else:
            kv += pages * item
    return {"kv_bytes": kv, "state_bytes": state, "total": kv + state}


def torch_bytes(pool) -> int:
    """Bytes of one item (a page, or a slot) of every layer of ``pool``."""
    return pool.nbytes // pool.num_pages


class ForwardClock:
    """Times the runner's forwards; ``decode`` holds those whose rows are all one new token."""

    def __init__(self, runner):
        self.decode: list[float] = []
        forward = runner.forward

        def timed(fb):
            t0 = time.perf_counter()
            try:
                return forward(fb)
            finally:
                if all(n == 1 for n in fb.extend_lens):
                    self.decode.append(time.perf_counter() - t0)

        runner.forward = timed


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def timed(eng, ids, new_tokens: int) -> float:
    sp = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    t0 = time.perf_counter()
    eng.generate(input_ids=ids, sampling_params=sp)
    return time.perf_counter() - t0


def run_engine(name: str, path: str, args, cache_of=None, cache_at=None) -> dict:
    """One model's prefill and decode rows, and its cache per request: ``cache_of(runner,
    context)`` at each of ``cache_at`` (by default ``cache_bytes`` at each prefill context)."""
    import pdserve

    contexts, batches = args.contexts, args.batches
    most = max(
        [c * b for c in contexts for b in batches if c * b <= args.max_batch_tokens] + contexts
    )
    eng = pdserve.Engine(
        model_path=path,
        load_format="dummy",
        dtype=args.dtype,
        torch_num_threads=args.threads,
        max_total_tokens=most + 4096,
        max_running_requests=max(batches),
        chunked_prefill_size=2048,
        disable_radix_cache=True,
    )
    out: dict = {"model": name, "prefill": [], "decode": [], "cache": []}
    try:
        runner = eng.scheduler.runner
        clock = ForwardClock(runner)
        out["groups"] = [g.describe() for g in runner.cache_groups]
        timed(eng, prompts(1, 64, 0), 2)  # warm-up
        for ctx in cache_at or ():
            out["cache"].append({"context": ctx, **cache_of(runner, ctx)})
        for ctx in contexts:
            t = timed(eng, prompts(1, ctx, ctx), 1)
            out["prefill"].append({"context": ctx, "s": t, "tok_s": ctx / t})
            if cache_at is None:
                out["cache"].append({"context": ctx, **cache_bytes(runner, ctx)})
            print(f"{name}: prefill {ctx} tokens {ctx / t:.0f} tok/s", file=sys.stderr)
            for b in batches:
                if b * ctx > args.max_batch_tokens:
                    continue
                clock.decode.clear()
                timed(eng, prompts(b, ctx, ctx + b), args.steps + 1)
                step = statistics.median(clock.decode)
                out["decode"].append(
                    {
                        "context": ctx,
                        "batch": b,
                        "step_ms": step * 1e3,
                        "tok_s": b / step,
                        "steps": len(clock.decode),
                    }
                )
                print(f"{name}: decode B={b} ctx={ctx}: {b / step:.1f} tok/s", file=sys.stderr)
    finally:
        eng.shutdown()
    return out


def run_pd(name: str, path: str, args, logs: Path) -> list[dict]:
    from tests.helpers import cluster as c

    common = [
        "--load-format",
        "dummy",
        "--dtype",
        args.dtype,
        "--torch-num-threads",
        "1",
        "--max-total-tokens",
        str(max(args.contexts) + 4096),
        "--disable-radix-cache",
    ]
    P, _ = c.prefill(f"P-{name}", path, logs, *common)
    D = c.decode(f"D-{name}", path, logs, *common)
    rows = []
    try:
        c.start_all([P, D])
        for ctx in args.contexts:
            ids = prompts(1, ctx, 7 * ctx)[0]
            body = {
                "input_ids": ids,
                "sampling_params": {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True},
                "bootstrap_host": "127.0.0.1",
                "bootstrap_port": P.bootstrap_port,
                "bootstrap_room": random.randrange(2**63),
            }
            with ThreadPoolExecutor(2) as ex:
                fp = ex.submit(httpx.post, P.url + "/generate", json=body, timeout=1800)
                fd = ex.submit(httpx.post, D.url + "/generate", json=body, timeout=1800)
                assert fp.result().status_code == 200 and fd.result().status_code == 200
            last = P.http.get("/server_info").json()["internal_states"][0]["recent_transfers"][-1]
            rows.append(
                {
                    "context": ctx,
                    "kv_bytes": last["kv_bytes"],
                    "pages_per_group": last["pages_per_group"],
                    "window_s": last["window_s"],
                    "after_last_chunk_s": last["after_last_chunk_s"],
                }
            )
            print(f"{name}: PD {ctx} tokens moved {last['kv_bytes']} bytes", file=sys.stderr)
    finally:
        for p in (P, D):
            p.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--max-batch-tokens", type=int, default=40000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--pd", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    dirs = model_dirs(args.dtype)
    result = {
        "command": " ".join(sys.argv),
        "machine": subprocess.run(["lscpu"], capture_output=True, text=True).stdout,
        "python": platform.python_version(),
        "runs": [run_engine(name, path, args) for name, path in dirs.items()],
    }
    if args.pd:
        logs = Path(tempfile.mkdtemp(prefix="pdserve-bench-hybrid-"))
        result["pd"] = {name: run_pd(name, path, args, logs) for name, path in dirs.items()}
    hybrid, dense = result["runs"]
    for kind in ("prefill", "decode"):
        for h, d in zip(hybrid[kind], dense[kind]):
            print(
                f"{kind} {h.get('batch', 1)}x{h['context']}: hybrid {h['tok_s']:.1f} tok/s, "
                f"dense {d['tok_s']:.1f} tok/s, ratio {h['tok_s'] / d['tok_s']:.2f}"
            )
    for h, d in zip(hybrid["cache"], dense["cache"]):
        print(
            f"cache per request at {h['context']}: hybrid {h['total'] / 2**20:.1f} MiB "
            f"(state {h['state_bytes'] / 2**20:.1f}), dense {d['total'] / 2**20:.1f} MiB"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
