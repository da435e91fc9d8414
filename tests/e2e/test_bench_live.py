"""``pdserve bench`` end to end against the live tiny-model server: the result JSON accounts for
every request sent, outputs have exactly the asked length under --ignore-eos, and ``bench plot``
writes a PNG."""

from __future__ import annotations

import json

import pytest

from pdserve.bench import serving
from tests.e2e.conftest import SERVED_MODEL_NAME

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
NUM_PROMPTS = 8
INPUT_LEN = 24
OUTPUT_LEN = 6


def run_bench(url: str, out_path, backend: str, *extra: str) -> dict:
    argv = [
        "--backend",
        backend,
        "--base-url",
        url,
        "--num-prompts",
        str(NUM_PROMPTS),
        "--random-input-len",
        str(INPUT_LEN),
        "--random-output-len",
        str(OUTPUT_LEN),
        "--random-range-ratio",
        "1",
        "--ignore-eos",
        "--disable-tqdm",
        "--output-file",
        str(out_path),
        *extra,
    ]
    assert serving.main(argv) == 0
    return json.loads(out_path.read_text())


@pytest.mark.parametrize("backend", ["sglang", "openai"])
def test_bench_counts_match_requests(live, tmp_path, backend):
    result = run_bench(
        live.url,
        tmp_path / f"{backend}.json",
        backend,
        "--request-rate",
        "40",
        "--max-concurrency",
        "4",
        "--slo-ttft-ms",
        "1e9",
        "--slo-tpot-ms",
        "1e9",
    )
    s = result["summary"]
    assert result["args"]["model"] == SERVED_MODEL_NAME
    assert (s["completed"], s["failed"]) == (NUM_PROMPTS, 0)
    records = result["records"]
    assert len(records) == NUM_PROMPTS
    assert all(r["success"] and r["error"] == "" for r in records)
    # --ignore-eos with --random-range-ratio 1: every request generates exactly OUTPUT_LEN tokens.
    assert [r["output_len"] for r in records] == [OUTPUT_LEN] * NUM_PROMPTS
    assert s["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert s["total_input_tokens"] == sum(r["prompt_len"] for r in records)
    if backend == "sglang":  # token ids are sent as they are: the prompt length is exact
        assert [r["prompt_len"] for r in records] == [INPUT_LEN] * NUM_PROMPTS
    else:  # one common word per id; the server's usage gives the token count
        assert all(r["prompt_len"] >= INPUT_LEN for r in records)
    # Streamed: at most one gap per token after the first (tokens that share the first chunk
    # add none; an OpenAI chunk whose token decodes to no text adds none), within first -> last.
    for r in records:
        assert len(r["itl"]) <= OUTPUT_LEN - 1
        assert sum(r["itl"]) <= r["e2e_latency"] - r["ttft"] + 1e-6
    assert all(0 < r["ttft"] <= r["e2e_latency"] for r in records)
    assert sorted(r["session"] for r in records) == list(range(NUM_PROMPTS))
    assert s["goodput"]["good"] == NUM_PROMPTS
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert s[key]["mean"] > 0


def test_bench_non_streaming_and_plot(live, tmp_path):
    first = run_bench(live.url, tmp_path / "a@20.json", "sglang", "--request-rate", "20")
    second = run_bench(
        live.url, tmp_path / "a@inf.json", "openai", "--disable-stream", "--max-concurrency", "8"
    )
    for result in (first, second):
        assert result["summary"]["completed"] == NUM_PROMPTS
        assert result["summary"]["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    # Non-streamed answers come in one piece: no inter-token gaps.
    assert all(r["itl"] == [] for r in second["records"])

    png = tmp_path / "runs.png"
    assert (
        serving.main(
            [
                "plot",
                str(tmp_path / "a@20.json"),
                str(tmp_path / "a@inf.json"),
                "--output",
                str(png),
            ]
        )
        == 0
    )
    data = png.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 1000


@pytest.mark.parametrize("backend", ["sglang", "openai"])
def test_multi_turn_sessions_resend_the_conversation(live, tmp_path, backend):
    """Each turn sends the conversation so far (with the server's real answers) plus a new
    message: prompts grow turn by turn, and the server reuses the cached prefix."""

    def cache_hits() -> int:
        return live.http.get("/server_info").json()["internal_states"][0]["cache_hit_tokens"]

    before = cache_hits()
    out = tmp_path / "mt.json"
    argv = [
        "--backend",
        backend,
        "--base-url",
        live.url,
        "--dataset-name",
        "multi-turn",
        "--mt-num-sessions",
        "3",
        "--mt-num-turns",
        "3",
        "--mt-system-len",
        "40",
        "--mt-user-len",
        "12",
        "--mt-output-len",
        "5",
        "--mt-think-time",
        "0.05",
        "--random-range-ratio",
        "1",
        "--ignore-eos",
        "--disable-tqdm",
        "--max-concurrency",
        "2",
        "--output-file",
        str(out),
        "--seed",
        "7" if backend == "sglang" else "8",
    ]
    assert serving.main(argv) == 0
    result = json.loads(out.read_text())
    assert (result["summary"]["completed"], result["summary"]["failed"]) == (9, 0)
    by_session: dict = {}
    for r in result["records"]:
        by_session.setdefault(r["session"], []).append(r)
    for turns in by_session.values():
        turns.sort(key=lambda r: r["turn"])
        lens = [r["prompt_len"] for r in turns]
        # turn t+1 = turn t's prompt + its answer (5 tokens) + a new message (12)
        assert all(b >= a + 5 + 12 - 2 for a, b in zip(lens, lens[1:])), lens
    assert cache_hits() - before >= 3 * 2 * 40  # later turns hit at least the system prompt
