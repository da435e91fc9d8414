"""Native ``/generate`` of a live server against the offline engine (same checkpoint, greedy)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import sse_events

PROMPTS = ["The quick brown fox", "Once upon a time in a land far away", "1, 2, 3,"]
GREEDY = {"max_new_tokens": 12, "temperature": 0}


def test_single_text_matches_offline(live, offline_engine):
    ref = offline_engine.generate(prompt=PROMPTS[0], sampling_params=GREEDY)
    r = live.http.post("/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output_ids"] == ref["output_ids"]
    assert out["text"] == ref["text"]
    meta = out["meta_info"]
    for key in ("finish_reason", "prompt_tokens", "completion_tokens"):
        assert meta[key] == ref["meta_info"][key], key
    assert isinstance(meta["id"], str) and meta["cached_tokens"] >= 0


def test_batch_of_input_ids_matches_offline(live, offline_engine):
    ids = [offline_engine.tokenizer.encode(p) for p in PROMPTS]
    ref = offline_engine.generate(input_ids=ids, sampling_params=GREEDY)
    r = live.http.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    outs = r.json()
    assert isinstance(outs, list) and len(outs) == len(PROMPTS)
    assert [o["output_ids"] for o in outs] == [x["output_ids"] for x in ref]
    assert [o["text"] for o in outs] == [x["text"] for x in ref]


def test_stream_sends_cumulative_text_and_ids(live, offline_engine):
    ref = offline_engine.generate(prompt=PROMPTS[1], sampling_params=GREEDY)
    with live.http.stream(
        "POST", "/generate", json={"text": PROMPTS[1], "sampling_params": GREEDY, "stream": True}
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks
    for prev, cur in zip(chunks, chunks[1:]):
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        assert cur["text"].startswith(prev["text"])
        assert prev["meta_info"]["finish_reason"] is None
    assert chunks[-1]["output_ids"] == ref["output_ids"]
    assert chunks[-1]["text"] == ref["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"]


def test_multibyte_prompt_stream_concatenates_to_final_text(live, offline_engine):
    prompt = "日本語のテキスト 😀🎉 中文 한국어 émoji ✨"
    params = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
    ref = offline_engine.generate(prompt=prompt, sampling_params=params)
    with live.http.stream(
        "POST", "/generate", json={"text": prompt, "sampling_params": params, "stream": True}
    ) as r:
        chunks = sse_events(r.iter_lines())[:-1]
    texts = [c["text"] for c in chunks]
    for prev, cur in zip(texts, texts[1:]):
        assert cur.startswith(prev)
    final = chunks[-1]
    assert final["output_ids"] == ref["output_ids"]
    assert (
        final["text"]
        == ref["text"]
        == offline_engine.tokenizer.decode(ref["output_ids"], skip_special_tokens=True)
    )


def test_logprobs_match_offline(live, offline_engine):
    kw = {"return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 0}
    ref = offline_engine.generate(prompt=PROMPTS[2], sampling_params=GREEDY, **kw)["meta_info"]
    r = live.http.post("/generate", json={"text": PROMPTS[2], "sampling_params": GREEDY, **kw})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        assert len(meta[key]) == len(ref[key]), key
        for got, want in zip(meta[key], ref[key]):
            assert got[1] == want[1] and got[2] is None
            assert (got[0] is None and want[0] is None) or abs(got[0] - want[0]) < 1e-4
    assert meta["input_token_logprobs"][0][0] is None  # the first prompt token has no logprob
    assert [[e[1] for e in top] for top in meta["output_top_logprobs"]] == [
        [e[1] for e in top] for top in ref["output_top_logprobs"]
    ]
    assert all(len(top) == 3 for top in meta["output_top_logprobs"])


def test_logprob_text_when_asked(live):
    r = live.http.post(
        "/generate",
        json={
            "text": PROMPTS[0],
            "sampling_params": GREEDY,
            "return_logprob": True,
            "return_text_in_logprobs": True,
        },
    )
    entries = r.json()["meta_info"]["output_token_logprobs"]
    assert all(isinstance(e[2], str) for e in entries)
    assert "".join(e[2] for e in entries) == r.json()["text"]


def test_router_shaped_body_with_rid_and_bootstrap_fields(live):
    """The body as sglang-router re-serialises it (reference/sglang-router-wire-examples.md)."""
    body = {
        "text": "hello world from router",
        "model": None,
        "rid": "my-request-id-1",
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 4},
        "return_text_in_logprobs": False,
        "stream": False,
        "log_metrics": True,
        "return_hidden_states": False,
        "background": False,
        "no_logs": False,
        "return_bytes": False,
        "return_entropy": False,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": 31901,
        "bootstrap_room": 8016466815125474810,
    }
    r = live.http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["meta_info"]["id"] == "my-request-id-1"
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert len(out["output_ids"]) == 4


def test_n_samples_and_batch_order(live):
    r = live.http.post(
        "/generate",
        json={
            "text": PROMPTS[:2],
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "n": 2},
        },
    )
    assert r.status_code == 200, r.text
    outs = r.json()
    assert len(outs) == 4  # prompt i, sample j at i * n + j
    assert outs[0]["output_ids"] == outs[1]["output_ids"]  # greedy samples agree
    assert outs[2]["output_ids"] == outs[3]["output_ids"]
    assert outs[0]["meta_info"]["prompt_tokens"] != outs[2]["meta_info"]["prompt_tokens"]


def test_batch_stream_tags_items_with_index(live):
    with live.http.stream(
        "POST",
        "/generate",
        json={
            "text": PROMPTS,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0},
            "stream": True,
        },
    ) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    finals = {e["index"]: e for e in events[:-1] if e["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1, 2]
    assert all(len(e["output_ids"]) == 5 for e in finals.values())


@pytest.mark.parametrize("stop_kind", ["string", "token"])
def test_stop_is_trimmed_from_text(live, offline_engine, stop_kind):
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    full = offline_engine.generate(prompt=PROMPTS[0], sampling_params=params)
    ids = full["output_ids"]
    tok = offline_engine.tokenizer
    if stop_kind == "string":
        # a stop string spanning the boundary between output tokens 4 and 5
        left, right = tok.decode(ids[:5]), tok.decode(ids[:6])
        stop = left[-2:] + right[len(left) : len(left) + 2]
        params = {**params, "stop": [stop]}
    else:
        params = {**params, "stop_token_ids": [ids[5]]}
    ref = offline_engine.generate(prompt=PROMPTS[0], sampling_params=params)
    assert ref["meta_info"]["finish_reason"]["type"] == "stop"
    r = live.http.post("/generate", json={"text": PROMPTS[0], "sampling_params": params})
    assert r.json()["text"] == ref["text"]
    assert r.json()["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"]
    with live.http.stream(
        "POST", "/generate", json={"text": PROMPTS[0], "sampling_params": params, "stream": True}
    ) as r:
        chunks = sse_events(r.iter_lines())[:-1]
    assert chunks[-1]["text"] == ref["text"]
    if stop_kind == "string":
        assert not any(params["stop"][0] in c["text"] for c in chunks)
