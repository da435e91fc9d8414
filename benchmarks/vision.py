"""Images through colocated serving, PD and EPD on the same cores.

A Qwen2.5-VL-shaped model with the 7B checkpoint's vision tower at its real size (32 blocks of
1280, windows of 112 pixels, 4 whole-image blocks, merger to 3584) and ``--layers`` decoder layers
of the 7B's shape (random weights, bf16), the 7B's image processor (14-pixel patches, squares of
2 x 2 merged). For 1..4 images per request (``--size`` pixels square, new pixels every request,
so no prefix or embedding cache hit), three setups on the same cores, one after the other:
- colocated: one server computes the tower and the prompt;
- PD: prefill (tower and prompt), decode (``--language-only``), pdserve's router;
- EPD: an encoder server (the tower), prefill and decode both ``--language-only``, the router
  with ``--encoder``.
Each request is a streamed chat completion of ``--new-tokens`` tokens. Reported: the median time
to the first token over ``--reps`` requests one at a time, the throughput of ``--concurrency``
requests at once (images per second), and for EPD the encoder's tower seconds, write seconds
and bytes per image (its ``/server_info``).

    python benchmarks/vision.py --layers 2 --size 224 --reps 3 --concurrency 4
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from tests.helpers import cluster as c  # noqa: E402
from tests.helpers.ports import free_port  # noqa: E402
from tests.helpers.vision_checkpoints import data_url, png, write_qwen2_5_vl  # noqa: E402

PROCESSOR = dict(
    patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=3136, max_pixels=1003520
)
VISION_7B = dict(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    out_hidden_size=3584,
    window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
)


def text_7b(layers: int) -> dict:
    return dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=layers,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": [16, 24, 24],
        },
    )


def checkpoint(cache: Path, layers: int) -> Path:
    import torch

    out = cache / f"qwen2_5_vl-7b-tower-{layers}l"
    if (out / "config.json").exists():
        return out
    tmp = Path(tempfile.mkdtemp(prefix=".vl-", dir=cache))
    write_qwen2_5_vl(str(tmp), text_7b(layers), VISION_7B, PROCESSOR, torch.bfloat16, False)
    tmp.rename(out)
    return out


def body(images: int, seed: int, new_tokens: int) -> dict:
    parts = [{"type": "text", "text": "Describe what differs between these pictures."}]
    for k in range(images):
        url = data_url(png(ARGS.size, ARGS.size, seed * 16 + k))
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return {
        "model": "vl",
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": new_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }


def ttft(url: str, payload: dict) -> tuple[float, float]:
    """(seconds to the first content, seconds to the end) of one streamed chat."""
    t0, first = time.perf_counter(), None
    with httpx.stream("POST", url + "/v1/chat/completions", json=payload, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {") and '"content"' in line:
                first = time.perf_counter() - t0
    return first if first is not None else float("nan"), time.perf_counter() - t0


def run_setup(name: str, url: str, encoder: c.Proc | None, seed0: int) -> list[dict]:
    rows = []
    for k in range(1, 5):
        before = encoder.http.get("/server_info").json() if encoder else None
        firsts = [
            ttft(url, body(k, seed0 + 100 * k + r, ARGS.new_tokens))[0] for r in range(ARGS.reps)
        ]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(ARGS.concurrency) as ex:
            list(
                ex.map(
                    lambda r: ttft(url, body(k, seed0 + 1000 * k + r, ARGS.new_tokens)),
                    range(ARGS.concurrency),
                )
            )
        wall = time.perf_counter() - t0
        row = {
            "setup": name,
            "images": k,
            "ttft_s": statistics.median(firsts),
            "images_per_s": k * ARGS.concurrency / wall,
        }
        if encoder:
            after = encoder.http.get("/server_info").json()
            n = after["images_encoded"] - before["images_encoded"]
            row["tower_s_per_image"] = (after["tower_seconds"] - before["tower_seconds"]) / n
            row["write_s_per_image"] = (after["write_seconds"] - before["write_seconds"]) / n
            row["bytes_per_image"] = (after["bytes_written"] - before["bytes_written"]) / n
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


COMMON = ["--dtype", "bfloat16", "--served-model-name", "vl", "--torch-num-threads", "2"]


def main() -> None:
    cache = Path(ARGS.cache)
    cache.mkdir(parents=True, exist_ok=True)
    path = str(checkpoint(cache, ARGS.layers))
    logs = Path(tempfile.mkdtemp(prefix="vision-bench-"))
    rows = []
    s = c.server("S", path, logs, *COMMON)
    for procs in c.running({"S": s}):
        rows += run_setup("colocated", procs["S"].url, None, 1)
    p = c.prefill("P", path, logs, *COMMON)[0]
    d = c.decode("D", path, logs, *COMMON, "--language-only")
    for procs in c.running({"P": p, "D": d}):
        r = c.router("R", [p], [d], logs)
        for _ in c.running({"R": r}):
            rows += run_setup("PD", r.url, None, 2)
    port = free_port()
    e = c.server(
        "E", path, logs, *COMMON, "--encoder-only", "--disaggregation-bootstrap-port", str(port)
    )
    p = c.prefill("P", path, logs, *COMMON, "--language-only")[0]
    d = c.decode("D", path, logs, *COMMON, "--language-only")
    for procs in c.running({"E": e, "P": p, "D": d}):
        r = c.router("R", [p], [d], logs, "--encoder", f"tcp://127.0.0.1:{port}")
        for _ in c.running({"R": r}):
            rows += run_setup("EPD", r.url, procs["E"], 3)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if "Model name" in ln), "")
    print(
        f"\n{platform.machine()} {model}; layers {ARGS.layers}, {ARGS.size}px images, "
        f"{ARGS.new_tokens} new tokens, reps {ARGS.reps}, concurrency {ARGS.concurrency}"
    )
    print("| setup | images | TTFT s (median) | images/s | tower s/image | write/image | bytes |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        extra = (
            f"{row['tower_s_per_image']:.2f} | {row['write_s_per_image'] * 1e3:.1f} ms | "
            f"{row['bytes_per_image'] / 2**20:.2f} MiB"
            if "tower_s_per_image" in row
            else "- | - | -"
        )
        print(
            f"| {row['setup']} | {row['images']} | {row['ttft_s']:.2f} | "
            f"{row['images_per_s']:.2f} | {extra} |"
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--cache", default="/tmp/pdserve-bench-cache")
    ARGS = ap.parse_args()
    main()
