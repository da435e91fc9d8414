"""Two prefill servers with and without a shared Mooncake prefix store
(``--hicache-storage-backend mooncake``), side by side in one run, on a multi-turn workload with
a shared system prompt.

  python benchmarks/kv_store.py [--model-path DIR] [--sessions 5] [--turns 4] [--system 512]
      [--user 96] [--reply 32] [--json OUT]

Per set-up: two prefills, one decode (local transfer backend), a round-robin router in front; one
torch thread per server, every server on the same cores. ``store``: the prefills run the
hierarchical cache with the store tier (write-through) on one ``mooncake_master`` (TCP);
``local``: the same servers with their own prefix caches only. Workload: ``--sessions``
conversations of ``--turns`` turns, every prompt the system prompt (shared by all sessions), the
conversation so far and ``--user`` new tokens; each turn's reply (``--reply`` tokens, fixed random
ids so both set-ups see the same prompts) joins the history. Turns go one at a time, session
after session, alternating the set-ups; with an odd number of sessions the round robin sends a
session's consecutive turns to different prefills (a router balancing load, not following
caches). Reported per set-up: TTFT p50/p99, prompt tokens the prefills computed (not found in
their pool or tiers) and the tokens found in the store.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import lscpu_model  # noqa: E402
from pd_overhead import ttft  # noqa: E402

from pdserve.server.store_master import StoreMaster  # noqa: E402
from tests.helpers import cluster as c  # noqa: E402


def prefill_stats(prefills: list[c.Proc]) -> dict:
    out = {"computed": 0, "store_hit_tokens": 0, "store_writes": 0}
    for p in prefills:
        s = p.http.get("/server_info").json()["internal_states"][0]
        out["computed"] += s["prompt_tokens"] - s["cache_hit_tokens"]
        out["store_hit_tokens"] += s.get("hicache_hit_tokens_storage", 0)
        out["store_writes"] += s.get("hicache_writes_storage", 0)
    return out


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default=None, help="default: the demo model (SmolLM2-135M)")
    ap.add_argument("--sessions", type=int, default=5)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system", type=int, default=512, help="tokens of the shared system prompt")
    ap.add_argument("--user", type=int, default=96, help="new tokens per turn")
    ap.add_argument("--reply", type=int, default=32, help="reply tokens added to the history")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.model_path is None:
        from pdserve.models.demo import ensure_demo_model

        a.model_path = ensure_demo_model()
    logs = Path(tempfile.mkdtemp(prefix="kv-store-"))
    common = ["--max-total-tokens", "32768", "--dtype", "bfloat16"]
    master = StoreMaster(log_path=str(logs / "mooncake_master.log")).wait_ready()
    store = [
        "--enable-hierarchical-cache",
        "--hicache-storage-backend",
        "mooncake",
        "--hicache-storage-backend-extra-config",
        master.client_config_json(global_segment_size="1GB"),
    ]
    setups: dict[str, dict] = {}
    procs: list[c.Proc] = []
    try:
        for name, flags in (("store", store), ("local", [])):
            prefills = [
                c.prefill(f"P{i}-{name}", a.model_path, logs, *common, *flags)[0] for i in range(2)
            ]
            decode = c.decode(f"D-{name}", a.model_path, logs, *common)
            setups[name] = {"prefills": prefills, "decode": decode}
            procs += [*prefills, decode]
        c.start_all(procs)
        for name, s in setups.items():
            s["router"] = c.router(
                f"R-{name}", s["prefills"], [s["decode"]], logs, "--policy", "round_robin"
            ).start()
            procs.append(s["router"])
        rng = random.Random(0)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(100, 40000) for _ in range(n)]

        for s in setups.values():  # warm-up: one short unrelated prompt per prefill
            for _ in s["prefills"]:
                ttft(s["router"].url, tokens(64))
        base = {name: prefill_stats(s["prefills"]) for name, s in setups.items()}
        system = tokens(a.system)
        histories = [list(system) for _ in range(a.sessions)]
        times: dict[str, list[float]] = {name: [] for name in setups}
        prompt_tokens = 0
        for turn in range(a.turns):
            for i in range(a.sessions):
                prompt = histories[i] + tokens(a.user)
                prompt_tokens += len(prompt)
                order = list(setups) if (turn + i) % 2 == 0 else list(reversed(setups))
                for name in order:
                    times[name].append(ttft(setups[name]["router"].url, prompt))
                histories[i] = prompt + tokens(a.reply)
        time.sleep(0.2)  # the last request's stats
        rows = []
        for name, s in setups.items():
            now = prefill_stats(s["prefills"])
            row = {
                "setup": name,
                "requests": len(times[name]),
                "prompt_tokens": prompt_tokens,
                "computed_tokens": now["computed"] - base[name]["computed"],
                "store_hit_tokens": now["store_hit_tokens"] - base[name]["store_hit_tokens"],
                "store_writes": now["store_writes"] - base[name]["store_writes"],
                "ttft_p50_s": statistics.median(times[name]),
                "ttft_p99_s": percentile(times[name], 0.99),
                "ttft_all_s": times[name],
            }
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "ttft_all_s"}), flush=True)
    finally:
        for p in reversed(procs):
            p.stop()
        master.stop()
    import torch

    store_row, local_row = rows
    ratios = {
        "computed_store_over_local": store_row["computed_tokens"] / local_row["computed_tokens"],
        "ttft_p50_store_over_local": store_row["ttft_p50_s"] / local_row["ttft_p50_s"],
        "ttft_p99_store_over_local": store_row["ttft_p99_s"] / local_row["ttft_p99_s"],
    }
    print(f"machine: {platform.machine()}, {lscpu_model()}; torch {torch.__version__}")
    print(
        f"model {a.model_path}; {a.sessions} sessions x {a.turns} turns, system {a.system}, "
        f"user {a.user}, reply {a.reply} tokens; logs {logs}"
    )
    print(f"{'setup':>6} {'computed':>9} {'store hit':>10} {'TTFT p50 s':>11} {'TTFT p99 s':>11}")
    for r in rows:
        print(
            f"{r['setup']:>6} {r['computed_tokens']:>9} {r['store_hit_tokens']:>10} "
            f"{r['ttft_p50_s']:>11.3f} {r['ttft_p99_s']:>11.3f}"
        )
    print(json.dumps(ratios))
    if a.json:
        Path(a.json).write_text(
            json.dumps({"args": vars(a), "rows": rows, "ratios": ratios}, indent=1)
        )


if __name__ == "__main__":
    main()
