"""Routed experts in the response (``return_routed_experts``, ``--enable-return-routed-experts``):
for every token the model ran (the prompt, and each generated token but the last), the experts
each MoE layer chose, in token order, as SGLang returns them (base64 of little-endian int32
[tokens, num_hidden_layers, top_k], 0 in dense layers).

The reference is HF transformers: the tiny Qwen3-MoE (layers 0 and 2 sparse, 8 experts, top 2)
run once over prompt + generated tokens, each sparse layer's ``mlp.gate`` hooked for its top-k
choices. Checked colocated (offline engine with chunked prefill smaller than the prompt and a
prefix-cache hit; one HTTP server on /generate, /v1/completions and /v1/chat/completions,
streaming and not), and through PD: prefill's ids for the prompt followed by decode's for the
generated tokens, behind pdserve's router and the Rust sglang-router, with decode's own prefix
cache, and into a decode with DP attention and expert parallelism over mooncake (local when
mooncake is not installed). Every pool is free afterwards.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from pdserve.chat_template import chat_input_ids
from pdserve.config import ServerArgs
from pdserve.disagg.transfer import get_backend
from pdserve.engine.routed_experts import decode as decode_ids
from tests.e2e.conftest import sse_events
from tests.helpers import cluster as c
from tests.helpers import localhttp
from tests.helpers.checkpoints import build_tiny_checkpoint
from tests.helpers.sglang_router import sglang_router_available, start_sglang_router

torch.set_num_threads(1)

LAYERS, TOP_K = 3, 2  # the tiny Qwen3-MoE: layers 0 and 2 sparse, layer 1 dense
NEW = 6
GREEDY = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
# float32 everywhere (HF's reference too); pages of 4 and chunks of 8 tokens under 21-token prompts
MODEL = "tiny-moe"
SERVE = [
    "--enable-return-routed-experts",
    "--served-model-name",
    MODEL,
    "--dtype",
    "float32",
    "--page-size",
    "4",
    "--chunked-prefill-size",
    "8",
    "--max-total-tokens",
    "4096",
    "--disaggregation-bootstrap-timeout",
    "10",
    "--disaggregation-waiting-timeout",
    "10",
]
PROMPT = list(range(300, 321))
FOLLOW_UP = PROMPT[:16] + [7, 8, 9, 10, 11]  # shares four full pages with PROMPT


@pytest.fixture(scope="module")
def moe_path() -> str:
    return build_tiny_checkpoint("qwen3_moe")


@pytest.fixture(scope="module")
def hf_routes(moe_path):
    """seq -> HF's routed experts of every position: int32 [len, LAYERS, TOP_K], 0 in dense
    layers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32).eval()
    seen: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "gate"):  # a sparse block; its router returns (logits, weights, ids)
            layer.mlp.gate.register_forward_hook(
                lambda m, args, out, i=i: seen.__setitem__(i, out[2])
            )
    assert sum(hasattr(layer.mlp, "gate") for layer in model.model.layers) == 2

    def routes(seq: list[int]) -> np.ndarray:
        seen.clear()
        with torch.no_grad():
            model(torch.tensor([seq]))
        out = np.zeros((len(seq), LAYERS, TOP_K), dtype=np.int32)
        for i, ids in seen.items():
            out[:, i] = ids.numpy()
        return out

    return routes


def ids_of(meta_or_ext: dict) -> np.ndarray:
    return decode_ids(base64.b64decode(meta_or_ext["routed_experts"]), LAYERS, TOP_K)


def assert_routes(
    got: np.ndarray, prompt: list[int], output_ids: list[int], hf_routes, start: int = 0
) -> None:
    """``got`` holds the routes of prompt + output[:-1] from position ``start``, as HF routes
    them."""
    seq = prompt + output_ids[:-1]
    assert got.shape == (len(seq) - start, LAYERS, TOP_K)
    np.testing.assert_array_equal(got, hf_routes(seq)[start:])


# ---- colocated: the offline engine ---------------------------------------------------------------
def test_engine_routes_match_hf_with_chunks_and_a_prefix_hit(moe_path, hf_routes):
    import pdserve

    eng = pdserve.Engine(
        model_path=moe_path,
        enable_return_routed_experts=True,
        dtype="float32",
        page_size=4,
        chunked_prefill_size=8,
        max_total_tokens=4096,
        torch_num_threads=1,
    )
    outs = eng.generate(
        input_ids=[PROMPT, PROMPT[:5]], sampling_params=GREEDY, return_routed_experts=True
    )
    for prompt, out in zip([PROMPT, PROMPT[:5]], outs):
        assert out["meta_info"]["cached_tokens"] == 0
        assert_routes(ids_of(out["meta_info"]), prompt, out["output_ids"], hf_routes)
    # the cached pages were run by the first request: their ids come from the pages' store
    hit = eng.generate(input_ids=FOLLOW_UP, sampling_params=GREEDY, return_routed_experts=True)
    assert hit["meta_info"]["cached_tokens"] == 16
    assert_routes(ids_of(hit["meta_info"]), FOLLOW_UP, hit["output_ids"], hf_routes)
    plain = eng.generate(input_ids=FOLLOW_UP, sampling_params=GREEDY)
    assert "routed_experts" not in plain["meta_info"] and plain["output_ids"] == hit["output_ids"]
    info = eng.check_integrity()
    assert (
        info["free_pages"] + info["cached_pages"] == info["total_pages"]
        and info["in_use_pages"] == 0
    )


def test_dense_model_and_pipeline_stages_are_refused(tmp_path):
    import pdserve

    dense = build_tiny_checkpoint("llama")
    eng = pdserve.Engine(
        model_path=dense,
        enable_return_routed_experts=True,
        torch_num_threads=1,
        max_total_tokens=1024,
    )
    with pytest.raises(ValueError, match="the model has no MoE layers"):
        eng.generate(
            input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 1}, return_routed_experts=True
        )
    with pytest.raises(
        ValueError, match="--enable-return-routed-experts needs every layer on one rank"
    ):
        ServerArgs(model_path=dense, pp_size=2, enable_return_routed_experts=True)


# ---- servers -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers(moe_path, tmp_path_factory):
    """C: colocated. P -> D (local backend, decode prefix cache) behind pdserve's router R and the
    sglang-router S. P2 -> D2 (mooncake, else local; D2: 2 DP attention groups, experts over 2
    ranks, all-to-all dispatch) behind R2."""
    logs = tmp_path_factory.mktemp("routed-experts")
    try:
        get_backend("mooncake")
        backend2 = "mooncake"
    except ValueError:
        backend2 = "local"
    C = c.server("C", moe_path, logs, *SERVE)
    P, _ = c.prefill("P", moe_path, logs, *SERVE)
    peers = ["--migration-peers", "127.0.0.1"]  # D moves requests to D3 (POST /migrate)
    D = c.decode("D", moe_path, logs, *SERVE, *peers, "--disaggregation-decode-enable-radix-cache")
    D3 = c.decode("D3", moe_path, logs, *SERVE, *peers)
    b2 = ["--disaggregation-transfer-backend", backend2]
    P2, _ = c.prefill("P2", moe_path, logs, *SERVE, *b2)
    D2 = c.decode(
        "D2",
        moe_path,
        logs,
        *SERVE,
        *b2,
        "--tp-size",
        "2",
        "--dp-size",
        "2",
        "--enable-dp-attention",
        "--ep-size",
        "2",
        "--moe-a2a-backend",
        "torch",
    )
    procs = [C, P, D, P2, D2, D3]
    sgl = None
    try:
        c.start_all(procs)
        R, R2 = c.router("R", [P], [D], logs), c.router("R2", [P2], [D2], logs)
        procs += [R, R2]
        c.start_all([R, R2])
        if sglang_router_available():
            port = c.free_port()
            sgl = start_sglang_router(
                [(P.url, P.bootstrap_port)], [D.url], port, log_path=str(logs / "sgl.log")
            )
            sgl.url = f"http://127.0.0.1:{port}"
        yield {
            "C": C,
            "P": P,
            "D": D,
            "R": R,
            "P2": P2,
            "D2": D2,
            "D3": D3,
            "R2": R2,
            "sgl": sgl,
            "backend2": backend2,
        }
    finally:
        if sgl is not None:
            sgl.terminate()
            sgl.wait(timeout=15)
        c.stop_all(reversed(procs))


def post(url: str, path: str, body: dict) -> dict:
    r = localhttp.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream(url: str, path: str, body: dict) -> list:
    with localhttp.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return sse_events(r.iter_lines())


def gen_body(ids, **extra) -> dict:
    return {"input_ids": ids, "sampling_params": GREEDY, "return_routed_experts": True, **extra}


def test_colocated_generate(servers, hf_routes):
    C = servers["C"].url
    out = post(C, "/generate", gen_body(PROMPT))
    assert_routes(ids_of(out["meta_info"]), PROMPT, out["output_ids"], hf_routes)
    # a batch asks per prompt; a stream carries them in its final event only
    both = post(
        C, "/generate", gen_body([PROMPT[:5], PROMPT[:9]], return_routed_experts=[True, False])
    )
    assert_routes(ids_of(both[0]["meta_info"]), PROMPT[:5], both[0]["output_ids"], hf_routes)
    assert "routed_experts" not in both[1]["meta_info"]
    events = [e for e in stream(C, "/generate", gen_body(FOLLOW_UP)) if e != "[DONE]"]
    assert [("routed_experts" in e["meta_info"]) for e in events] == [False] * (len(events) - 1) + [
        True
    ]
    assert events[-1]["meta_info"]["cached_tokens"] == 16  # PROMPT's pages: the prefix cache's ids
    assert_routes(ids_of(events[-1]["meta_info"]), FOLLOW_UP, events[-1]["output_ids"], hf_routes)
    # routed_experts_start_len: only the rows from that position on
    out = post(C, "/generate", gen_body(PROMPT, routed_experts_start_len=15))
    assert_routes(ids_of(out["meta_info"]), PROMPT, out["output_ids"], hf_routes, start=15)
    r = localhttp.post(
        C + "/generate", json=gen_body(PROMPT, routed_experts_start_len=22), timeout=60
    )
    assert r.status_code == 400 and "routed_experts_start_len" in r.text


def test_colocated_openai_routes(servers, hf_routes, moe_path):
    C = servers["C"].url
    out_ids = post(C, "/generate", gen_body(PROMPT))["output_ids"]
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": NEW,
        "temperature": 0,
        "ignore_eos": True,
        "return_routed_experts": True,
    }
    comp = post(C, "/v1/completions", body)
    assert_routes(ids_of(comp["sglext"]), PROMPT, out_ids, hf_routes)
    assert "sglext" not in post(C, "/v1/completions", {**body, "return_routed_experts": False})
    messages = [{"role": "user", "content": "Which experts?"}]
    prompt = chat_input_ids(AutoTokenizer.from_pretrained(moe_path), messages)
    chat_out = post(C, "/generate", gen_body(prompt))["output_ids"]
    chat = {
        "messages": messages,
        "max_tokens": NEW,
        "temperature": 0,
        "ignore_eos": True,
        "return_routed_experts": True,
    }
    assert_routes(
        ids_of(post(C, "/v1/chat/completions", chat)["sglext"]), prompt, chat_out, hf_routes
    )
    # a stream: one chunk without choices carries sglext (before usage and [DONE]), as SGLang sends
    # it
    events = stream(C, "/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}})
    ext = [e for e in events if isinstance(e, dict) and "sglext" in e]
    assert len(ext) == 1 and ext[0]["choices"] == [] and events.index(ext[0]) == len(events) - 3
    assert_routes(ids_of(ext[0]["sglext"]), prompt, chat_out, hf_routes)


def test_asking_without_the_flag_is_400(live):
    for path, body in [
        ("/generate", {"text": "hi", "return_routed_experts": True}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "return_routed_experts": True},
        ),
    ]:
        r = live.http.post(path, json=body)
        assert r.status_code == 400 and "--enable-return-routed-experts" in r.text, r.text


# ---- PD ------------------------------------------------------------------------------------------
def recent_transfers(proc) -> list[dict]:
    return proc.http.get("/server_info").json()["internal_states"][0]["recent_transfers"]


def test_pd_prompt_ids_from_prefill_then_decode_ids(servers, hf_routes):
    R, P = servers["R"].url, servers["P"]
    out = post(R, "/generate", gen_body(PROMPT))
    assert_routes(ids_of(out["meta_info"]), PROMPT, out["output_ids"], hf_routes)
    # decode's prefix cache holds PROMPT's first pages now: prefill sends only the rest, and the
    # cached part's ids are decode's copy of what prefill sent the first time
    events = [e for e in stream(R, "/generate", gen_body(FOLLOW_UP)) if e != "[DONE]"]
    assert recent_transfers(P)[-1]["decode_prefix_pages"] == 4
    assert_routes(ids_of(events[-1]["meta_info"]), FOLLOW_UP, events[-1]["output_ids"], hf_routes)
    # max_new_tokens 1: the prompt's ids alone, all from prefill
    one = post(
        R, "/generate", gen_body(PROMPT[:7], sampling_params={**GREEDY, "max_new_tokens": 1})
    )
    assert_routes(ids_of(one["meta_info"]), PROMPT[:7], one["output_ids"], hf_routes)


def test_pd_behind_sglang_router(servers, hf_routes, moe_path):
    """sglang-router 0.3.2 keeps ``return_routed_experts`` on /v1/completions (it rebuilds the
    /generate and chat bodies from the fields it knows and drops it there); decode's answer
    alone carries the whole sequence's ids."""
    sgl = servers["sgl"]
    if sgl is None:
        pytest.skip("sglang-router is not installed")
    text = "Mixture of experts, routed through the reference router"  # it takes no token-id prompts
    ids = AutoTokenizer.from_pretrained(moe_path)(text)["input_ids"]
    out_ids = post(servers["C"].url, "/generate", gen_body(ids))["output_ids"]
    body = {
        "model": MODEL,
        "prompt": text,
        "max_tokens": NEW,
        "temperature": 0,
        "ignore_eos": True,
        "return_routed_experts": True,
    }
    assert_routes(ids_of(post(sgl.url, "/v1/completions", body)["sglext"]), ids, out_ids, hf_routes)


def test_pd_into_dp_attention_with_expert_parallelism(servers, hf_routes):
    R2 = servers["R2"].url
    prompts = [PROMPT, PROMPT[3:], [5, 6, 7, 8, 9, 10, 11, 12, 13]]
    outs = [post(R2, "/generate", gen_body(p)) for p in prompts]
    for p, out in zip(prompts, outs):
        assert_routes(ids_of(out["meta_info"]), p, out["output_ids"], hf_routes)
    groups = servers["D2"].http.get("/server_info").json()["internal_states"]
    assert len(groups) == 2 and all(g["generation_tokens"] > 0 for g in groups), (
        groups
    )  # both groups decoded


def test_a_moved_request_keeps_its_routed_experts(servers, hf_routes):
    """A request moved from D to D3 mid-generation (``POST /migrate``) still answers with the
    routed experts of its whole sequence: prefill's for the prompt, D's up to the move, D3's
    after it; the same ids as the unmoved run's, and HF's for the prompt and the first tokens."""
    import threading

    R, D, D3 = servers["R"].url, servers["D"], servers["D3"]
    body = gen_body(PROMPT[2:], sampling_params={**GREEDY, "max_new_tokens": 1500})
    events: list = []

    def run() -> None:
        events.extend(stream(R, "/generate", body))

    ref = post(R, "/generate", body)
    moving = threading.Thread(target=run, daemon=True)
    moving.start()
    c.wait_for(lambda: D.integrity()["running"] == 1, 60, "the request to decode on D")
    r = localhttp.post(D.url + "/migrate", json={"rid": "all", "target": D3.url}, timeout=30)
    assert r.status_code == 200 and len(r.json()["moved"]) == 1, r.text
    moving.join(120)
    final = [e for e in events if e != "[DONE]"][-1]
    assert final["output_ids"] == ref["output_ids"]
    got = ids_of(final["meta_info"])
    np.testing.assert_array_equal(got, ids_of(ref["meta_info"]))
    n = len(PROMPT[2:]) + 10  # the prompt and the first ten generated tokens' routes
    assert_routes(got[:n], PROMPT[2:], final["output_ids"][:11], hf_routes)
    states = D3.http.get("/server_info").json()["internal_states"][0]
    assert states["generation_tokens"] > 0  # D3 decoded after the move


def test_pools_free_afterwards(servers):
    for name in ("C", "P", "D", "P2", "D2", "D3"):
        pools = servers[name].wait_idle()
        assert pools.get("metadata_slots_free", 0) == pools.get("metadata_slots_total", 0), (
            name,
            pools,
        )
