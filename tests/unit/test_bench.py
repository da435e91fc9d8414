"""Serving benchmark: metrics, datasets, arrivals, stream parsing, an end-to-end run against a
fake streaming server, and the plot."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.bench import datasets, serving
from pdserve.bench.backends import GenerateStream, StreamError
from pdserve.bench.datasets import PromptRenderer
from pdserve.bench.metrics import RequestRecord, distribution_ms, summarize

# ---------------------------------------------------------------- metrics


def test_percentiles_linear_interpolation():
    d = distribution_ms([0.004, 0.001, 0.003, 0.002])  # sorted ms: 1 2 3 4
    assert d["mean"] == pytest.approx(2.5)
    assert d["median"] == pytest.approx(2.5)
    assert d["p90"] == pytest.approx(3.7)  # rank 0.9 * 3 = 2.7 -> 3 + 0.7 * (4 - 3)
    assert d["p99"] == pytest.approx(3.97)
    assert distribution_ms([]) is None


def test_tpot_excludes_first_token():
    r = RequestRecord(success=True, output_len=5, ttft=0.2, e2e_latency=1.0)
    assert r.tpot == pytest.approx(0.2)  # 0.8 s over the 4 tokens after the first
    assert RequestRecord(success=True, output_len=1, ttft=0.2, e2e_latency=0.2).tpot is None
    assert RequestRecord(success=True, output_len=0).tpot is None


def _records():
    return [
        RequestRecord(
            success=True, prompt_len=10, output_len=11, ttft=0.1, e2e_latency=0.3, itl=[0.02] * 10
        ),  # tpot 20 ms: good
        RequestRecord(
            success=True, prompt_len=20, output_len=3, ttft=0.5, e2e_latency=0.6, itl=[0.04, 0.06]
        ),  # ttft 500 ms: misses the TTFT SLO
        RequestRecord(success=True, prompt_len=30, output_len=1, ttft=0.15, e2e_latency=0.15),
        # ^ tpot undefined: meets the TPOT SLO, so good
        RequestRecord(
            success=True, prompt_len=5, output_len=2, ttft=0.1, e2e_latency=0.2, itl=[0.1]
        ),  # tpot 100 ms: misses the TPOT SLO
        RequestRecord(success=False, error="boom", prompt_len=40),
    ]


def test_summary_counts_throughput_and_distributions():
    s = summarize(_records(), duration_s=2.0)
    assert (s["completed"], s["failed"]) == (4, 1)
    assert s["total_input_tokens"] == 65 and s["total_output_tokens"] == 17
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["input_throughput"] == pytest.approx(32.5)
    assert s["output_throughput"] == pytest.approx(8.5)
    assert s["total_throughput"] == pytest.approx(41.0)
    assert s["ttft_ms"]["mean"] == pytest.approx((100 + 500 + 150 + 100) / 4)
    # TPOT over the three requests where it is defined: 20, 50, 100 ms
    assert s["tpot_ms"]["mean"] == pytest.approx((20 + 50 + 100) / 3)
    assert s["tpot_ms"]["median"] == pytest.approx(50)
    assert s["itl_ms"]["mean"] == pytest.approx(1000 * (0.2 + 0.1 + 0.1) / 13)
    assert s["e2e_ms"]["p90"] == pytest.approx(300 + 0.7 * (600 - 300))  # of 150 200 300 600
    assert s["goodput"] is None


def test_goodput_share_and_rate():
    s = summarize(_records(), duration_s=2.0, slo_ttft_ms=200, slo_tpot_ms=30)
    g = s["goodput"]
    assert g["good"] == 2
    assert g["share"] == pytest.approx(2 / 5)
    assert g["rate"] == pytest.approx(1.0)
    only_ttft = summarize(_records(), duration_s=2.0, slo_ttft_ms=200)["goodput"]
    assert only_ttft["good"] == 3


# ---------------------------------------------------------------- datasets


def test_random_lengths_in_range_and_seeded():
    r = PromptRenderer(as_ids=True, vocab_size=50)
    reqs = datasets.sample_random(200, 40, 20, 0.5, seed=3, renderer=r)
    assert len(reqs) == 200
    assert all(20 <= q.prompt_len <= 40 and 10 <= q.output_len <= 20 for q in reqs)
    assert {q.prompt_len for q in reqs} == set(range(20, 41))  # the whole range is used
    assert all(len(q.prompt) == q.prompt_len and max(q.prompt) < 50 for q in reqs)
    again = datasets.sample_random(200, 40, 20, 0.5, seed=3, renderer=r)
    assert [(q.prompt, q.output_len) for q in again] == [(q.prompt, q.output_len) for q in reqs]
    other = datasets.sample_random(200, 40, 20, 0.5, seed=4, renderer=r)
    assert [q.prompt for q in other] != [q.prompt for q in reqs]
    fixed = datasets.sample_random(5, 7, 3, 1.0, seed=0, renderer=r)
    assert all(q.prompt_len == 7 and q.output_len == 3 for q in fixed)


def test_random_prompts_as_words_and_decoded_text():
    words = datasets.sample_random(10, 12, 4, 0.0, seed=1, renderer=PromptRenderer())
    assert all(isinstance(q.prompt, str) and len(q.prompt.split()) == q.prompt_len for q in words)

    class CharTokenizer:
        vocab_size = 30
        all_special_ids = [0, 1]

        def decode(self, ids):
            assert 0 not in ids and 1 not in ids
            return "".join(chr(ord("a") + i - 2) for i in ids)

        def encode(self, text):
            return [ord(c) - ord("a") + 2 for c in text]

    text = datasets.sample_random(10, 12, 4, 0.0, seed=1, renderer=PromptRenderer(CharTokenizer()))
    assert all(isinstance(q.prompt, str) and len(q.prompt) == q.prompt_len for q in text)


def test_generated_shared_prefix_groups_and_turns():
    r = PromptRenderer(as_ids=True, vocab_size=1000)
    reqs = datasets.sample_generated_shared_prefix(3, 4, 32, 8, 5, num_turns=2, seed=0, renderer=r)
    assert len(reqs) == 3 * 4 * 2
    by_session = {}
    for q in reqs:
        by_session.setdefault(q.session, []).append(q)
        assert q.output_len == 5 and q.prompt_len == len(q.prompt) == 32 + 8 * (q.turn + 1)
    assert len(by_session) == 12
    for turns in by_session.values():
        first, second = sorted(turns, key=lambda q: q.turn)
        assert second.prompt[: len(first.prompt)] == first.prompt  # later turn extends the earlier
    prefixes = {tuple(q.prompt[:32]) for q in reqs}
    assert len(prefixes) == 3  # one shared system prompt per group
    groups = [tuple(by_session[s][0].prompt[:32]) for s in sorted(by_session)]
    assert groups != sorted(groups, key=groups.index)  # shuffled: groups interleave
    same = datasets.sample_generated_shared_prefix(3, 4, 32, 8, 5, 2, seed=0, renderer=r)
    assert [q.prompt for q in same] == [q.prompt for q in reqs]
    other = datasets.sample_generated_shared_prefix(3, 4, 32, 8, 5, 2, seed=1, renderer=r)
    assert [q.prompt for q in other] != [q.prompt for q in reqs]
    words = datasets.sample_generated_shared_prefix(
        2, 2, 10, 3, 5, 3, seed=0, renderer=PromptRenderer()
    )
    for q in words:
        assert len(q.prompt.split()) == q.prompt_len


def test_sharegpt_first_human_turn_and_filters(tmp_path):
    def conv(prompt_words, reply_words):
        return {
            "conversations": [
                {"from": "human", "value": " ".join(["hi"] * prompt_words)},
                {"from": "gpt", "value": " ".join(["ok"] * reply_words)},
            ]
        }

    data = [
        conv(10, 20),
        conv(2, 20),
        conv(10, 2),
        conv(1100, 10),
        conv(900, 1200),
        conv(5, 6),
        {"conversations": [{"from": "gpt", "value": "x"}]},
        {"conversations": []},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = datasets.sample_sharegpt(str(path), 10, seed=0)
    assert sorted((q.prompt_len, q.output_len) for q in reqs) == [(5, 6), (10, 20)]
    assert len(datasets.sample_sharegpt(str(path), 1, seed=0)) == 1
    fixed = datasets.sample_sharegpt(str(path), 10, seed=0, fixed_output_len=3)
    assert sorted((q.prompt_len, q.output_len) for q in fixed) == [
        (5, 3),
        (10, 3),
        (10, 3),
        (900, 3),
    ]


# ---------------------------------------------------------------- arrivals and stream parsing


def test_poisson_arrivals_seeded():
    a = serving.poisson_arrivals(20000, 4.0, seed=7)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    assert a == serving.poisson_arrivals(20000, 4.0, seed=7)
    assert a != serving.poisson_arrivals(20000, 4.0, seed=8)
    assert np.mean(np.diff(a)) == pytest.approx(0.25, rel=0.05)
    assert serving.poisson_arrivals(5, float("inf"), seed=7) == [0.0] * 5


def test_generate_stream_cumulative_and_delta():
    cum = GenerateStream()
    assert [cum.feed({"text": t}) for t in ("a", "ab", "abc", "abc")] == [1, 1, 1, 0]
    assert cum.text.value == "abc"
    delta = GenerateStream()
    assert [delta.feed({"text": t}) for t in ("a", "b", "c")] == [1, 1, 1]
    assert delta.text.value == "abc"
    counted = GenerateStream()
    chunks = [
        {"text": "x", "meta_info": {"completion_tokens": 2, "prompt_tokens": 9}},
        {"text": "xyz", "meta_info": {"completion_tokens": 5}},
    ]
    assert [counted.feed(c) for c in chunks] == [2, 3]
    assert counted.prompt_tokens == 9
    ids = GenerateStream()
    assert [ids.feed({"output_ids": o}) for o in ([1], [1, 2, 3], [4])] == [1, 2, 1]
    with pytest.raises(StreamError, match="aborted"):
        GenerateStream().feed({"meta_info": {"finish_reason": {"type": "abort", "message": "x"}}})


# ---------------------------------------------------------------- end to end against a fake server


def _fake_app(seen: list):
    app = FastAPI()

    def sse(chunks):
        async def gen():
            for c in chunks:
                await asyncio.sleep(0.002)
                yield f"data: {json.dumps(c)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": "fake-model"}]}

    @app.post("/generate")
    async def generate(req: Request):
        body = await req.json()
        seen.append(body)
        n = body["sampling_params"]["max_new_tokens"]
        n_in = len(body["input_ids"]) if "input_ids" in body else len(body["text"].split())
        chunks = [
            {
                "text": "".join(f"t{j} " for j in range(i + 1)),
                "meta_info": {"completion_tokens": i + 1, "prompt_tokens": n_in},
            }
            for i in range(n)
        ]
        return sse(chunks) if body.get("stream") else JSONResponse(chunks[-1])

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def completions(req: Request):
        body = await req.json()
        seen.append(body)
        chat = "messages" in body
        n, n_in = (
            body["max_tokens"],
            len((body.get("prompt") or body["messages"][0]["content"]).split()),
        )
        usage = {"prompt_tokens": n_in, "completion_tokens": n}
        piece = (
            (lambda i: {"delta": {"content": f"t{i} "}}) if chat else (lambda i: {"text": f"t{i} "})
        )
        if not body.get("stream"):
            return {"choices": [piece(0)], "usage": usage}
        chunks = [{"choices": [{**piece(i), "index": 0}]} for i in range(n)]
        return sse(chunks + [{"choices": [], "usage": usage}])

    return app


@pytest.fixture(scope="module")
def fake_server():
    import uvicorn

    seen: list = []
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_fake_app(seen), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", seen
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def _expected(args_list):
    args = serving.parse_args(args_list)
    return datasets.get_dataset(args)


@pytest.mark.parametrize("backend", ["sglang", "openai", "openai-chat"])
def test_end_to_end_run(fake_server, tmp_path, backend):
    url, seen = fake_server
    out = tmp_path / "run.json"
    argv = [
        "--backend",
        backend,
        "--base-url",
        url,
        "--num-prompts",
        "6",
        "--random-input-len",
        "16",
        "--random-output-len",
        "8",
        "--random-range-ratio",
        "0.5",
        "--request-rate",
        "200",
        "--max-concurrency",
        "3",
        "--ignore-eos",
        "--seed",
        "5",
        "--slo-ttft-ms",
        "10000",
        "--disable-tqdm",
        "--output-file",
        str(out),
    ]
    seen.clear()
    assert serving.main(argv) == 0
    result = json.loads(out.read_text())
    expected = _expected(argv)
    assert len(seen) == 6 + 1  # one warm-up request
    assert all(body.get("ignore_eos") or body["sampling_params"]["ignore_eos"] for body in seen)
    if backend != "sglang":
        assert all(body["model"] == "fake-model" for body in seen)  # asked /v1/models
    recs = result["records"]
    assert len(recs) == 6
    assert [r["output_len"] for r in recs] == [q.output_len for q in expected]
    assert [r["prompt_len"] for r in recs] == [q.prompt_len for q in expected]
    for r in recs:
        assert r["success"] and r["error"] == ""
        assert len(r["itl"]) == r["output_len"] - 1
        assert 0 < r["ttft"] < r["e2e_latency"] and r["start_time"] >= 0
    s = result["summary"]
    assert (s["completed"], s["failed"]) == (6, 0)
    assert s["total_output_tokens"] == sum(q.output_len for q in expected)
    assert s["goodput"]["good"] == 6
    assert result["args"]["backend"] == backend and result["args"]["request_rate"] == 200


def test_multi_turn_and_non_streaming(fake_server, tmp_path):
    url, _ = fake_server
    out = tmp_path / "gsp.json"
    argv = [
        "--base-url",
        url,
        "--dataset-name",
        "generated-shared-prefix",
        "--gsp-num-groups",
        "2",
        "--gsp-prompts-per-group",
        "2",
        "--gsp-system-prompt-len",
        "20",
        "--gsp-question-len",
        "4",
        "--gsp-output-len",
        "3",
        "--gsp-num-turns",
        "3",
        "--warmup-requests",
        "0",
        "--disable-stream",
        "--disable-tqdm",
        "--output-file",
        str(out),
    ]
    assert serving.main(argv) == 0
    recs = json.loads(out.read_text())["records"]
    assert len(recs) == 2 * 2 * 3 and all(r["success"] and r["output_len"] == 3 for r in recs)
    by_session = {}
    for r in recs:
        by_session.setdefault(r["session"], {})[r["turn"]] = r
    for turns in by_session.values():
        for t in (1, 2):  # a turn is sent only after the previous one finished
            prev = turns[t - 1]
            assert turns[t]["start_time"] >= prev["start_time"] + prev["e2e_latency"]
            assert turns[t]["prompt_len"] == turns[t - 1]["prompt_len"] + 4


def test_all_requests_failing_returns_nonzero(tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]  # bound, never listening: connections are refused
    out = tmp_path / "fail.json"
    try:
        argv = [
            "--base-url",
            f"http://127.0.0.1:{port}",
            "--num-prompts",
            "3",
            "--random-input-len",
            "4",
            "--random-output-len",
            "2",
            "--disable-tqdm",
            "--output-file",
            str(out),
        ]
        assert serving.main(argv + ["--warmup-requests", "0"]) != 0
        recs = json.loads(out.read_text())["records"]
        assert len(recs) == 3 and not any(r["success"] for r in recs)
        assert all(r["error"] for r in recs)
        assert serving.main(argv) != 0  # the warm-up fails first
    finally:
        sock.close()


# ---------------------------------------------------------------- plot


def _result(rate, ttft, slo=None):
    recs = [
        RequestRecord(
            success=True,
            prompt_len=8,
            output_len=4,
            ttft=ttft * (1 + i / 10),
            e2e_latency=ttft + 0.3,
            itl=[0.1, 0.1, 0.1],
        )
        for i in range(10)
    ]
    summary = summarize(recs, 5.0, slo_ttft_ms=slo)
    return {
        "args": {"request_rate": rate, "backend": "sglang", "slo_ttft_ms": slo},
        "summary": summary,
        "records": [vars(r) for r in recs],
    }


def test_plot_writes_png(tmp_path):
    import matplotlib.image

    paths = []
    for i, (rate, ttft) in enumerate([(2.0, 0.05), (4.0, 0.08), (2.0, 0.04), ("inf", 0.2)]):
        path = tmp_path / f"r{i}.json"
        path.write_text(json.dumps(_result(rate, ttft, slo=100.0)))
        paths.append(str(path))
    png = tmp_path / "out.png"
    argv = ["plot", *paths, "--output", str(png), "--labels", "pd@2,pd@4,colo@2,burst"]
    assert serving.main(argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(str(png))
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100

    single = tmp_path / "single.png"
    assert serving.main(["plot", paths[0], "--output", str(single)]) == 0
    assert matplotlib.image.imread(str(single)).shape[0] < img.shape[0]  # no rate row
