"""Prefill/decode disaggregation end to end: real servers, real router, real KV transfer.

Reference outputs come from the offline engine (itself checked token for token against HF
transformers in test_engine.py), from HF directly for a sample, and from the colocated server.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.conftest import PD_NEW_TOKENS as NEW_TOKENS
from tests.helpers import cluster as c
from tests.helpers import localhttp
from tests.helpers.checkpoints import build_tiny_checkpoint
from tests.helpers.sglang_router import sglang_router_available, start_sglang_router

TIMEOUTS = ["--disaggregation-bootstrap-timeout", "10", "--disaggregation-waiting-timeout", "10"]
COMMON = ["--max-total-tokens", "65536", "--served-model-name", "tiny-llama", *TIMEOUTS]


def mixed_prompts(n: int, seed: int = 0, max_len: int = 1500) -> list[list[int]]:
    rng = random.Random(seed)
    lens = [1, 2, 15, 16, 17, 31, 32, 33, max_len] + [rng.randint(1, max_len) for _ in range(n - 9)]
    return [[rng.randrange(100, 40000) for _ in range(k)] for k in lens[:n]]


@pytest.fixture(scope="module")
def pd(tmp_path_factory, tiny_llama_path):
    """Servers: P1 P2 D1 D2 (page 16), P1b D1b (page 1), DX (another model); routers over them."""
    logs = tmp_path_factory.mktemp("pd")
    other_model = build_tiny_checkpoint("qwen2")
    p16 = ["--page-size", "16", "--chunked-prefill-size", "256", *COMMON]
    p1 = ["--page-size", "1", "--chunked-prefill-size", "128", *COMMON]
    P1, _ = c.prefill("P1", tiny_llama_path, logs, *p16)
    P2, _ = c.prefill("P2", tiny_llama_path, logs, *p16)
    P1b, _ = c.prefill("P1b", tiny_llama_path, logs, *p1)
    D1 = c.decode("D1", tiny_llama_path, logs, *p16)
    D2 = c.decode("D2", tiny_llama_path, logs, *p16)
    D1b = c.decode("D1b", tiny_llama_path, logs, *p1)
    DX = c.decode("DX", other_model, logs, *p16)
    servers = [P1, P2, P1b, D1, D2, D1b, DX]
    try:
        c.start_all(servers)
        routers = {
            "1p1d": c.router("R11", [P1], [D1], logs),
            "1p2d": c.router("R12", [P1], [D1, D2], logs, "--policy", "round_robin"),
            "2p1d": c.router("R21", [P1, P2], [D1], logs, "--policy", "round_robin"),
            "page1": c.router("Rb", [P1b], [D1b], logs),
        }
        for r in routers.values():
            r.start()
        yield {"servers": {s.name: s for s in servers}, "routers": routers, "logs": logs}
    finally:
        c.stop_all([*locals().get("routers", {}).values(), *servers])


def generate(url: str, ids: list[int], stream: bool, logprobs: bool = False) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
        "stream": stream,
    }
    if logprobs:
        body.update(return_logprob=True, logprob_start_len=0)
    with localhttp.Client(timeout=120) as h:
        if not stream:
            r = h.post(url + "/generate", json=body)
            assert r.status_code == 200, r.text
            return r.json()
        last = None
        with h.stream("POST", url + "/generate", json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    last = json.loads(line[6:])
        return last


def assert_same(out: dict, ref: dict, logprobs: bool = False) -> None:
    assert out["output_ids"] == ref["output_ids"]
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    if logprobs:
        m, rm = out["meta_info"], ref["meta_info"]
        for key in ("output_token_logprobs", "input_token_logprobs"):
            got, want = m[key], rm[key]
            assert [e[1] for e in got] == [e[1] for e in want], key
            for a, b in zip(got, want):
                assert (a[0] is None) == (b[0] is None)
                if a[0] is not None:
                    assert abs(a[0] - b[0]) < 1e-4, (key, a, b)


@pytest.mark.parametrize("topology", ["1p1d", "page1"])
def test_mixed_lengths_match_colocated_and_hf(pd, reference, topology, tiny_llama_path):
    router = pd["routers"][topology]
    prompts = mixed_prompts(200, seed=1 if topology == "1p1d" else 2)
    jobs = [
        (ids, i % 2 == 0, i % 10 == 0) for i, ids in enumerate(prompts)
    ]  # (ids, stream, logprobs)
    with ThreadPoolExecutor(16) as ex:
        outs = list(ex.map(lambda j: generate(router.url, *j), jobs))
    refs = reference.many([(ids, logprobs) for ids, _, logprobs in jobs])
    for (ids, stream, logprobs), out, ref in zip(jobs, outs, refs):
        assert_same(out, ref, logprobs)
    # a sample straight against HF transformers
    from tests.e2e.test_engine import hf_greedy

    for ids, out in list(zip(prompts, outs))[:10]:
        assert out["output_ids"] == hf_greedy(tiny_llama_path, ids, NEW_TOKENS)
    for name in ["P1", "D1"] if topology == "1p1d" else ["P1b", "D1b"]:
        pd["servers"][name].wait_idle()


def test_openai_client_through_router_matches_colocated(pd, server):
    import openai

    pd_client = openai.OpenAI(base_url=pd["routers"]["1p1d"].url + "/v1", api_key="x")
    co_client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    model = "tiny-llama"
    prompts = ["The quick brown fox", "Once upon a time in a land far away, there lived", "1 2 3 4"]
    for prompt in prompts:
        kw = dict(model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, logprobs=2)
        a = pd_client.completions.create(**kw)
        b = co_client.completions.create(**kw)
        assert a.choices[0].text == b.choices[0].text
        assert a.choices[0].logprobs.tokens == b.choices[0].logprobs.tokens
        for x, y in zip(a.choices[0].logprobs.token_logprobs, b.choices[0].logprobs.token_logprobs):
            assert abs(x - y) < 1e-4
        streamed = "".join(
            ch.choices[0].text
            for ch in pd_client.completions.create(
                model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, stream=True
            )
            if ch.choices
        )
        assert streamed == b.choices[0].text
        msgs = [{"role": "user", "content": prompt}]
        ca = pd_client.chat.completions.create(
            model=model, messages=msgs, max_tokens=NEW_TOKENS, temperature=0
        )
        cb = co_client.chat.completions.create(
            model=model, messages=msgs, max_tokens=NEW_TOKENS, temperature=0
        )
        assert ca.choices[0].message.content == cb.choices[0].message.content
        assert ca.usage.completion_tokens == cb.usage.completion_tokens
        chunks = pd_client.chat.completions.create(
            model=model, messages=msgs, max_tokens=NEW_TOKENS, temperature=0, stream=True
        )
        streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert streamed == cb.choices[0].message.content


def _generation_tokens(proc: c.Proc) -> int:
    info = proc.http.get("/server_info").json()
    return info["internal_states"][0]["generation_tokens"]


@pytest.mark.parametrize("topology, spread", [("1p2d", ["D1", "D2"]), ("2p1d", ["P1", "P2"])])
def test_multi_instance_topologies(pd, reference, topology, spread):
    before = {n: _generation_tokens(pd["servers"][n]) for n in spread}
    router = pd["routers"][topology]
    prompts = mixed_prompts(24, seed=3, max_len=400)
    with ThreadPoolExecutor(8) as ex:
        outs = list(ex.map(lambda ids: generate(router.url, ids, stream=True), prompts))
    for ids, out in zip(prompts, outs):
        assert_same(out, reference(ids))
    for n in spread:  # round robin used every instance
        assert _generation_tokens(pd["servers"][n]) > before[n], n


def _dual_post(
    prefill: c.Proc, decode_: c.Proc, ids: list[int]
) -> tuple[httpx.Response, httpx.Response, float]:
    room = random.randrange(2**63)
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": 4},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": room,
    }
    t0 = time.monotonic()
    with ThreadPoolExecutor(2) as ex:
        fp = ex.submit(localhttp.post, prefill.url + "/generate", json=body, timeout=60)
        fd = ex.submit(localhttp.post, decode_.url + "/generate", json=body, timeout=60)
        rd, rp = fd.result(), fp.result()
    return rp, rd, time.monotonic() - t0


@pytest.mark.parametrize("decode_name, needle", [("DX", "model_fingerprint"), ("D1b", "page_size")])
def test_incompatible_pair_fails_with_explanation(pd, decode_name, needle):
    s = pd["servers"]
    rp, rd, elapsed = _dual_post(s["P1"], s[decode_name], [5, 6, 7, 8])
    assert rd.status_code >= 400, rd.text
    msg = rd.json()["error"]["message"]
    assert needle in msg and "prefill" in msg and "decode" in msg, msg
    assert rp.status_code >= 400  # prefill gives up on the room instead of hanging
    assert elapsed < 30
    for name in ("P1", decode_name):
        s[name].wait_idle()


@pytest.mark.skipif(
    not sglang_router_available(), reason="sglang-router is not installable on this platform"
)
def test_behind_the_real_sglang_router(pd, reference, tmp_path):
    import openai

    s = pd["servers"]
    port = c.free_port()
    proc = start_sglang_router(
        [(s["P1"].url, s["P1"].bootstrap_port)],
        [s["D1"].url],
        port,
        log_path=str(tmp_path / "sglang-router.log"),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        prompts = mixed_prompts(12, seed=4, max_len=300)
        for i, ids in enumerate(prompts):
            lp = i % 3 == 0
            out = generate(url, ids, stream=i % 2 == 1, logprobs=lp)
            assert_same(out, reference(ids, lp), lp)
        ours = openai.OpenAI(base_url=pd["routers"]["1p1d"].url + "/v1", api_key="x")
        theirs = openai.OpenAI(base_url=url + "/v1", api_key="x")
        for stream in (False, True):
            kw = dict(
                model="tiny-llama",
                prompt="Hello world, this is",
                max_tokens=NEW_TOKENS,
                temperature=0,
            )
            a = ours.completions.create(**kw)
            if stream:
                text = "".join(
                    ch.choices[0].text
                    for ch in theirs.completions.create(**kw, stream=True)
                    if ch.choices
                )
            else:
                text = theirs.completions.create(**kw).choices[0].text
            assert text == a.choices[0].text
            msgs = [{"role": "user", "content": "Say something"}]
            kw = dict(model="tiny-llama", messages=msgs, max_tokens=NEW_TOKENS, temperature=0)
            a = ours.chat.completions.create(**kw).choices[0].message.content
            if stream:
                text = "".join(
                    ch.choices[0].delta.content or ""
                    for ch in theirs.chat.completions.create(**kw, stream=True)
                    if ch.choices
                )
            else:
                text = theirs.chat.completions.create(**kw).choices[0].message.content
            assert text == a
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    for name in ("P1", "D1"):
        s[name].wait_idle()


def test_every_page_and_slot_free_afterwards(pd):
    for name, proc in pd["servers"].items():
        pools = proc.wait_idle()
        assert pools["metadata_slots_free"] == pools["metadata_slots_total"], (name, pools)


def test_batches_and_n_samples_get_one_room_each(pd, reference, server):
    import openai

    url = pd["routers"]["1p1d"].url
    prompts = mixed_prompts(3, seed=5, max_len=200)
    sp = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    r = localhttp.post(
        url + "/generate", json={"input_ids": prompts, "sampling_params": sp}, timeout=120
    )
    assert r.status_code == 200, r.text
    for ids, out in zip(prompts, r.json()):
        assert_same(out, reference(ids))
    r = localhttp.post(
        url + "/generate",
        json={"input_ids": prompts[0], "sampling_params": dict(sp, n=2)},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert [o["output_ids"] for o in r.json()] == [reference(prompts[0])["output_ids"]] * 2
    pd_client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    co_client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    msgs = [{"role": "user", "content": "Tell me a story"}]
    a = pd_client.chat.completions.create(
        model="tiny-llama", messages=msgs, n=2, max_tokens=NEW_TOKENS, temperature=0
    )
    b = co_client.chat.completions.create(
        model="tiny-llama", messages=msgs, max_tokens=NEW_TOKENS, temperature=0
    )
    assert [ch.message.content for ch in a.choices] == [b.choices[0].message.content] * 2
    two = ["First prompt here", "And a second one"]
    a = pd_client.completions.create(
        model="tiny-llama", prompt=two, max_tokens=NEW_TOKENS, temperature=0
    )
    b = co_client.completions.create(
        model="tiny-llama", prompt=two, max_tokens=NEW_TOKENS, temperature=0
    )
    assert sorted((ch.index, ch.text) for ch in a.choices) == sorted(
        (ch.index, ch.text) for ch in b.choices
    )
    for name in ("P1", "D1"):
        pd["servers"][name].wait_idle()
