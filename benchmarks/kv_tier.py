"""Multi-turn chat whose working set is several times the KV pool, served without and with the
tiers below the pool (``--enable-hierarchical-cache``), in one run on the same model.

  python benchmarks/kv_tier.py [--conversations 12] [--turns 4] [--doc 1024] [--user 64]
      [--out 16] [--pool-tokens 4096] [--json OUT]

The model is SmolLM2-135M-shaped (random bf16 weights, ``--load-format dummy``). Each of
``--conversations`` conversations starts with a ``--doc``-token document and adds ``--user``
tokens per turn after the previous answer (``--out`` tokens); turns go round robin over the
conversations, one request at a time, so a conversation's context has been pushed out of a
``--pool-tokens`` pool by the others before its next turn. Contenders (one server each, started
side by side, run one after another on the same prompts): ``none`` (the prefix cache only),
``host`` (a host tier of 4x the pool), ``disk`` (a host tier of a quarter of the pool over a file
tier, so most hits come from disk). Reported per contender: prompt tokens computed (prompt
minus cached), TTFT p50/p99 over the turns after the first, tier hits by medium, and the ratios
to ``none``. Outputs must agree token for token across contenders (greedy).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import lscpu_model  # noqa: E402

from tests.helpers import cluster as c  # noqa: E402

CONFIG = dict(  # SmolLM2-135M's shape
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    hidden_act="silu",
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="bfloat16",
)


def model_dir(cache: Path) -> Path:
    from tests.helpers.checkpoints import smollm2_tokenizer_dir

    key = hashlib.sha256(json.dumps(CONFIG, sort_keys=True).encode()).hexdigest()[:10]
    out = cache / f"smollm2-135m-shape-{key}"
    if not (out / "config.json").exists():
        tmp = Path(f"{out}.tmp{os.getpid()}")
        shutil.copytree(smollm2_tokenizer_dir(), tmp)
        (tmp / "config.json").write_text(json.dumps(CONFIG, indent=1))
        os.replace(tmp, out)
    return out


def turn(url: str, ids: list[int], n_out: int) -> tuple[float, list[int]]:
    """(TTFT, output ids) of one streamed greedy request."""
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": n_out, "ignore_eos": True},
        "stream": True,
    }
    t0, first, out = time.perf_counter(), None, []
    with httpx.stream("POST", url + "/generate", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ids_now = json.loads(line[6:]).get("output_ids") or []
                if ids_now and first is None:
                    first = time.perf_counter() - t0
                out = ids_now
    return first, out


def stats(s: c.Proc) -> dict:
    return s.http.get("/server_info").json()["internal_states"][0]


def run(server: c.Proc, a, docs: list[list[int]], users: list[list[list[int]]]) -> dict:
    before = stats(server)
    convs = [list(d) for d in docs]
    ttfts, outs = [], []
    for t in range(a.turns):
        for i, conv in enumerate(convs):
            conv += users[i][t]
            ttft, out = turn(server.url, conv, a.out)
            conv += out
            outs.append(out)
            if t > 0:
                ttfts.append(ttft)
    after = stats(server)
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cache_hit_tokens"] - before["cache_hit_tokens"]
    ttfts.sort()
    return {
        "prompt_tokens": prompt,
        "computed_tokens": prompt - cached,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
        "tier_hit_tokens": {
            m: after.get(f"hicache_hit_tokens_{m}", 0) - before.get(f"hicache_hit_tokens_{m}", 0)
            for m in ("cpu", "storage")
        },
        "outputs": outs,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--doc", type=int, default=1024)
    ap.add_argument("--user", type=int, default=64)
    ap.add_argument("--out", type=int, default=16)
    ap.add_argument("--pool-tokens", type=int, default=4096)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    model = str(model_dir(Path(tempfile.gettempdir()) / "pdserve-bench"))
    logs = Path(tempfile.mkdtemp(prefix="kv-tier-"))
    common = [
        "--load-format",
        "dummy",
        "--dtype",
        "bfloat16",
        "--page-size",
        "16",
        "--max-total-tokens",
        str(a.pool_tokens),
        "--torch-num-threads",
        "1",
    ]
    contenders = {
        "none": [],
        "host": ["--enable-hierarchical-cache", "--hicache-ratio", "4"],
        "disk": [
            "--enable-hierarchical-cache",
            "--hicache-ratio",
            "0.25",
            "--hicache-storage-backend",
            "file",
            "--hicache-file-backend-storage-dir",
            str(logs / "disk"),
        ],
    }
    servers = {k: c.server(f"S-{k}", model, logs, *common, *v) for k, v in contenders.items()}
    rng = random.Random(0)
    docs = [[rng.randrange(100, 40000) for _ in range(a.doc)] for _ in range(a.conversations)]
    users = [
        [[rng.randrange(100, 40000) for _ in range(a.user)] for _ in range(a.turns)]
        for _ in range(a.conversations)
    ]
    results = {}
    try:
        for s in servers.values():
            s.start(wait=False)
        for s in servers.values():
            s.wait_ready(timeout=900)
        for k, s in servers.items():
            results[k] = run(s, a, docs, users)
            print(
                k, json.dumps({x: y for x, y in results[k].items() if x != "outputs"}), flush=True
            )
    finally:
        for s in servers.values():
            s.stop()
    base = results["none"]
    base_outputs = base["outputs"]
    for r in results.values():
        r["outputs_match_none"] = r.pop("outputs") == base_outputs
    for k, r in results.items():
        r["computed_ratio"] = r["computed_tokens"] / base["computed_tokens"]
        r["ttft_p50_ratio"] = r["ttft_p50_s"] / base["ttft_p50_s"]
        r["ttft_p99_ratio"] = r["ttft_p99_s"] / base["ttft_p99_s"]
    working = a.conversations * (a.doc + a.turns * (a.user + a.out))
    import torch

    print(f"machine: {platform.machine()}, {lscpu_model()}; torch {torch.__version__}")
    print(
        f"model: SmolLM2-135M-shaped (random bf16), pool {a.pool_tokens} tokens, working set "
        f"{working} tokens ({working / a.pool_tokens:.1f}x the pool), "
        f"{a.conversations} conversations x {a.turns} turns; logs {logs}"
    )
    print(
        f"{'tier':>5} {'computed':>9} {'ratio':>6} {'TTFT p50 ms':>12} {'ratio':>6} "
        f"{'TTFT p99 ms':>12} {'ratio':>6} {'host hits':>10} {'disk hits':>10} {'same out':>9}"
    )
    for k, r in results.items():
        print(
            f"{k:>5} {r['computed_tokens']:>9} {r['computed_ratio']:>6.2f} "
            f"{r['ttft_p50_s'] * 1e3:>12.1f} {r['ttft_p50_ratio']:>6.2f} "
            f"{r['ttft_p99_s'] * 1e3:>12.1f} {r['ttft_p99_ratio']:>6.2f} "
            f"{r['tier_hit_tokens']['cpu']:>10} {r['tier_hit_tokens']['storage']:>10} "
            f"{str(r['outputs_match_none']):>9}"
        )
    if a.json:
        Path(a.json).write_text(
            json.dumps({"args": vars(a), "machine": lscpu_model(), "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
