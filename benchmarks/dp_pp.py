"""Data-parallel attention and pipeline-parallel prefill on the same cores.

  python benchmarks/dp_pp.py [--model-path DIR] [--cores 0,1] [--json OUT]

1. Decode: colocated servers at concurrency 32 (``--decode-prompts`` prompts of ``--decode-in``
   tokens, ``--decode-out`` output tokens, ignore_eos): ``--tp-size 1`` with one thread per core
   against ``--tp-size 2 --dp-size 2 --enable-dp-attention`` with one thread per rank, and
   ``--tp-size 2`` when the model's heads split in two (the demo model's 9 query / 3 KV heads do
   not: that row is then left out, saying so). Output tok/s, ITL median / p99.
2. Prefill: ``--pp-size 2`` (one thread per stage) against ``--tp-size 1`` (one thread per core)
   on ``--prefill-len``-token prompts with one output token, radix cache off: TTFT at
   concurrency 1 and 4.

Servers are pinned to ``--cores`` with ``taskset``; the demo model is the default.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pdserve.bench import serving  # noqa: E402
from tests.helpers import cluster as c  # noqa: E402


def pinned(name: str, model: str, logs: Path, cores: str, ranks: int, *args: str) -> c.Proc:
    threads = max(1, len(cores.split(",")) // ranks)
    port = c.free_port()
    cmd = [
        "taskset",
        "-c",
        cores,
        sys.executable,
        "-m",
        "pdserve.cli",
        "serve",
        "--model-path",
        model,
        "--port",
        str(port),
        "--torch-num-threads",
        str(threads),
        "--served-model-name",
        "demo",
        "--max-total-tokens",
        "65536",
        "--chunked-prefill-size",
        "4096",
        *args,
    ]
    return c.Proc(name, cmd, port, logs, env={"OMP_NUM_THREADS": str(threads)})


def bench(url: str, model: str, out: Path, n: int, conc: int, inp: int, outp: int) -> dict:
    argv = [
        "--backend",
        "openai",
        "--base-url",
        url,
        "--model",
        "demo",
        "--tokenizer",
        model,
        "--num-prompts",
        str(n),
        "--max-concurrency",
        str(conc),
        "--random-input-len",
        str(inp),
        "--random-output-len",
        str(outp),
        "--random-range-ratio",
        "1",
        "--ignore-eos",
        "--warmup-requests",
        "1",
        "--disable-tqdm",
        "--output-file",
        str(out),
    ]
    if serving.main(argv) != 0:
        raise RuntimeError(f"benchmark against {url} failed")
    return json.loads(out.read_text())["summary"]


def heads_split_in_two(model: str) -> bool:
    cfg = json.loads((Path(model) / "config.json").read_text())
    kv = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return cfg["num_attention_heads"] % 2 == 0 and (kv % 2 == 0 or 2 % kv == 0)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--cores", default="0,1")
    ap.add_argument("--decode-prompts", type=int, default=64)
    ap.add_argument("--decode-in", type=int, default=128)
    ap.add_argument("--decode-out", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--prefill-prompts", type=int, default=8)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.model_path is None:
        from pdserve.models.demo import ensure_demo_model

        a.model_path = ensure_demo_model()
    logs = Path(tempfile.mkdtemp(prefix="dp-pp-bench-"))
    print(f"server logs: {logs}", file=sys.stderr)
    result: dict = {"decode": {}, "prefill": {}, "notes": []}
    decode_setups = {
        "tp1": (1, []),
        "tp2 dp2 (DP attention)": (
            2,
            ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"],
        ),
    }
    if heads_split_in_two(a.model_path):
        decode_setups["tp2"] = (2, ["--tp-size", "2"])
    else:
        result["notes"].append("tp2 left out: the model's heads do not split in two")
    for name, (ranks, flags) in decode_setups.items():
        p = pinned(name.split()[0], a.model_path, logs, a.cores, ranks, *flags).start()
        try:
            print(f"== decode {name} ({time.strftime('%H:%M:%S')})", file=sys.stderr)
            result["decode"][name] = bench(
                p.url,
                a.model_path,
                logs / f"decode-{ranks}-{len(flags)}.json",
                a.decode_prompts,
                32,
                a.decode_in,
                a.decode_out,
            )
        finally:
            p.stop()
    for name, (ranks, flags) in {"tp1": (1, []), "pp2": (2, ["--pp-size", "2"])}.items():
        # no prefix cache: the second concurrency would reuse the first one's prompts
        p = pinned(
            name, a.model_path, logs, a.cores, ranks, *flags, "--disable-radix-cache"
        ).start()
        try:
            for conc in (1, 4):
                print(
                    f"== prefill {name} concurrency {conc} ({time.strftime('%H:%M:%S')})",
                    file=sys.stderr,
                )
                result["prefill"][f"{name}@{conc}"] = bench(
                    p.url,
                    a.model_path,
                    logs / f"prefill-{name}-{conc}.json",
                    a.prefill_prompts,
                    conc,
                    a.prefill_len,
                    1,
                )
        finally:
            p.stop()
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")),
        "?",
    )
    print(
        f"machine: {platform.machine()}, {cpu}, {os.cpu_count()} cores; servers on cores "
        f"{a.cores}; model {os.path.basename(a.model_path.rstrip('/'))}"
    )
    print(
        f"\ndecode: {a.decode_prompts} prompts x {a.decode_in} in / {a.decode_out} out, "
        "concurrency 32"
    )
    print("| set-up | out tok/s | ITL median / p99 ms | TPOT mean ms |")
    print("|---|---|---|---|")
    for name, s in result["decode"].items():
        print(
            f"| {name} | {s['output_throughput']:.1f} | {s['itl_ms']['median']:.1f} / "
            f"{s['itl_ms']['p99']:.1f} | {s['tpot_ms']['mean']:.1f} |"
        )
    for note in result["notes"]:
        print(f"({note})")
    print(f"\nprefill: {a.prefill_prompts} prompts x {a.prefill_len} tokens, 1 output token")
    print("| set-up | concurrency | TTFT mean / median ms | input tok/s |")
    print("|---|---|---|---|")
    for key, s in result["prefill"].items():
        name, conc = key.split("@")
        tok_s = s.get("input_throughput") or 0.0
        print(
            f"| {name} | {conc} | {s['ttft_ms']['mean']:.0f} / {s['ttft_ms']['median']:.0f} | "
            f"{tok_s:.0f} |"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
