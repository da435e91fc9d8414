"""Bad input gets a 4xx naming the problem (never a 500, never a hang); the server keeps serving."""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import SERVED_MODEL_NAME, SERVER_MAX_BODY_BYTES, sse_events

LONG_PROMPT = "hello " * 5000  # more tokens than the 4096-token context
MSGS = [{"role": "user", "content": "hi"}]

# (name, path, body (dict, or raw bytes), status, words the message must contain)
CASES = [
    ("malformed json", "/generate", b'{"text": "hi",', 400, ["malformed JSON"]),
    ("not an object", "/generate", b"[1, 2]", 400, ["object"]),
    ("empty body", "/generate", b"", 400, ["empty"]),
    ("missing prompt", "/generate", {"sampling_params": {}}, 400, ["text", "input_ids"]),
    ("both prompts", "/generate", {"text": "a", "input_ids": [1]}, 400, ["exactly one"]),
    ("empty text", "/generate", {"text": ""}, 400, ["empty"]),
    ("empty input_ids", "/generate", {"input_ids": []}, 400, ["empty"]),
    ("text wrong type", "/generate", {"text": 5}, 400, ["text"]),
    ("ids wrong type", "/generate", {"input_ids": ["a"]}, 400, ["input_ids"]),
    ("id out of vocab", "/generate", {"input_ids": [1, 10**9]}, 400, ["input_ids", "range"]),
    ("prompt too long", "/generate", {"text": LONG_PROMPT}, 400, ["too long", "4096"]),
    (
        "sampling not object",
        "/generate",
        {"text": "a", "sampling_params": [1]},
        400,
        ["sampling_params"],
    ),
    (
        "negative temperature",
        "/generate",
        {"text": "a", "sampling_params": {"temperature": -1}},
        400,
        ["temperature"],
    ),
    ("top_p zero", "/generate", {"text": "a", "sampling_params": {"top_p": 0}}, 400, ["top_p"]),
    (
        "max_new_tokens string",
        "/generate",
        {"text": "a", "sampling_params": {"max_new_tokens": "x"}},
        400,
        ["max_new_tokens"],
    ),
    ("n zero", "/generate", {"text": "a", "sampling_params": {"n": 0}}, 400, ["n"]),
    ("n too large", "/generate", {"text": "a", "sampling_params": {"n": 65}}, 400, ["n", "64"]),
    ("stream not bool", "/generate", {"text": "a", "stream": "yes"}, 400, ["stream"]),
    (
        "top_logprobs_num too large",
        "/generate",
        {"text": "a", "return_logprob": True, "top_logprobs_num": 21},
        400,
        ["top_logprobs_num"],
    ),
    (
        "logprob_start_len below -1",
        "/generate",
        {"text": "a", "return_logprob": True, "logprob_start_len": -2},
        400,
        ["logprob_start_len"],
    ),
    # rejected by the scheduler: its abort (status 400) becomes the HTTP status
    (
        "logprob_start_len past the prompt",
        "/generate",
        {"input_ids": [5, 6, 7], "return_logprob": True, "logprob_start_len": 3},
        400,
        ["logprob_start_len"],
    ),
    (
        "batch list length",
        "/generate",
        {"text": ["a", "b"], "sampling_params": [{}]},
        400,
        ["sampling_params"],
    ),
    (
        "negative routed_dp_rank",
        "/generate",
        {"text": "a", "routed_dp_rank": -1},
        400,
        ["routed_dp_rank"],
    ),
    (
        "bool routed_dp_rank",
        "/generate",
        {"text": "a", "routed_dp_rank": True},
        400,
        ["routed_dp_rank"],
    ),
    (
        "disagg_prefill_dp_rank string",
        "/generate",
        {"text": "a", "disagg_prefill_dp_rank": "0"},
        400,
        ["disagg_prefill_dp_rank"],
    ),
    (
        "data_parallel_rank list length",
        "/generate",
        {"text": ["a", "b"], "data_parallel_rank": [0, 1, 0]},
        400,
        ["data_parallel_rank"],
    ),
    (
        "alias disagrees",
        "/generate",
        {"text": "a", "routed_dp_rank": 0, "data_parallel_rank": 1},
        400,
        ["data_parallel_rank", "routed_dp_rank"],
    ),
    (
        "routed_dp_rank float (openai)",
        "/v1/completions",
        {"prompt": "a", "routed_dp_rank": 1.5},
        400,
        ["routed_dp_rank"],
    ),
    (
        "disagg_prefill_dp_rank negative (chat)",
        "/v1/chat/completions",
        {"messages": MSGS, "disagg_prefill_dp_rank": [-1]},
        400,
        ["disagg_prefill_dp_rank"],
    ),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "a"}, 404, ["gpt-9"]),
    ("missing prompt (openai)", "/v1/completions", {"model": SERVED_MODEL_NAME}, 400, ["prompt"]),
    ("empty prompt list", "/v1/completions", {"prompt": []}, 400, ["prompt"]),
    ("empty prompt string", "/v1/completions", {"prompt": ""}, 400, ["empty"]),
    ("prompt wrong type", "/v1/completions", {"prompt": {"a": 1}}, 400, ["prompt"]),
    (
        "max_tokens string",
        "/v1/completions",
        {"prompt": "a", "max_tokens": "many"},
        400,
        ["max_tokens"],
    ),
    (
        "negative max_tokens",
        "/v1/completions",
        {"prompt": "a", "max_tokens": -1},
        400,
        ["max_new_tokens"],
    ),
    ("stop wrong type", "/v1/completions", {"prompt": "a", "stop": 5}, 400, ["stop"]),
    ("logprobs too large", "/v1/completions", {"prompt": "a", "logprobs": 21}, 400, ["logprobs"]),
    ("n too large (openai)", "/v1/completions", {"prompt": "a", "n": 100}, 400, ["n"]),
    (
        "frequency penalty",
        "/v1/completions",
        {"prompt": "a", "frequency_penalty": 3},
        400,
        ["frequency_penalty"],
    ),
    ("prompt too long (openai)", "/v1/completions", {"prompt": LONG_PROMPT}, 400, ["too long"]),
    ("missing messages", "/v1/chat/completions", {"model": SERVED_MODEL_NAME}, 400, ["messages"]),
    ("messages not list", "/v1/chat/completions", {"messages": "hi"}, 400, ["messages"]),
    (
        "message without role",
        "/v1/chat/completions",
        {"messages": [{"content": "hi"}]},
        400,
        ["role"],
    ),
    (
        "image content",
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        },
        400,
        ["messages[0].content[0]", "takes no images"],
    ),
    (
        "top_logprobs without logprobs",
        "/v1/chat/completions",
        {"messages": MSGS, "top_logprobs": 2},
        400,
        ["logprobs"],
    ),
    (
        "top_logprobs too large",
        "/v1/chat/completions",
        {"messages": MSGS, "logprobs": True, "top_logprobs": 50},
        400,
        ["top_logprobs"],
    ),
    (
        "logprobs wrong type",
        "/v1/chat/completions",
        {"messages": MSGS, "logprobs": "yes"},
        400,
        ["logprobs"],
    ),
    (
        "unknown model (chat)",
        "/v1/chat/completions",
        {"model": "nope", "messages": MSGS},
        404,
        ["nope"],
    ),
    ("abort without rid", "/abort_request", {}, 400, ["rid"]),
    ("unknown path", "/no/such/endpoint", {}, 404, ["Not Found"]),
]


def check_error(r, status: int, words: list[str]) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and isinstance(err["type"], str)
    for word in words:
        assert word in err["message"], (word, err["message"])


@pytest.mark.parametrize("name,path,body,status,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input(live, name, path, body, status, words):
    if isinstance(body, bytes):
        r = live.http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = live.http.post(path, json=body)
    check_error(r, status, words)


def test_oversize_body_is_413(live):
    body = json.dumps({"text": "x" * (SERVER_MAX_BODY_BYTES + 10)}).encode()
    check_error(
        live.http.post("/generate", content=body, headers={"content-type": "application/json"}),
        413,
        ["exceeds"],
    )

    def chunks():  # no content-length: the limit holds while reading
        yield b'{"text": "'
        for _ in range(SERVER_MAX_BODY_BYTES // 65536 + 2):
            yield b"x" * 65536
        yield b'"}'

    check_error(
        live.http.post("/generate", content=chunks(), headers={"content-type": "application/json"}),
        413,
        ["exceeds"],
    )


def test_scheduler_error_in_a_stream_is_an_sse_error_event(live):
    body = {"input_ids": [5, 6, 7], "return_logprob": True, "logprob_start_len": 5, "stream": True}
    with live.http.stream("POST", "/generate", json=body) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert events[0]["error"]["code"] == 400
    assert "logprob_start_len" in events[0]["error"]["message"]


def test_still_serves_after_bad_input(live):
    for _, path, body, _, _ in CASES[:5]:
        live.http.post(path, content=body if isinstance(body, bytes) else json.dumps(body).encode())
    r = live.http.post(
        "/generate", json={"text": "still alive", "sampling_params": {"max_new_tokens": 3}}
    )
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3
