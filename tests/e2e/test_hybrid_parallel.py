"""Linear-attention hybrids across pipeline stages and with DP attention: Bamba with attention at
layers 1 and 3 in two stages (each stage's state layers in its own state pool, the pages of its
attention layer its anchor), Qwen3-Next on two DP-attention groups (a group without tokens joins
the MLPs' collectives through each layer's MLPs, ``dp_mlps``): HF's greedy tokens, requests one
by one (one group idle) and several at once. A stage of only linear-attention layers is refused
at start-up, naming the stage."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.test_engine_moe import hf_reference
from tests.helpers import cluster as c
from tests.helpers import localhttp
from tests.helpers.checkpoints import build_tiny_checkpoint

NEW_TOKENS = 8
COMMON = [
    "--dtype",
    "float32",
    "--max-total-tokens",
    "4096",
    "--page-size",
    "4",
    "--chunked-prefill-size",
    "24",
]
BAMBA_TWO_ATTENTION = dict(attn_layer_indices=[1, 3])


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("hybrid-parallel")
    bamba = build_tiny_checkpoint("bamba", **BAMBA_TWO_ATTENTION)
    qwen = build_tiny_checkpoint("qwen3_next")
    s = {
        "pp": (c.server("pp", bamba, logs, *COMMON, "--pp-size", "2"), bamba),
        "dp": (
            c.server(
                "dp",
                qwen,
                logs,
                *COMMON,
                "--tp-size",
                "2",
                "--dp-size",
                "2",
                "--enable-dp-attention",
            ),
            qwen,
        ),
    }
    try:
        c.start_all([p for p, _ in s.values()])
        yield s
    finally:
        for p, _ in s.values():
            p.stop()


def generate(proc: c.Proc, ids: list[int]) -> list[int]:
    r = localhttp.post(proc.url + "/generate", json=c.greedy_body(ids, NEW_TOKENS), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


@pytest.mark.parametrize("name", ["pp", "dp"])
def test_hybrid_gives_hf_tokens(servers, name):
    proc, path = servers[name]
    rng = random.Random(13)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (5, 30, 70, 9)]
    for ids in prompts[:2]:  # one at a time: under DP attention one group has no tokens
        assert generate(proc, ids) == hf_reference(path, ids, NEW_TOKENS)[0], len(ids)
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda ids: generate(proc, ids), prompts))
    for ids, out in zip(prompts, outs):
        assert out == hf_reference(path, ids, NEW_TOKENS)[0], len(ids)


def test_a_stage_without_attention_is_refused(tmp_path):
    """Bamba's tiny plan (attention at layer 1 only) in two stages: layers 2 and 3 keep only
    states, and pages need an attention layer to count them."""
    proc = c.server("pp-bad", build_tiny_checkpoint("bamba"), tmp_path, *COMMON, "--pp-size", "2")
    with pytest.raises(RuntimeError, match="exited"):
        proc.start()
    proc.stop()
    logs = "".join(f.read_text() for f in tmp_path.glob("*"))
    assert "pp_size: pipeline stage 1 (layers 2..3) keeps no per-token cache" in logs
