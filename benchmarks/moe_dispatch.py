"""One MoE layer's dispatch on 2 ranks: all-gather + all-reduce (``--moe-a2a-backend none``)
against all-to-all (``torch``), timing the real ``SparseMoE.run`` over gloo.

  python benchmarks/moe_dispatch.py [--tokens 1,32,256] [--layouts dp,tp] [--hidden 2048]
      [--experts 128] [--top-k 8] [--inter 768] [--rounds 5] [--json out.json]
  python benchmarks/moe_dispatch.py --server-model PATH [--server-prompts 32] [--json out.json]

Two processes (one per core, one torch thread each) join a gloo group as a ``--tp-size 2
--ep-size 2`` server's scheduler ranks do (``distributed.init_parallel``) and build one sparse
layer of Qwen3-30B-A3B's shapes (hidden 2048, 128 experts, top 8, expert MLP 768; random bf16
weights, std 0.02, the router's scaled by 2 so that its softmax is not flat). Each rank holds 64
whole experts, run by pdserve's fused kernel when it is built (``Experts.prepack``), else by
``grouped_mm``. Both backends share the same experts and router weights; only the dispatch
differs. Layouts:

- ``dp`` (``--enable-dp-attention --dp-size 2``): each rank has its own T tokens. ``none``
  all-gathers the 2T hidden states (bf16), routes and runs its experts' share of all of them and
  all-reduces the float32 [2T, H] partial sums; ``torch`` routes its own T tokens and sends each
  row only to the ranks that hold one of its experts (``dispatch_combine``).
- ``tp`` (tensor-parallel attention): both ranks hold the same T tokens. ``none`` all-reduces the
  float32 [T, H] partial sums; ``torch`` routes T/2 tokens per rank, dispatches them all-to-all and
  all-gathers the two halves' outputs (``gather_shares``).

For every token count the backends alternate for ``--rounds`` rounds (the host is shared: the
ratio is the figure); a layer time is the slower rank's, median over the iterations. Bytes on the
wire are counted from the collectives' actual arguments while the layer runs once more (not
timed): what a rank sends to the other ranks (all-to-all: its remote splits; all-gather: its
block to every other rank; all-reduce: a ring's 2 (P-1)/P of the buffer), summed over the ranks,
per token of the step. The formulas this reproduces, and what they predict at more ranks, are
printed after the table (``predict``).

``--server-model PATH`` instead serves an MoE checkpoint (e.g. ``compare_vllm_moe.py
--build-only --num-layers 8``) with ``pdserve serve --tp-size 2 --ep-size 2 --enable-dp-attention
--dp-size 2 --moe-a2a-backend B`` for each backend in turn, one server at a time, and runs
``compare_vllm.py``'s short workload against it (``--server-prompts`` requests at once).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

WORLD = 2
KINDS = ("all_gather", "all_reduce", "all_to_all")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WireCounter:
    """Counts the bytes this rank sends to other ranks through the collectives the MoE layer calls
    (``torch.distributed`` functions wrapped while ``active``)."""

    def __init__(self, rank: int, world: int):
        import torch.distributed as dist

        self.rank, self.world = rank, world
        self.active = False
        self.sent: dict[str, int] = {}
        self._orig = {
            name: getattr(dist, name) for name in ("all_reduce", "all_gather", "all_to_all_single")
        }
        for name, fn in self._orig.items():
            setattr(dist, name, self._wrap(name, fn))

    def _add(self, kind: str, n: int) -> None:
        if self.active:
            self.sent[kind] = self.sent.get(kind, 0) + n

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            group = kwargs.get("group")
            size = self.world if group is None else torch.distributed.get_world_size(group)
            if size > 1:
                if name == "all_reduce":
                    t = args[0]
                    self._add("all_reduce", 2 * (size - 1) * t.numel() * t.element_size() // size)
                elif name == "all_gather":
                    t = args[1]
                    self._add("all_gather", (size - 1) * t.numel() * t.element_size())
                else:
                    _, inp = args[0], args[1]
                    in_splits = args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
                    me = torch.distributed.get_rank(group)
                    row = (
                        inp[0].numel() * inp.element_size()
                        if inp.dim() > 1 and inp.shape[0]
                        else inp.element_size()
                    )
                    if in_splits is None:
                        per = inp.numel() * inp.element_size() // size
                        remote = per * (size - 1)
                    else:
                        remote = sum(int(c) for r, c in enumerate(in_splits) if r != me) * row
                    self._add("all_to_all", remote)
            return fn(*args, **kwargs)

        return counted


def build_layer(par, backend: str, args, experts, router, placement):
    from pdserve.layers.moe.context import MoEContext, MoEOptions
    from pdserve.layers.moe.layer import SparseMoE

    ctx = MoEContext(par, MoEOptions(ep_size=WORLD, a2a_backend=backend))
    ctx.check(args.experts)
    ctx.placement = placement
    return SparseMoE(0, router, experts, ctx)


def make_weights(args, ep_rank: int, placement):
    """The router (every rank the same) and this rank's experts, random bf16 (fixed seeds)."""
    from pdserve.layers.moe.experts import Experts
    from pdserve.layers.moe.router import SoftmaxTopK

    g = torch.Generator().manual_seed(0)
    router = SoftmaxTopK(args.hidden, args.experts, args.top_k, renormalize=True, cast_back=True)
    router.weight.data = (
        torch.randn(args.experts, args.hidden, generator=g) * 0.02 * args.router_scale
    ).bfloat16()
    slots = placement.rank_slots(0, ep_rank)
    experts = Experts(args.hidden, (0, args.inter), slots)
    w13 = torch.empty(len(slots), 2 * args.inter, args.hidden, dtype=torch.bfloat16)
    w2 = torch.empty(len(slots), args.hidden, args.inter, dtype=torch.bfloat16)
    for i, e in enumerate(slots):  # expert e's weights do not depend on the rank holding it
        ge = torch.Generator().manual_seed(1000 + e)
        w13[i] = (torch.randn(2 * args.inter, args.hidden, generator=ge) * 0.02).bfloat16()
        w2[i] = (torch.randn(args.hidden, args.inter, generator=ge) * 0.02).bfloat16()
    experts.w13 = torch.nn.Parameter(w13, requires_grad=False)
    experts.w2 = torch.nn.Parameter(w2, requires_grad=False)
    runner = "grouped_mm"
    if not args.no_fused:
        from pdserve import kernels

        ops = kernels.load()
        if ops is not None and experts.prepack(ops) > 0:
            runner = f"fused ({ops.isa()})"
    return router, experts, runner


class TimedExperts:
    """Wraps the experts' runner to add up its time (the rest of a layer is routing and
    dispatch)."""

    def __init__(self, impl):
        self.impl, self.total = impl, 0.0

    def __call__(self, *a):
        t0 = time.perf_counter()
        out = self.impl(*a)
        self.total += time.perf_counter() - t0
        return out


def worker(rank: int, layout: str, port: int, args, out_path: str) -> None:
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    from pdserve.distributed import init_parallel
    from pdserve.engine.dp_attention import DPGather
    from pdserve.layers.moe.placement import ExpertPlacement

    par = init_parallel(
        rank, WORLD, f"tcp://127.0.0.1:{port}", dp_size=WORLD if layout == "dp" else 1
    )
    counter = WireCounter(rank, WORLD)
    placement = ExpertPlacement.trivial([0], args.experts, WORLD)
    router, experts, runner = make_weights(args, rank, placement)
    timed = None
    if experts.impl is not None:
        timed = experts.impl = TimedExperts(experts.impl)
    layers = {b: build_layer(par, b, args, experts, router, placement) for b in ("none", "torch")}
    import torch.distributed as dist

    def step(backend: str, h: torch.Tensor):
        dp = DPGather(par, [h.shape[0]] * WORLD) if layout == "dp" and backend == "none" else None
        return layers[backend].run(h, dp)

    results = []
    for t in args.tokens:
        g = torch.Generator().manual_seed(10 + (rank if layout == "dp" else 0) * 7919 + t)
        h = torch.randn(t, args.hidden, generator=g).bfloat16()  # post-norm hidden states ~ N(0, 1)
        iters = max(2, min(args.max_iters, int(args.budget_s / max(1e-3, t * 8e-4 + 4e-3))))
        outs = {}
        for b in layers:  # warm-up, and the outputs for the agreement check
            outs[b] = step(b, h).float()
        diff = (outs["none"] - outs["torch"]).abs().max().item()
        # bytes: one counted pass per backend
        wire = {}
        for b in layers:
            counter.sent, counter.active = {}, True
            step(b, h)
            counter.active = False
            wire[b] = dict(counter.sent)
        times = {b: [] for b in layers}
        expert_s = {b: [] for b in layers}
        for _ in range(args.rounds):
            for b in layers:
                for _ in range(iters):
                    dist.barrier(group=par.tp.cpu_group)
                    e0 = timed.total if timed else 0.0
                    t0 = time.perf_counter()
                    step(b, h)
                    times[b].append(time.perf_counter() - t0)
                    expert_s[b].append((timed.total if timed else 0.0) - e0)
        # the slower rank per iteration, every rank's bytes
        mine = torch.tensor(
            [times[b] for b in layers] + [expert_s[b] for b in layers], dtype=torch.float64
        )
        parts = [torch.empty_like(mine) for _ in range(WORLD)]
        dist.all_gather(parts, mine, group=par.tp.cpu_group)
        slow = torch.stack(parts).amax(0)
        # every rank's bytes per backend and collective, as one int64 tensor
        mine_b = torch.tensor(
            [[wire[b].get(k, 0) for k in KINDS] for b in layers], dtype=torch.int64
        )
        parts_b = [torch.empty_like(mine_b) for _ in range(WORLD)]
        dist.all_gather(parts_b, mine_b, group=par.tp.cpu_group)
        summed = torch.stack(parts_b).sum(0)
        step_tokens = t * WORLD if layout == "dp" else t
        row = {
            "layout": layout,
            "tokens_per_rank": t,
            "step_tokens": step_tokens,
            "iters": iters * args.rounds,
            "runner": runner,
            "max_abs_diff": diff,
        }
        for i, b in enumerate(layers):
            row[b] = {
                "ms": 1e3 * statistics.median(slow[i].tolist()),
                "experts_ms": 1e3 * statistics.median(slow[len(layers) + i].tolist()),
                "bytes_per_token": int(summed[i].sum()) / step_tokens,
                "by_collective": {
                    k: int(summed[i, j]) / step_tokens for j, k in enumerate(KINDS) if summed[i, j]
                },
            }
        results.append(row)
        if rank == 0:
            print(
                f"[{layout}] T={t}: none {row['none']['ms']:.2f} ms, torch "
                f"{row['torch']['ms']:.2f} ms ({iters} x {args.rounds} iters, "
                f"outputs differ by {diff:.2e})",
                file=sys.stderr,
                flush=True,
            )
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    dist.barrier(group=par.tp.cpu_group)
    dist.destroy_process_group()


def distinct_remote(p: int, experts: int, k: int) -> float:
    """Expected number of other ranks a token's top-k (k distinct experts, uniformly drawn) reaches
    when ``p`` ranks hold ``experts / p`` experts each."""
    per = experts // p
    miss = math.comb(experts - per, k) / math.comb(experts, k)  # a given rank holds none of them
    return (p - 1) * (1 - miss)


def predict(layout: str, p: int, hidden: int, experts: int, k: int) -> dict[str, float]:
    """Bytes on the wire per token per layer (summed over ranks) at ``p`` ranks, pdserve's code:

    - none, dp: all-gather of the bf16 hidden state to the p-1 others (2H (p-1)) + ring
      all-reduce of float32 [p T, H]: every rank sends 2 (p-1)/p of p T 4H bytes, i.e. 8H (p-1)
      per token -> 10 H (p-1);
    - none, tp: the all-reduce only, of [T, H] float32 held by all: 8H (p-1)/p per rank, times p
      ranks -> 8 H (p-1);
    - torch: a token goes once to every other rank holding one of its experts (dedup: one row per
      rank, not per expert), at most min(k, p-1) remote ranks: out 2H (bf16 row) + 8k (k int32
      slot ids + k float32 weights), back 4H (float32 weighted sum) -> d (6H + 8k), d the expected
      distinct remote ranks (``distinct_remote``; k at most); tp adds the all-gather of the bf16
      outputs, 2H (p-1) per token."""
    h = hidden
    if layout == "dp":
        none = 10 * h * (p - 1)
        torch_ = distinct_remote(p, experts, k) * (6 * h + 8 * k)
    else:
        none = 8 * h * (p - 1)
        torch_ = distinct_remote(p, experts, k) * (6 * h + 8 * k) + 2 * h * (p - 1)
    return {
        "none": none,
        "torch": torch_,
        "torch_worst": min(k, p - 1) * (6 * h + 8 * k) + (2 * h * (p - 1) if layout == "tp" else 0),
    }


def machine() -> str:
    text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next(
        (ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("Model name")),
        "?",
    )
    flags = next(
        (ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("Flags")), []
    )
    isa = " ".join(f for f in flags if f.startswith(("avx512", "amx")))
    return f"{platform.machine()} {name}, {os.cpu_count()} cores, flags: {isa or 'no avx512/amx'}"


def kib(n: float) -> str:
    return f"{n / 1024:.1f}"


def serve_backends(model: str, prompts: int, out_dir: Path) -> list[dict]:
    """Each backend's short-workload summary through a 2-rank DP-attention + EP server."""
    import tempfile

    import compare_vllm

    from tests.helpers import cluster as c

    logs = Path(tempfile.mkdtemp(prefix="moe-dispatch-"))
    out = []
    for backend in ("none", "torch"):
        port = c.free_port()
        cmd = [
            sys.executable,
            "-m",
            "pdserve.cli",
            "serve",
            "--model-path",
            model,
            "--served-model-name",
            "demo",
            "--port",
            str(port),
            "--tp-size",
            "2",
            "--ep-size",
            "2",
            "--enable-dp-attention",
            "--dp-size",
            "2",
            "--moe-a2a-backend",
            backend,
            "--torch-num-threads",
            "1",
            "--dtype",
            "bfloat16",
            "--max-total-tokens",
            "32768",
        ]
        proc = c.Proc(f"pdserve-{backend}", cmd, port, logs)
        try:
            proc.start(wait=False)
            proc.wait_ready(1200)
            compare_vllm.bench(
                proc.url, model, "short", logs / f"warmup-{backend}.json", num_prompts=4
            )
            r = compare_vllm.bench(
                proc.url, model, "short", out_dir / f"server-{backend}.json", num_prompts=prompts
            )
        finally:
            proc.stop()
        out.append({"backend": backend, **r["summary"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", default="1,32,256", help="tokens per rank (dp) / per step (tp)")
    ap.add_argument("--layouts", default="dp,tp")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--router-scale", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=5, help="alternations of the two backends")
    ap.add_argument("--max-iters", type=int, default=20, help="iterations per backend per round")
    ap.add_argument("--budget-s", type=float, default=0.4, help="rough time per backend per round")
    ap.add_argument("--no-fused", action="store_true", help="run the experts with grouped_mm")
    ap.add_argument("--predict-ranks", default="2,8,64")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--server-model", default=None, help="serve this MoE checkpoint with each backend instead"
    )
    ap.add_argument("--server-prompts", type=int, default=32)
    a = ap.parse_args()
    if a.server_model:
        out_dir = Path(a.json).parent if a.json else Path(".")
        rows = serve_backends(a.server_model, a.server_prompts, out_dir)
        print(f"machine: {machine()}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print(
            f"{a.server_model}: --tp-size 2 --ep-size 2 --enable-dp-attention --dp-size 2, short "
            f"workload, {a.server_prompts} x 128 in / 64 out at once"
        )
        print("| backend | out tok/s | TTFT mean / p90 ms | TPOT mean / p90 ms |")
        print("|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['backend']} | {r['output_throughput']:.1f} | {r['ttft_ms']['mean']:.0f} / "
                f"{r['ttft_ms']['p90']:.0f} | {r['tpot_ms']['mean']:.0f} / "
                f"{r['tpot_ms']['p90']:.0f} |"
            )
        print(
            "torch / none output throughput = "
            f"{rows[1]['output_throughput'] / rows[0]['output_throughput']:.2f}"
        )
        if a.json:
            Path(a.json).write_text(json.dumps(rows, indent=2))
        return
    a.tokens = [int(x) for x in a.tokens.split(",")]
    import tempfile

    import torch.multiprocessing as mp

    rows = []
    for layout in a.layouts.split(","):
        if layout not in ("dp", "tp"):
            ap.error(f"--layouts: unknown {layout!r} (dp, tp)")
        if layout == "tp" and any(t % WORLD for t in a.tokens):
            print(
                f"[tp] token counts not divisible by {WORLD} leave one rank a smaller share",
                file=sys.stderr,
            )
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            mp.start_processes(
                worker, args=(layout, free_port(), a, f.name), nprocs=WORLD, start_method="spawn"
            )
            rows += json.loads(Path(f.name).read_text())
    print(
        f"machine: {machine()}; torch {torch.__version__}; load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(
        f"layer: hidden {a.hidden}, {a.experts} experts top {a.top_k}, expert MLP {a.inter}, bf16; "
        f"{WORLD} ranks x 1 thread, gloo over loopback; experts: {rows[0]['runner']}"
    )
    print(
        "| layout | tokens/rank | backend | ms / layer | of which experts ms | bytes/token/layer "
        "(KiB) | by collective (KiB/token) | torch / none time |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        for b in ("none", "torch"):
            x = r[b]
            by = ", ".join(f"{k} {kib(v)}" for k, v in sorted(x["by_collective"].items()))
            ratio = f"**{r['torch']['ms'] / r['none']['ms']:.2f}**" if b == "torch" else ""
            print(
                f"| {r['layout']} | {r['tokens_per_rank']} | {b} | {x['ms']:.2f} | "
                f"{x['experts_ms']:.2f} | {kib(x['bytes_per_token'])} | {by} | {ratio} |"
            )
    print("\npredicted bytes per token per layer (KiB; uniform routing, formulas in predict()):")
    print(
        "| layout | ranks | none | torch (expected) | torch (worst: min(k, P-1) ranks) "
        "| none / torch |"
    )
    print("|---|---|---|---|---|---|")
    for layout in a.layouts.split(","):
        for p in (int(x) for x in a.predict_ranks.split(",")):
            if p < 2 or a.experts % p:
                continue  # the experts must split evenly over the ranks
            x = predict(layout, p, a.hidden, a.experts, a.top_k)
            print(
                f"| {layout} | {p} | {kib(x['none'])} | {kib(x['torch'])} | "
                f"{kib(x['torch_worst'])} | {x['none'] / x['torch']:.1f} |"
            )
    diffs = max(r["max_abs_diff"] for r in rows)
    print(f"\nlargest difference between the backends' outputs: {diffs:.3e}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
