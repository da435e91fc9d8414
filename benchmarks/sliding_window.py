"""Sliding-window cache groups against the full-KV layout (windows by masking) on a Gemma-3-shaped
model of realistic size, side by side in one run.

  python benchmarks/sliding_window.py [--lens 4096,8192,16384] [--ratio 0.8]
      [--layouts groups,masking] [--json OUT]

The model: Gemma 3 text as its 1B config has it (hidden 1152, 26 layers of which every 6th is
global, 4 query heads, 1 KV head of 256, window 512, GeGLU 6912), with the SmolLM2 vocabulary
(49,152 rows instead of 262,144, to keep the host's memory for the KV) and random bf16 weights
(``--load-format dummy``). For each layout ("groups": the sliding-window layers in their own pool
that keeps only the window; "masking": ``--disable-hybrid-swa-memory``, every layer keeps every
page), a 1P1D cluster (prefill on core 0, decode on core 1, one torch thread each, local
transfer backend) serves one request per prompt length, and the script records:

- TTFT through the router (streamed ``/generate``, 4 new tokens);
- the KV bytes the request moved (prefill's ``recent_transfers``);
- decode's KV memory for the request, read from decode's ``/debug/integrity`` (pages in use per
  cache group x that group's bytes per page) while the request is still decoding;
- how many requests of each length fit at once in decode's pools of the same byte budget: the
  decode server's own admission (``KVCacheManager.prealloc``) run over allocators of the pool
  sizes the server reports, until one does not fit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pdserve.engine.kv_cache import KVCacheManager  # noqa: E402
from pdserve.engine.kv_pool import PageAllocator  # noqa: E402
from pdserve.engine.request import Req, SamplingParams  # noqa: E402
from pdserve.kv_spec import FullAttention, SlidingWindow, group_layers  # noqa: E402
from tests.helpers import cluster as c  # noqa: E402
from tests.helpers.checkpoints import smollm2_tokenizer_dir  # noqa: E402

PAGE = 16
LAYERS, WINDOW, PATTERN, HEAD_DIM = 26, 512, 6, 256
KV_BYTES_PER_LAYER_TOKEN = 2 * 1 * HEAD_DIM * 2  # K and V, 1 KV head, bf16
MASKING_TOKENS = 65536  # the masking layout's pool: 26 layers x 64k tokens = 1.7 GB


def model_dir() -> str:
    import transformers

    out = os.path.join(tempfile.gettempdir(), "pdserve-bench-gemma3-1b-shape")
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    os.makedirs(out, exist_ok=True)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=49152,
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=HEAD_DIM,
        sliding_window=WINDOW,
        sliding_window_pattern=PATTERN,
        max_position_embeddings=32768,
        query_pre_attn_scalar=256,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
        dtype="bfloat16",
    )
    cfg.architectures = ["Gemma3ForCausalLM"]
    cfg.save_pretrained(out)
    for name in os.listdir(smollm2_tokenizer_dir()):
        if not name.startswith("."):
            subprocess.run(["cp", os.path.join(smollm2_tokenizer_dir(), name), out], check=True)
    return out


def groups_tokens(ratio: float) -> int:
    """Full-attention tokens that give the grouped layout the masking layout's bytes."""
    full = sum(1 for i in range(LAYERS) if (i + 1) % PATTERN == 0)
    return int(MASKING_TOKENS * LAYERS / (full + ratio * (LAYERS - full)))


def pinned(proc: c.Proc, core: str) -> c.Proc:
    proc.cmd = ["taskset", "-c", core, *proc.cmd]
    return proc


def ttft_and_decode_memory(
    router: c.Proc, decode: c.Proc, ids: list[int]
) -> tuple[float, list[dict]]:
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
    }
    t0 = time.perf_counter()
    ttft, groups = None, []
    with (
        httpx.Client(timeout=3600) as h,
        h.stream("POST", router.url + "/generate", json=body) as r,
    ):
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and ttft is None:
                ttft = time.perf_counter() - t0
                info = decode.http.get("/debug/integrity").json()["integrity"]
                groups = info.get("groups") or [
                    {"kind": "one group", "in_use_pages": info["in_use_pages"]}
                ]
    return ttft, groups


def admitted(info: dict, prompt_len: int) -> int:
    """Requests of ``prompt_len`` tokens decode preallocates at once in pools of its sizes."""
    specs = []
    for g in info["cache_groups"]:
        spec = (
            SlidingWindow(1, HEAD_DIM, g["window"])
            if g["kind"] == "sliding_window"
            else FullAttention(1, HEAD_DIM)
        )
        specs += [(layer, spec) for layer in g["layers"]]
    groups = group_layers([s for _, s in sorted(specs, key=lambda t: t[0])])
    pools = [SimpleNamespace(allocator=PageAllocator(g["num_pages"])) for g in info["cache_groups"]]
    kv = KVCacheManager(groups, pools, PAGE, disable_radix_cache=True)
    n = 0
    while kv.prealloc(Req(str(n), [7] * prompt_len, SamplingParams()), reserve=0) is not None:
        n += 1
    return n


def run_layout(name: str, extra: list[str], lens: list[int], logs: Path) -> list[dict]:
    model = model_dir()
    common = [
        "--dtype",
        "bfloat16",
        "--load-format",
        "dummy",
        "--page-size",
        str(PAGE),
        "--chunked-prefill-size",
        "4096",
        "--context-length",
        "32768",
        "--disaggregation-bootstrap-timeout",
        "3600",
        "--disaggregation-waiting-timeout",
        "3600",
        *extra,
    ]
    P, _ = c.prefill(f"P-{name}", model, logs, *common)
    D = c.decode(f"D-{name}", model, logs, *common)
    pinned(P, "0"), pinned(D, "1")
    servers, R, rows = [P, D], None, []
    try:
        c.start_all(servers)
        R = c.router(f"R-{name}", [P], [D], logs).start()
        info = D.http.get("/server_info").json()["scheduler_info"]
        per_page = {
            g["id"]: len(g["layers"]) * KV_BYTES_PER_LAYER_TOKEN * PAGE
            for g in info["cache_groups"]
        }
        rng = random.Random(0)
        for n in lens:
            ids = [rng.randrange(100, 40000) for _ in range(n)]
            ttft, groups = ttft_and_decode_memory(R, D, ids)
            last = P.http.get("/server_info").json()["internal_states"][0]["recent_transfers"][-1]
            mem = sum(g["in_use_pages"] * per_page[i] for i, g in enumerate(groups))
            rows.append(
                {
                    "layout": name,
                    "prompt": n,
                    "ttft_s": ttft,
                    "kv_bytes": last["kv_bytes"],
                    "pages_per_group": last.get("pages_per_group"),
                    "decode_kv_bytes": mem,
                    "admitted": admitted(info, n),
                    "pool_pages": [g["num_pages"] for g in info["cache_groups"]],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
            D.wait_idle(600)
    finally:
        for s in [x for x in (R, *servers) if x is not None]:
            s.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--lens", default="4096,8192,16384")
    ap.add_argument(
        "--ratio", type=float, default=0.8, help="--swa-full-tokens-ratio of the grouped layout"
    )
    ap.add_argument("--layouts", default="groups,masking")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lens = [int(x) for x in args.lens.split(",")]
    logs = Path(tempfile.mkdtemp(prefix="pdserve-bench-swa-"))
    rows = []
    if "groups" in args.layouts:
        rows += run_layout(
            "groups",
            [
                "--max-total-tokens",
                str(groups_tokens(args.ratio)),
                "--swa-full-tokens-ratio",
                str(args.ratio),
            ],
            lens,
            logs,
        )
    if "masking" in args.layouts:
        rows += run_layout(
            "masking",
            ["--max-total-tokens", str(MASKING_TOKENS), "--disable-hybrid-swa-memory"],
            lens,
            logs,
        )
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next(
        (
            line.split(":", 1)[1].strip()
            for line in lscpu.splitlines()
            if line.startswith("Model name")
        ),
        "?",
    )
    print(
        f"\nmachine: {platform.machine()} {model_name}, {os.cpu_count()} cores; "
        f"ratio {args.ratio}; logs {logs}"
    )
    print("| prompt | layout | TTFT s | KV moved MB | decode KV MB | admitted at once |")
    print("|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["prompt"], r["layout"])):
        print(
            f"| {r['prompt']} | {r['layout']} | {r['ttft_s']:.1f} | {r['kv_bytes'] / 1e6:.1f} | "
            f"{r['decode_kv_bytes'] / 1e6:.1f} | {r['admitted']} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
