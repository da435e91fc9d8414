"""Goodput under a TTFT SLO against offered load, with and without the router's admission control.

  python benchmarks/admission.py [--model-path DIR] [--slo-ms 1000] [--seconds 20]
      [--loads 0.5,1,2,3] [--json OUT] [--plot OUT.png]

One colocated server (one torch thread) behind three routers started side by side: ``plain`` (every
request is dispatched), ``slo`` (``--ttft-slo-ms``: a request whose estimated time to first token
exceeds the SLO is answered 429 at once) and ``cap`` (``--max-concurrent-requests --cap`` with no
refill and no queue: a request beyond that many in flight is answered 429). The server's sustainable
rate is measured first (a closed loop of 8 clients); then each load (a multiple of that rate,
Poisson arrivals, open loop) is offered to each router in turn for ``--seconds``. A request is a
streamed ``/generate`` of a random prompt (``--prompt-tokens``) for ``--output-tokens`` tokens. Per
point: goodput (requests that finished with TTFT within the SLO, per second), the p50/p99 TTFT of
the requests the router let through, the share shed and how fast a shed request was answered.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers import cluster as c  # noqa: E402


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def one(client: httpx.AsyncClient, url: str, ids: list[int], new: int) -> dict:
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": new, "ignore_eos": True, "temperature": 0},
    }
    t0 = time.monotonic()
    ttft = None
    async with client.stream("POST", url + "/generate", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "answered_s": time.monotonic() - t0}
        async for line in r.aiter_lines():
            if line.startswith("data:") and ttft is None:
                ttft = time.monotonic() - t0
    return {"status": 200, "ttft_s": ttft, "e2e_s": time.monotonic() - t0}


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


async def capacity(url: str, args, seconds: float = 10.0) -> float:
    """Completed requests per second of a closed loop of 8 clients."""
    rng = random.Random(1)
    done = 0
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=300) as client:

        async def worker():
            nonlocal done
            while time.monotonic() < deadline:
                out = await one(client, url, prompt(rng, args.prompt_tokens), args.output_tokens)
                done += out["status"] == 200

        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(8)))
        return done / (time.monotonic() - t0)


async def offer(url: str, rate: float, args, seed: int) -> dict:
    """Poisson arrivals at ``rate`` for ``args.seconds``; every request awaited to its end."""
    rng = random.Random(seed)
    tasks = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as client:
        t0 = time.monotonic()
        next_at = t0
        while next_at < t0 + args.seconds:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            ids = prompt(rng, args.prompt_tokens)
            tasks.append(asyncio.create_task(one(client, url, ids, args.output_tokens)))
            next_at += rng.expovariate(rate)
        outs = await asyncio.gather(*tasks)
        wall = time.monotonic() - t0
    slo = args.slo_ms / 1000
    ok = [o for o in outs if o["status"] == 200]
    shed = [o for o in outs if o["status"] == 429]
    ttfts = [o["ttft_s"] for o in ok if o["ttft_s"] is not None]
    return {
        "offered_per_s": len(outs) / args.seconds,
        "requests": len(outs),
        "goodput_per_s": sum(t <= slo for t in ttfts) / wall,
        "throughput_per_s": len(ok) / wall,
        "shed_share": len(shed) / len(outs),
        "other_errors": len(outs) - len(ok) - len(shed),
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "shed_answer_p99_s": percentile([o["answered_s"] for o in shed], 0.99),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path")
    p.add_argument("--slo-ms", type=float, default=1000.0)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--loads", default="0.5,1,2,3")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--cap", type=int, default=8, help="the cap router's requests in flight")
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args()
    if args.model_path is None:
        from tests.helpers.checkpoints import build_tiny_checkpoint

        args.model_path = build_tiny_checkpoint("llama")
    logs = Path(tempfile.mkdtemp(prefix="admission-bench-"))
    S = c.server("S", args.model_path, logs, "--max-total-tokens", "65536")
    procs = [S]
    try:
        c.start_all([S])
        plain = c.router("plain", [], [], logs, "--worker", S.url)
        slo = c.router("slo", [], [], logs, "--worker", S.url, "--ttft-slo-ms", str(args.slo_ms))
        cap_router = c.router(
            "cap",
            [],
            [],
            logs,
            "--worker",
            S.url,
            "--max-concurrent-requests",
            str(args.cap),
            "--rate-limit-tokens-per-second",
            "0",
            "--queue-size",
            "0",
        )
        procs += [plain, slo, cap_router]
        c.start_all([plain, slo, cap_router])
        time.sleep(2)  # the routers read the server's calibration and first load
        cap = asyncio.run(capacity(S.url, args))
        print(f"sustainable rate (closed loop of 8): {cap:.2f} requests/s", flush=True)
        rows = []
        for i, load in enumerate(float(x) for x in args.loads.split(",")):
            for name, router in (("plain", plain), ("slo", slo), ("cap", cap_router)):
                r = asyncio.run(offer(router.url, load * cap, args, seed=100 + i))
                r.update(router=name, load=load)
                rows.append(r)
                print(json.dumps(r), flush=True)
    finally:
        for proc in reversed(procs):
            proc.stop()
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if "Model name" in ln), "")
    result = {
        "machine": {"cpu": model, "python": platform.python_version()},
        "args": vars(args),
        "capacity_per_s": cap,
        "rows": rows,
    }
    print(
        "\n| load | router | offered/s | goodput/s | served/s | shed | TTFT p50 | TTFT p99 | "
        "shed answered p99 |\n|---|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        print(
            f"| {r['load']:g}x | {r['router']} | {r['offered_per_s']:.2f} | "
            f"{r['goodput_per_s']:.2f} | {r['throughput_per_s']:.2f} | {r['shed_share']:.0%} | "
            f"{fmt(r['ttft_p50_s'])} | {fmt(r['ttft_p99_s'])} | {fmt(r['shed_answer_p99_s'])} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        labels = {
            "plain": "no admission control",
            "slo": f"--ttft-slo-ms {args.slo_ms:g}",
            "cap": f"--max-concurrent-requests {args.cap}, no queue",
        }
        for name, label in labels.items():
            pts = [r for r in rows if r["router"] == name]
            ax.plot(
                [r["offered_per_s"] for r in pts],
                [r["goodput_per_s"] for r in pts],
                marker="o",
                label=label,
            )
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel(f"goodput (requests/s with TTFT <= {args.slo_ms:g} ms)")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
