"""KV cache bytes per token of DeepSeek-V4's compressed attention against DeepSeek-V3's latent cache
and a plain GQA cache, from the cache specs and on the pools:

    python benchmarks/compressed_kv.py [--contexts 8192,65536,1048576] [--page-size 64]
        [--json OUT]

The caches, each a stack of ``kv_spec`` specs as the KV cache manager holds them (bf16):

- ``deepseek-v4``: ``DeepseekV4Config()``'s 43 layers. Every layer a 128-token window over one
  512-wide head that is key and value (``LatentWindow``); its 20 compressed-sparse layers an entry
  of 512 per 4 tokens and the indexer's key of 128 per 4 (``CompressedEntries``), its 23 heavily
  compressed layers an entry of 512 per 128; per request, each compressor's state
  (``CompressorState``: the open window's projected tokens and gates, and on the sparse layers the
  overlap slice, as HF's cache keeps them).
- ``deepseek-v3.2``: 61 layers of a 512 + 64 latent (``LatentAttention``) and the indexer's key of
  128 (``IndexKeys``) per token; ``deepseek-v3`` the latent alone.
- ``gqa-8x128``: a plain cache of 8 KV heads of 128 (``FullAttention``) on 43 layers (a model of
  V4's depth with the KV width of the Llama-3-8B / Qwen3-8B class).

Per context length n:

- ``spec``: the bytes from the specs' own arithmetic (a window: min(n, window - 1) tokens, the
  keys the next query reads besides its own; a compressed layer: n // rate entries; a latent or
  full cache: n tokens), with the per-request state;
- ``pool``: what the cache manager holds for one request of n tokens prefilled in 8192-token chunks
  (items of each group times its pool's item bytes, pages rounded as the pools round them), one
  layer of each group allocated and scaled to the model's layers;
- ``pd``: the bytes a prefill sends a decode for an n-token prompt (``transfer_counts`` and the
  items ``send_pages`` lists, times item bytes, and the state), which the transfer layer moves.

The pools are allocated and never touched: no more memory is used than the pages written (none).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from pdserve.engine.cache_kinds import make_pool  # noqa: E402
from pdserve.engine.kv_cache import KVCacheManager  # noqa: E402
from pdserve.engine.request import Req, SamplingParams  # noqa: E402
from pdserve.kv_spec import (  # noqa: E402
    CompressedEntries,
    CompressorState,
    FullAttention,
    IndexKeys,
    LatentAttention,
    LatentWindow,
    group_layers,
)

BF16 = 2
CHUNK = 8192


def deepseek_v4_layers() -> list:
    from transformers import DeepseekV4Config

    c = DeepseekV4Config()
    window = LatentWindow(c.head_dim, 0, c.sliding_window)
    out = []
    for kind in c.layer_types:
        rate = c.compress_rates[kind]
        if kind == "compressed_sparse_attention":
            d, i = c.head_dim, c.index_head_dim
            state = CompressorState(
                ("kv", "gate", "overlap_kv", "overlap_gate", "index_kv", "index_gate",
                 "index_overlap_kv", "index_overlap_gate"),
                ((rate, 2 * d), (rate, 2 * d), (rate, d), (rate, d),
                 (rate, 2 * i), (rate, 2 * i), (rate, i), (rate, i)),
                ("bfloat16",) * 8,
            )  # fmt: skip
            out.append(
                (
                    window,
                    CompressedEntries(c.head_dim, rate),
                    CompressedEntries(c.index_head_dim, rate, part="index_k"),
                    state,
                )
            )
        else:
            state = CompressorState(
                ("kv", "gate"), ((rate, c.head_dim), (rate, c.head_dim)), ("bfloat16",) * 2
            )
            out.append((window, CompressedEntries(c.head_dim, rate), state))
    return out


MODELS = {
    "deepseek-v4": deepseek_v4_layers,
    "deepseek-v3.2": lambda: [(LatentAttention(512, 64), IndexKeys(128))] * 61,
    "deepseek-v3": lambda: [LatentAttention(512, 64)] * 61,
    "gqa-8x128": lambda: [FullAttention(8, 128)] * 43,
}


def spec_bytes(layers: list, n: int) -> int:
    """The cache of one request of ``n`` tokens, from the specs' arithmetic."""
    total = 0
    for entry in layers:
        for spec in entry if isinstance(entry, tuple) else (entry,):
            if spec.per_request:
                total += spec.page_bytes(1, BF16)
            elif spec.kind == "compressed":
                total += (n // spec.rate) * spec.dim * BF16
            elif spec.drops_pages:
                total += min(n, spec.window - 1) * spec.page_bytes(
                    1, BF16
                )  # the next query adds its own
            else:
                total += n * spec.page_bytes(1, BF16)
    return total


def pool_bytes(layers: list, n: int, page_size: int) -> tuple[int, int]:
    """(held by one request of ``n`` tokens, sent for an ``n``-token prompt): each group's items
    times its pool's item bytes, scaled from one allocated layer to the group's layers."""
    groups = group_layers(layers)
    pools = []
    for g in groups:
        pages = 3 if g.spec.per_request else g.spec.peak_pages(n, CHUNK, page_size) + 2
        one = type(g)(g.id, g.spec, g.layers[:1])
        pools.append(
            make_pool(
                one,
                pages,
                page_size,
                torch.bfloat16,
                "cpu",
                lambda nbytes, device: torch.empty(nbytes, dtype=torch.uint8),
            )
        )
    m = KVCacheManager(groups, pools, page_size, disable_radix_cache=True)
    # bytes of one page (or state slot) of one layer: the allocation over its pages
    item = [p.nbytes // p.num_pages for p in pools]
    req = Req("r", [1] * n, SamplingParams(max_new_tokens=1))
    assert m.admit(req, CHUNK, 0, 0)
    while True:
        req.kv_len += min(CHUNK, n - req.kv_len)
        if req.kv_len == n:
            break
        assert m.grow(req, min(CHUNK, n - req.kv_len))
    m.slide(req)  # what the next query needs: the window's pages before it are let go
    held = sum(h * b * len(g.layers) for h, b, g in zip(m.held(req), item, groups))
    sent = sum(
        sum(1 for p in m.send_pages(req, g.id, m.transfer_start(g.id, n, 0)) if p)
        * b
        * len(g.layers)
        for g, b in zip(groups, item)
    )
    m.release(req)
    return held, sent


def lscpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if "Model name" in ln), "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="8192,65536,1048576")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    contexts = [int(x) for x in args.contexts.split(",")]
    rows = []
    for name, build in MODELS.items():
        layers = build()
        for n in contexts:
            held, sent = pool_bytes(layers, n, args.page_size)
            state = spec_bytes(layers, 0)  # the per-request part
            rows.append(
                {"model": name, "context": n, "spec": spec_bytes(layers, n), "pool": held,
                 "pd": sent, "state": state}
            )  # fmt: skip
    print(f"host: {lscpu()}; page size {args.page_size}; bf16")
    print(f"{'cache':<14} {'context':>8} {'spec MiB':>10} {'pool MiB':>10} {'pd MiB':>10} "
          f"{'state MiB':>10} {'B/token':>9} {'x V4':>7}")  # fmt: skip
    v4 = {r["context"]: r["pool"] for r in rows if r["model"] == "deepseek-v4"}
    for r in rows:
        print(
            f"{r['model']:<14} {r['context']:>8} {r['spec'] / 2**20:>10.1f} "
            f"{r['pool'] / 2**20:>10.1f} {r['pd'] / 2**20:>10.1f} {r['state'] / 2**20:>10.2f} "
            f"{r['pool'] / r['context']:>9.1f} {r['pool'] / v4[r['context']]:>7.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
