"""LoRA adapters (``--enable-lora``) over the tiny Llama: three PEFT adapters (attention only,
every linear layer, MLP with rsLoRA's scaling) and the base model mixed in one batch give HF
PEFT's merged models' greedy tokens and logprobs (float32); a prompt hits the prefix cache under
its own adapter and misses under another; a server serves adapters as OpenAI model names and by
``lora_path``, loads and unloads them while other adapters' requests stream; through PD (prefill
on one rank, decode on two) an adapter's tokens are colocated serving's, and a server without the
adapter refuses it by name."""

from __future__ import annotations

import random
import threading

import openai
import pytest

from tests.e2e.test_engine import make_engine
from tests.helpers import cluster as c
from tests.helpers import localhttp
from tests.helpers.checkpoints import build_tiny_checkpoint
from tests.helpers.lora_adapters import ADAPTERS, build_adapter, reference

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def base() -> str:
    return build_tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def adapters(base) -> dict[str, str]:
    return {name: build_adapter(base, name) for name in ADAPTERS}


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def check(out: dict, ref: tuple[list, list], what: str) -> None:
    tokens, lps = ref
    assert out["output_ids"] == tokens, what
    got = [v for v, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(got, lps)) < 1e-4, what


def test_mixed_adapters_in_one_batch_match_peft_merged_models(base, adapters, request):
    eng = make_engine(
        base,
        page_size=16,
        chunked_prefill_size=24,  # prompts cut into chunks that share forwards across adapters
        lora_paths=[f"{n}={p}" for n, p in adapters.items()],
    )
    request.node._engine = eng
    names = [None, "attn", "all", "mlp", "all", None, "mlp", "attn"]
    cases = [(prompt(5 + 9 * i, i), 6 + i) for i in range(len(names))]
    outs = eng.generate(
        input_ids=[ids for ids, _ in cases],
        sampling_params=[{**GREEDY, "max_new_tokens": n} for _, n in cases],
        return_logprob=True,
        lora_path=names,
    )
    for name, (ids, n), out in zip(names, cases, outs):
        ref = reference(base, adapters.get(name), ids, n)
        check(out, ref, f"adapter {name}, prompt of {len(ids)}")
    # each adapter changes what the model says, its tokens or their logprobs far beyond the
    # tolerance above (the comparison can tell the adapters and the base model apart)
    ids, n = cases[1]
    plain = reference(base, None, ids, n)
    for a in ADAPTERS:
        tokens, lps = reference(base, adapters[a], ids, n)
        assert tokens != plain[0] or max(abs(x - y) for x, y in zip(lps, plain[1])) > 1e-2, a
    info = eng.check_integrity()
    assert info["in_use_pages"] == 0 and info["running"] == 0


def test_prefix_cache_hits_under_the_same_adapter_only(base, adapters, request):
    eng = make_engine(base, page_size=4, lora_paths=[f"{n}={p}" for n, p in adapters.items()])
    request.node._engine = eng
    ids = prompt(40, 99)

    def run(name):
        return eng.generate(
            input_ids=ids,
            sampling_params={**GREEDY, "max_new_tokens": 5},
            return_logprob=True,
            lora_path=name,
        )

    eng.scheduler.tree.events = []  # collect the KV events (what a publisher would send)
    first = run("all")
    assert first["meta_info"]["cached_tokens"] == 0
    stored = [e for e in eng.scheduler.tree.events if type(e).__name__ == "BlockStored"]
    assert stored and {e.lora_name for e in stored} == {"all"}
    again = run("all")
    assert again["meta_info"]["cached_tokens"] == 36  # the full pages before the last token
    assert again["output_ids"] == first["output_ids"]
    for other in ("attn", None):  # the same tokens under another adapter (or none): a miss
        out = run(other)
        assert out["meta_info"]["cached_tokens"] == 0, other
        check(out, reference(base, adapters.get(other), ids, 5), f"after 'all': {other}")
    assert run("attn")["meta_info"]["cached_tokens"] == 36
    names = {e.lora_name for e in eng.scheduler.tree.events if type(e).__name__ == "BlockStored"}
    assert names == {"all", "attn", None}  # None: the base model's blocks


def test_adapter_requests_are_refused_by_name(base, adapters):
    eng = make_engine(base, lora_paths=[f"attn={adapters['attn']}"])
    with pytest.raises(ValueError, match="'nope' is not loaded here"):
        eng.generate(input_ids=[5, 6, 7], sampling_params=GREEDY, lora_path="nope")
    plain = make_engine(base)
    with pytest.raises(ValueError, match="serves no LoRA adapters"):
        plain.generate(input_ids=[5, 6, 7], sampling_params=GREEDY, lora_path="attn")


@pytest.fixture(scope="module")
def lora_server(base, adapters, tmp_path_factory):
    logs = tmp_path_factory.mktemp("lora")
    S = c.server(
        "S", base, logs, "--served-model-name", "tiny", "--lora-paths", f"attn={adapters['attn']}"
    )
    yield from (procs["S"] for procs in c.running({"S": S}))


def test_server_serves_adapters_by_model_name_and_lora_path(lora_server, base, adapters):
    S = lora_server
    models = localhttp.get(S.url + "/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in models] == [("tiny", None), ("attn", "tiny")]
    ids = prompt(20, 7)
    ref = reference(base, adapters["attn"], ids, 8)
    client = openai.OpenAI(base_url=S.url + "/v1", api_key="none")
    out = client.completions.create(
        model="attn", prompt=ids, max_tokens=8, temperature=0, logprobs=0, extra_body=GREEDY
    )
    assert out.model == "attn"
    native = localhttp.post(
        S.url + "/generate",
        json={**c.greedy_body(ids, 8), "lora_path": "attn", "return_logprob": True},
        timeout=60,
    ).json()
    check(native, ref, "lora_path")
    assert out.choices[0].text == native["text"]
    # an unknown adapter: OpenAI's 404 naming the models, /generate's 400 naming the loaded ones
    r = localhttp.post(S.url + "/v1/completions", json={"model": "nope", "prompt": "hi"})
    assert r.status_code == 404 and "'nope' does not exist" in r.text and "attn" in r.text
    r = localhttp.post(S.url + "/generate", json={**c.greedy_body(ids, 2), "lora_path": "nope"})
    assert r.status_code == 400 and "'nope' is not loaded" in r.text


def test_adapters_load_and_unload_while_others_stream(lora_server, base, adapters):
    S = lora_server
    ids = prompt(12, 3)
    long_body = {**c.greedy_body(ids, 400), "lora_path": "attn", "stream": True}
    started, done = threading.Event(), {}

    def stream():
        with localhttp.stream("POST", S.url + "/generate", json=long_body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    started.set()
            done["status"] = r.status_code

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    # the gateway's LoRA gauge names the adapter running
    metrics = localhttp.get(S.url + "/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("pdserve:lora_requests_info{"))
    assert 'running_lora_adapters="attn"' in line and 'max_lora="16"' in line, line
    # load 'mlp' and serve it while 'attn' streams
    r = localhttp.post(
        S.url + "/v1/load_lora_adapter",
        json={"lora_name": "mlp", "lora_path": adapters["mlp"]},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert {a["name"] for a in r.json()["adapters"]} == {"attn", "mlp"}
    out = localhttp.post(
        S.url + "/generate",
        json={**c.greedy_body(ids, 6), "lora_path": "mlp", "return_logprob": True},
        timeout=60,
    ).json()
    check(out, reference(base, adapters["mlp"], ids, 6), "loaded at run time")
    # 'attn' cannot go while its request streams; 'mlp' can
    r = localhttp.post(S.url + "/v1/unload_lora_adapter", json={"lora_name": "attn"}, timeout=60)
    assert r.status_code == 400 and "'attn' has 1 request" in r.text, r.text
    r = localhttp.post(S.url + "/unload_lora_adapter", json={"lora_name": "mlp"}, timeout=60)
    assert r.status_code == 200, r.text
    t.join(120)
    assert done["status"] == 200
    r = localhttp.post(S.url + "/generate", json={**c.greedy_body(ids, 2), "lora_path": "mlp"})
    assert r.status_code == 400 and "'mlp' is not loaded" in r.text
    # bad adapters are refused by name, the server unchanged
    r = localhttp.post(
        S.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nonexistent"}
    )
    assert r.status_code == 400 and "adapter_config.json" in r.text
    r = localhttp.post(
        S.url + "/v1/load_lora_adapter", json={"lora_name": "attn", "lora_path": adapters["all"]}
    )
    assert r.status_code == 400 and "already loaded" in r.text
    models = [m["id"] for m in localhttp.get(S.url + "/v1/models").json()["data"]]
    assert models == ["tiny", "attn"]
    S.wait_idle()


@pytest.fixture(scope="module")
def lora_pd(base, adapters, tmp_path_factory):
    logs = tmp_path_factory.mktemp("lora-pd")
    both = [f"all={adapters['all']}", f"mlp={adapters['mlp']}"]
    P, _ = c.prefill("P", base, logs, "--lora-paths", *both, f"attn={adapters['attn']}")
    D = c.decode("D", base, logs, "--tp-size", "2", "--lora-paths", *both)
    R = c.router("R", [P], [D], logs)
    yield from c.running({"P": P, "D": D, "R": R})


def test_pd_with_decode_on_two_ranks_gives_the_adapters_tokens(lora_pd, base, adapters):
    P, D = lora_pd["P"], lora_pd["D"]
    for room, (name, n) in enumerate([("all", 30), ("mlp", 17), (None, 9)]):
        ids = prompt(n, 50 + room)
        body = {**c.greedy_body(ids, 7, P, room), "lora_path": name, "return_logprob": True}
        rp, rd = c.post_pd(P, D, body)
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        check(rd.json(), reference(base, adapters.get(name), ids, 7), f"PD, adapter {name}")
    # the decode lacks 'attn': both ends refuse the request, the prefill is not left waiting
    body = {**c.greedy_body(prompt(10, 1), 4, P, 77), "lora_path": "attn"}
    rp, rd = c.post_pd(P, D, body)
    assert rd.status_code == 400 and "'attn' is not loaded here" in rd.text, rd.text
    assert rp.status_code >= 400, rp.text
    for s in (P, D):
        s.wait_idle()


def test_adapters_on_bf16_weights_match_the_merged_model_up_to_ties(base, adapters, request):
    """bf16: the base weights prepacked for the bf16 kernels, the deltas after each matmul, against
    PEFT's model in bf16 with the adapter beside the base weights, as ours (tie-aware, as the
    bf16 engine tests compare; the merged model in float32 is the second computation that bounds
    the rounding)."""
    import torch

    from tests.e2e.test_engine import hf_generate_logits
    from tests.e2e.test_engine_bf16 import compare
    from tests.e2e.test_engine_bf16 import make_engine as bf16_engine
    from tests.helpers.lora_adapters import merged_model, unmerged_model

    eng = bf16_engine(base, page_size=16, lora_paths=[f"{n}={p}" for n, p in adapters.items()])
    request.node._engine = eng
    names = ["attn", "all", "mlp", None]
    cases = [prompt(9 + 7 * i, 200 + i) for i in range(len(names))]
    outs = eng.generate(
        input_ids=cases,
        sampling_params={**GREEDY, "max_new_tokens": 10},
        return_logprob=True,
        lora_path=names,
    )
    compared = 0
    for name, ids, out in zip(names, cases, outs):
        ref = hf_generate_logits(unmerged_model(base, adapters.get(name), torch.bfloat16), ids, 10)
        other = hf_generate_logits(merged_model(base, adapters.get(name)), ids, 10)
        compared += compare(out, *ref, other=other)
    assert compared >= 20, f"only {compared} of 40 positions compared"


def served(proc) -> set[str]:
    return {m["id"] for m in localhttp.get(proc.url + "/v1/models").json()["data"]}


def test_the_router_loads_and_unloads_adapters_on_every_worker(lora_pd, base, adapters):
    P, D, R = lora_pd["P"], lora_pd["D"], lora_pd["R"]
    body = {"lora_name": "attn2", "lora_path": adapters["attn"]}
    r = localhttp.post(R.url + "/v1/load_lora_adapter", json=body, timeout=60)
    assert r.status_code == 200 and sorted(r.json()["workers"]) == sorted([P.url, D.url]), r.text
    assert "attn2" in served(P) and "attn2" in served(D)
    ids = prompt(21, 5)
    out = localhttp.post(
        R.url + "/generate",
        json={**c.greedy_body(ids, 6), "lora_path": "attn2", "return_logprob": True},
        timeout=60,
    )
    assert out.status_code == 200, out.text
    check(out.json(), reference(base, adapters["attn"], ids, 6), "through the router")
    # the prefill already has 'attn': the decode's load is undone, nothing changed anywhere
    before = (served(P), served(D))
    body = {"lora_name": "attn", "lora_path": adapters["attn"]}
    r = localhttp.post(R.url + "/load_lora_adapter", json=body, timeout=60)
    assert r.status_code == 502 and "already loaded" in r.text, r.text
    assert (served(P), served(D)) == before
    # every worker refusing alike: their 400
    r = localhttp.post(R.url + "/v1/unload_lora_adapter", json={"lora_name": "nope"}, timeout=60)
    assert r.status_code == 400 and "'nope' is not loaded" in r.text, r.text
    r = localhttp.post(R.url + "/v1/unload_lora_adapter", json={"lora_name": "attn2"}, timeout=60)
    assert r.status_code == 200, r.text
    assert "attn2" not in served(P) | served(D)
    for s in (P, D):
        s.wait_idle()
