"""Tensor parallelism: TP 2 against TP 1 on the same cores, and the KV transfer of one long request
between servers of different TP sizes.

  python benchmarks/tp.py [--model-path DIR] [--cores 0,1] [--num-prompts 32] [--input-len 256]
      [--output-len 64] [--transfer-len 2048] [--transfer-reps 3]

The demo model cannot be split in two (9 query heads, 3 KV heads: ``pdserve serve --tp-size 2``
refuses it, naming the counts), so the default model is one built from a config: Llama-shaped,
1.2B parameters (16 layers, hidden 2048, 32 heads, 8 KV heads, intermediate 8192, the demo
model's tokenizer and vocabulary), random weights (``--load-format dummy``).

1. Colocated serving on ``--cores``: one server with ``--tp-size 1`` and ``len(cores)`` torch
   threads against one with ``--tp-size 2`` and one thread per rank (the same cores either way),
   ``pdserve bench`` (streamed /v1/completions) at concurrency 1 and at concurrency 32: output
   tok/s, TPOT and inter-token latency.
2. KV transfer of a ``--transfer-len``-token request, P tp1 -> D tp2 against P tp2 -> D tp2 (local
   backend): prefill's per-transfer record (``/server_info``: KV bytes and write descriptors of
   prefill rank 0, the window from the first chunk handed to the transfer workers to Success).
   With tp1 -> tp2 prefill rank 0 writes each decode rank its slice of every page's heads (one
   descriptor per page, layer and K|V); with tp2 -> tp2 each rank writes whole pages to its peer
   (one descriptor per page run).
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
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pdserve.bench import serving  # noqa: E402
from tests.helpers import cluster as c  # noqa: E402

SIZED = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)


def sized_model() -> str:
    """A config-only Llama directory (weights drawn at load: ``--load-format dummy``)."""
    import shutil

    import transformers

    from pdserve.envs import cache_dir
    from tests.helpers.checkpoints import SMOLLM2_VOCAB, smollm2_tokenizer_dir

    out = Path(cache_dir()) / "models" / "llama-1.2b-shaped"
    if not (out / "config.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        cfg = transformers.LlamaConfig(
            vocab_size=SMOLLM2_VOCAB, bos_token_id=1, eos_token_id=2, **SIZED
        )
        cfg.architectures = ["LlamaForCausalLM"]
        cfg.torch_dtype = "bfloat16"
        cfg.save_pretrained(out)
        for name in os.listdir(smollm2_tokenizer_dir()):
            if not name.startswith("."):
                shutil.copy(os.path.join(smollm2_tokenizer_dir(), name), out)
    return str(out)


def pinned(name: str, model: str, logs: Path, cores: str, tp: int, *args: str) -> c.Proc:
    threads = max(1, len(cores.split(",")) // tp)
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
        "--tp-size",
        str(tp),
        "--torch-num-threads",
        str(threads),
        "--served-model-name",
        "demo",
        "--max-total-tokens",
        "32768",
        "--load-format",
        "dummy",
        *args,
    ]
    return c.Proc(name, cmd, port, logs, env={"OMP_NUM_THREADS": str(threads)})


def serve_bench(url: str, model: str, out: Path, n: int, conc: int, a) -> dict:
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
        str(a.input_len),
        "--random-output-len",
        str(a.output_len),
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


def transfer(router: c.Proc, prefill: c.Proc, length: int, reps: int) -> dict:
    rng = random.Random(length)
    records = []
    for _ in range(reps):
        ids = [rng.randrange(100, 40000) for _ in range(length)]
        body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 2}}
        r = httpx.post(router.url + "/generate", json=body, timeout=300)
        r.raise_for_status()
        recent = prefill.http.get("/server_info").json()["internal_states"][0]["recent_transfers"]
        records.append(recent[-1])
    return {
        k: statistics.median(rec[k] for rec in records)
        for k in ("kv_bytes", "descriptors", "window_s", "pages")
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--cores", default="0,1")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--transfer-len", type=int, default=2048)
    ap.add_argument("--transfer-reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.model_path is None:
        a.model_path = sized_model()
    logs = Path(tempfile.mkdtemp(prefix="tp-bench-"))
    print(f"server logs: {logs}", file=sys.stderr)
    result: dict = {"serving": {}, "transfer": {}}
    for tp in (1, 2):
        p = pinned(f"tp{tp}", a.model_path, logs, a.cores, tp).start()
        try:
            for conc, n in ((1, 4), (32, a.num_prompts)):
                print(
                    f"== tp{tp} concurrency {conc} ({time.strftime('%H:%M:%S')})", file=sys.stderr
                )
                result["serving"][f"tp{tp}@{conc}"] = serve_bench(
                    p.url, a.model_path, logs / f"tp{tp}-{conc}.json", n, conc, a
                )
        finally:
            p.stop()
    for p_tp in (1, 2):
        P = pinned(
            f"P{p_tp}",
            a.model_path,
            logs,
            a.cores,
            p_tp,
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(c.free_port()),
            "--chunked-prefill-size",
            "4096",
        )
        P.bootstrap_port = int(P.cmd[P.cmd.index("--disaggregation-bootstrap-port") + 1])
        D = pinned("D2", a.model_path, logs, a.cores, 2, "--disaggregation-mode", "decode")
        R = None
        try:
            c.start_all((P, D))
            R = c.router("R", [P], [D], logs).start()
            print(f"== transfer tp{p_tp} -> tp2 ({time.strftime('%H:%M:%S')})", file=sys.stderr)
            result["transfer"][f"tp{p_tp}->tp2"] = transfer(R, P, a.transfer_len, a.transfer_reps)
        finally:
            for s in [x for x in (R, D, P) if x is not None]:
                s.stop()
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")),
        "?",
    )
    print(
        f"machine: {platform.machine()}, {cpu}, {os.cpu_count()} cores; servers on cores {a.cores}"
    )
    print(f"serving: {a.input_len} in / {a.output_len} out, ignore_eos")
    print(
        "| set-up | concurrency | out tok/s | TPOT mean / p90 ms | ITL median / p90 ms | TTFT mean "
        "ms |"
    )
    print("|---|---|---|---|---|---|")
    for key, s in result["serving"].items():
        tp, conc = key.split("@")
        print(
            f"| {tp} | {conc} | {s['output_throughput']:.1f} | {s['tpot_ms']['mean']:.1f} / "
            f"{s['tpot_ms']['p90']:.1f} | {s['itl_ms']['median']:.1f} / {s['itl_ms']['p90']:.1f} | "
            f"{s['ttft_ms']['mean']:.0f} |"
        )
    print(
        f"\nKV transfer of a {a.transfer_len}-token request into a tp2 decode (prefill rank 0's "
        f"record, median of {a.transfer_reps}):"
    )
    print("| pairing | pages | KV MB written by rank 0 | descriptors | window ms | GB/s |")
    print("|---|---|---|---|---|---|")
    for key, t in result["transfer"].items():
        print(
            f"| {key} | {t['pages']:.0f} | {t['kv_bytes'] / 1e6:.2f} | {t['descriptors']:.0f} | "
            f"{t['window_s'] * 1e3:.1f} | {t['kv_bytes'] / t['window_s'] / 1e9:.2f} |"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
