"""The families composed of the shared blocks (``models/decoder.py``) under tensor parallelism and
PD, against HF transformers' float32 greedy tokens:

- Command R7B's form (Cohere 2: parallel blocks, window layers with RoPE and global layers
  without, two cache groups) colocated on 2 ranks and through PD from 1 prefill rank to 2 decode
  ranks and from 2 to 1;
- OLMoE (every layer sparse, q/k norms over the projections) through PD 1 -> 2 and 2 -> 1;
- OLMo 2 on 2 ranks (its q/k norms over the whole projections, each rank holding its heads' part
  and summing the statistics with the other);
- Phi-3 on 2 ranks (q/k/v and gate/up stored fused in the checkpoint, split per rank by the
  loader; partial RoPE);
- StableLM 2 12B's form on 2 ranks (a LayerNorm per query and KV head, each rank its heads');
- StarCoder 2 on 2 ranks (the MLP without a gate split by its columns, its biases added once).

Every pool is free afterwards.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.test_engine import hf_greedy
from tests.e2e.test_tp import all_ranks_idle
from tests.helpers import cluster as c
from tests.helpers import localhttp
from tests.helpers.checkpoints import build_tiny_checkpoint

NEW_TOKENS = 8
PD_ARCHS = ("cohere2", "olmoe")  # a dense family with windows, an MoE family
COMMON = [
    "--max-total-tokens",
    "8192",
    "--page-size",
    "16",
    "--chunked-prefill-size",
    "64",
    "--disaggregation-bootstrap-timeout",
    "20",
    "--disaggregation-waiting-timeout",
    "20",
]


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(n)] for n in (3, 17, 40, 90, 150)]


def generate(url: str, ids: list[int]) -> list[int]:
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
    }
    r = localhttp.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    logs = tmp_path_factory.mktemp("families")
    models = {
        a: build_tiny_checkpoint(a)
        for a in ("cohere2", "olmo2", "phi3", "olmoe", "stablelm", "starcoder2")
    }
    tp2 = ["--tp-size", "2"]
    servers = {
        "cohere2": c.server("C2cohere2", models["cohere2"], logs, *COMMON, *tp2),
        "olmo2": c.server("C2olmo2", models["olmo2"], logs, *COMMON, *tp2),
        "phi3": c.server("C2phi3", models["phi3"], logs, *COMMON, *tp2),
        "stablelm": c.server("C2stablelm", models["stablelm"], logs, *COMMON, *tp2),
        "starcoder2": c.server("C2starcoder2", models["starcoder2"], logs, *COMMON, *tp2),
    }
    for arch in PD_ARCHS:
        servers[f"P1{arch}"] = c.prefill(f"P1{arch}", models[arch], logs, *COMMON)[0]
        servers[f"P2{arch}"] = c.prefill(f"P2{arch}", models[arch], logs, *COMMON, *tp2)[0]
        servers[f"D1{arch}"] = c.decode(f"D1{arch}", models[arch], logs, *COMMON)
        servers[f"D2{arch}"] = c.decode(f"D2{arch}", models[arch], logs, *COMMON, *tp2)
    routers = {}
    try:
        c.start_all(list(servers.values()))
        for arch in PD_ARCHS:
            for p, d in (("1", "2"), ("2", "1")):
                P, D = servers[f"P{p}{arch}"], servers[f"D{d}{arch}"]
                routers[f"{arch} {p}->{d}"] = c.router(f"R{p}{d}{arch}", [P], [D], logs).start()
        yield models, servers, routers
    finally:
        c.stop_all(list(routers.values()) + list(servers.values()))


@pytest.mark.parametrize("arch", ["cohere2", "olmo2", "phi3", "stablelm", "starcoder2"])
def test_tp2_matches_hf(families, arch):
    models, servers, _ = families
    server = servers[arch]
    ps = prompts(seed=len(arch))
    with ThreadPoolExecutor(3) as ex:
        outs = list(ex.map(lambda ids: generate(server.url, ids), ps))
    for ids, out in zip(ps, outs):
        assert out == hf_greedy(models[arch], ids, NEW_TOKENS), f"prompt of {len(ids)} tokens"
    all_ranks_idle(server)


@pytest.mark.parametrize("arch", PD_ARCHS)
@pytest.mark.parametrize("pairing", ["1->2", "2->1"])
def test_pd_across_tp_sizes_matches_hf(families, arch, pairing):
    models, servers, routers = families
    ps = prompts(seed=7 if pairing == "1->2" else 8)
    with ThreadPoolExecutor(3) as ex:
        outs = list(ex.map(lambda ids: generate(routers[f"{arch} {pairing}"].url, ids), ps))
    for ids, out in zip(ps, outs):
        assert out == hf_greedy(models[arch], ids, NEW_TOKENS), f"prompt of {len(ids)} tokens"
    p, d = pairing.split("->")
    for role, size in (("P", p), ("D", d)):
        server = servers[f"{role}{size}{arch}"]
        all_ranks_idle(server) if size == "2" else server.wait_idle()
