"""DeepSeek-V4's compressed attention against DeepSeek-V3's latent attention: decode tok/s on
real widths, and the PD transfer per request on tiny widths at long contexts.

  python benchmarks/deepseek_v4.py [--parts decode,pd] [--contexts 2048,8192]
      [--pd-contexts 8192,32768] [--threads 1] [--json out.json]

- ``decode``: the offline engine (bf16, one thread, page size 64, the torch attention backend's
  per-request path for V4, the CPU backend's latent kernels for V3) at batch 1: a prompt of each
  ``--contexts`` length is prefilled once (chunks of 1024) into the prefix cache; then the same
  prompt with 1 and with 17 output tokens (both prefill only the last page again): decode tok/s =
  16 / the difference. The models, random bf16 weights, one CSA and one HCA layer for V4 and two
  MLA layers for V3, both at V4-Flash's width: hidden 4096, 64 query heads, q_lora 1024, 8 experts
  of 2048 of which 6 per token (V4-Flash reads 6 of 256: the same bytes per token) and a shared
  one, a 49152-token vocabulary (the tests' tokenizer's). V4: head_dim 512 (64 rotated), window
  128, compress rates 4 and 128, indexer 64 heads of 128 keeping 512, o_groups 8 of o_lora 1024,
  4 residual streams. V3: kv_lora 512, qk_nope 128, qk_rope 64, v 128.
- ``pd``: one prefill and one decode (local backend) of each tiny-width model (the tests'
  ``deepseek_v4`` and ``deepseek_v3`` recipes at 8 layers, V4 with its real window and rates):
  per prompt length, the bytes the prefill moved and its transfer window (``recent_transfers``).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CACHE = Path.home() / ".cache" / "pdserve" / "models"
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
WIDTH = dict(
    vocab_size=49152,
    hidden_size=4096,
    num_attention_heads=64,
    q_lora_rank=1024,
    moe_intermediate_size=2048,
    n_routed_experts=8,
    num_experts_per_tok=6,
    n_shared_experts=1,
    max_position_embeddings=65536,
    num_hidden_layers=2,
    bos_token_id=1,
    eos_token_id=2,
)


def v4_config():
    from transformers import DeepseekV4Config

    c = DeepseekV4Config(
        **WIDTH,
        num_key_value_heads=1,
        head_dim=512,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=512,
        o_groups=8,
        o_lora_rank=1024,
        sliding_window=128,
        layer_types=[CSA, HCA],
        mlp_layer_types=["moe", "moe"],
        num_nextn_predict_layers=0,
    )
    c.architectures = ["DeepseekV4ForCausalLM"]
    return c


def v3_config():
    from transformers import DeepseekV3Config

    c = DeepseekV3Config(
        **WIDTH,
        num_key_value_heads=64,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        first_k_dense_replace=0,
        n_group=1,
        topk_group=1,
        intermediate_size=2048,
    )
    c.architectures = ["DeepseekV3ForCausalLM"]
    return c


def ensure(name: str, make) -> Path:
    """A random bf16 checkpoint of ``make()``'s config in the model cache (built once)."""
    import torch
    import transformers

    from tests.helpers.checkpoints import smollm2_tokenizer_dir

    out = CACHE / name
    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make(), dtype=torch.bfloat16)
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=CACHE))
    model.save_pretrained(tmp)
    for f in Path(smollm2_tokenizer_dir()).iterdir():
        if not f.name.startswith("."):
            shutil.copy(f, tmp / f.name)
    tmp.rename(out)
    return out


def decode(contexts: list[int], threads: int) -> list[dict]:
    import pdserve

    rows = []
    for name, make in (("deepseek-v4", v4_config), ("deepseek-v3", v3_config)):
        path = ensure(f"{name}-shape-2l-8e", make)
        eng = pdserve.Engine(
            model_path=str(path),
            dtype="bfloat16",
            torch_num_threads=threads,
            max_total_tokens=max(contexts) + 512,
            page_size=64,
            chunked_prefill_size=1024,
        )
        try:
            rng = random.Random(0)
            for n in contexts:
                ids = [rng.randrange(100, 30000) for _ in range(n)]

                def run(k: int) -> float:
                    t0 = time.perf_counter()
                    sp = {"temperature": 0, "max_new_tokens": k, "ignore_eos": True}
                    eng.generate(input_ids=ids, sampling_params=sp)
                    return time.perf_counter() - t0

                cold = run(1)  # the prompt into the prefix cache
                t1, t17 = min(run(1) for _ in range(2)), min(run(17) for _ in range(2))
                rows.append(
                    {
                        "model": name,
                        "context": n,
                        "decode_tok_s": 16 / max(t17 - t1, 1e-9),
                        "prefill_s": cold,
                        "backend": eng.scheduler.runner.attn_backend_name,
                    }
                )
                print(f"decode {rows[-1]}", file=sys.stderr, flush=True)
        finally:
            eng.shutdown()
    return rows


def pd(contexts: list[int], threads: int) -> list[dict]:
    from tests.helpers import cluster as c
    from tests.helpers.checkpoints import build_tiny_checkpoint

    models = {
        "deepseek-v4": build_tiny_checkpoint(
            "deepseek_v4",
            num_hidden_layers=8,
            layer_types=[CSA, HCA] * 4,
            mlp_layer_types=["moe"] * 8,
            compress_rates={CSA: 4, HCA: 128},
            sliding_window=128,
            index_topk=64,
            max_position_embeddings=65536,
        ),
        "deepseek-v3": build_tiny_checkpoint(
            "deepseek_v3", num_hidden_layers=8, max_position_embeddings=65536
        ),
    }
    common = ["--dtype", "bfloat16", "--torch-num-threads", str(threads)]
    common += ["--max-total-tokens", str(max(contexts) + 1024), "--chunked-prefill-size", "4096"]
    common += ["--page-size", "64"]
    rows = []
    for name, path in models.items():
        logs = Path(tempfile.mkdtemp(prefix=f"{name}-pd-"))
        P, _ = c.prefill("P", path, logs, *common)
        D = c.decode("D", path, logs, *common)
        try:
            c.start_all([P, D])
            rng = random.Random(1)
            for n in contexts:
                ids = [rng.randrange(100, 40000) for _ in range(n)]
                body = c.greedy_body(ids, 2, P, rng.randrange(2**63))
                t0 = time.perf_counter()
                rp, rd = post_pd(P, D, body)
                assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
                wall = time.perf_counter() - t0
                state = P.http.get("/server_info").json()["internal_states"][0]
                tr = state["recent_transfers"][-1]
                rows.append(
                    {
                        "model": name,
                        "context": n,
                        "kv_bytes": tr["kv_bytes"],
                        "bytes_per_token": tr["kv_bytes"] / n,
                        "transfer_window_ms": tr["window_s"] * 1e3,
                        "after_last_chunk_ms": tr["after_last_chunk_s"] * 1e3,
                        "request_s": wall,
                    }
                )
                print(f"pd {rows[-1]}", file=sys.stderr, flush=True)
        finally:
            for p in (P, D):
                p.stop()
    return rows


def post_pd(prefill, decode, body: dict):
    """``body`` to prefill and decode at once (a long prompt's prefill may take minutes here)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    with ThreadPoolExecutor(2) as ex:
        fp = ex.submit(httpx.post, prefill.url + "/generate", json=body, timeout=1800)
        fd = ex.submit(httpx.post, decode.url + "/generate", json=body, timeout=1800)
        return fp.result(), fd.result()


def lscpu() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if "Model name" in ln), "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="decode,pd")
    ap.add_argument("--contexts", default="2048,8192")
    ap.add_argument("--pd-contexts", default="8192,32768")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    parts = args.parts.split(",")
    out: dict = {"host": lscpu()}
    if "decode" in parts:
        out["decode"] = decode([int(x) for x in args.contexts.split(",")], args.threads)
    if "pd" in parts:
        out["pd"] = pd([int(x) for x in args.pd_contexts.split(",")], args.threads)
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
