"""Hostile input through both front ends (a colocated server, and the PD router over a real
prefill/decode pair): each case is a 4xx naming the field, nothing is left behind, and a
Hypothesis property test finds no body that gets a 5xx, hangs, or leaks request state."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.e2e.conftest import SERVED_MODEL_NAME
from tests.helpers import cluster as c
from tests.helpers import localhttp

PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
MSGS = [{"role": "user", "content": "hi"}]
REQUEST_TIMEOUT_S = 60.0  # far above any answer here: a request that takes this long hangs


class Front:
    """A front end and the servers behind it whose state must end clean."""

    def __init__(self, name: str, url: str, servers: list):
        self.name, self.url, self.servers = name, url, servers
        self.http = localhttp.Client(base_url=url, timeout=REQUEST_TIMEOUT_S)

    def post(self, path: str, body) -> httpx.Response:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self.http.post(path, content=raw, headers={"content-type": "application/json"})

    def assert_clean(self) -> None:
        assert self.http.get("/health").status_code == 200
        for s in self.servers:
            s.wait_idle()  # nothing running, no page or slot held, no front-end request state


@pytest.fixture(scope="module")
def pd_router(tmp_path_factory, tiny_llama_path):
    logs = tmp_path_factory.mktemp("hostile")
    common = [
        "--max-total-tokens",
        "16384",
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--disaggregation-bootstrap-timeout",
        "10",
        "--disaggregation-waiting-timeout",
        "10",
    ]
    P, _ = c.prefill("HP", tiny_llama_path, logs, *common)
    D = c.decode("HD", tiny_llama_path, logs, *common)
    procs = [P, D]
    try:
        c.start_all((P, D))
        R = c.router("HR", [P], [D], logs)
        procs.append(R.start())
        yield Front("router", R.url, [P, D])
    finally:
        c.stop_all(reversed(procs))


@pytest.fixture(scope="module", params=["server", "router"])
def front(request, server):
    if request.param == "server":
        return Front("server", server.url, [server])
    return request.getfixturevalue("pd_router")


def nested(depth: int) -> bytes:
    return b'{"text": "a", "sampling_params": ' + b"[" * depth + b"]" * depth + b"}"


# (name, path, body, words the message must contain)
CASES = [
    (
        "seed 2**70",
        "/generate",
        {"text": "a", "sampling_params": {"seed": 2**70, "max_new_tokens": 2}},
        ["seed"],
    ),
    (
        "seed 2**70 (completions)",
        "/v1/completions",
        {"prompt": "a", "seed": 2**70, "max_tokens": 2},
        ["seed"],
    ),
    (
        "seed 2**70 (chat)",
        "/v1/chat/completions",
        {"messages": MSGS, "seed": 2**70, "max_tokens": 2},
        ["seed"],
    ),
    (
        "seed 2**63 (past the router, not the server)",
        "/v1/completions",
        {"prompt": "a", "seed": 2**63},
        ["seed"],
    ),
    (
        "seed below int64",
        "/generate",
        {"text": "a", "sampling_params": {"seed": -(2**63) - 1}},
        ["seed"],
    ),
    (
        "max_new_tokens 2**64",
        "/generate",
        {"text": "a", "sampling_params": {"max_new_tokens": 2**64 - 1}},
        ["max_new_tokens"],
    ),
    (
        "stop_token_ids 2**63",
        "/generate",
        {"text": "a", "sampling_params": {"stop_token_ids": [2**63]}},
        ["stop_token_ids"],
    ),
    (
        "temperature as a huge int",  # past float32 (the sampler's dtype)
        "/generate",
        {"text": "a", "sampling_params": {"temperature": 10**39}},
        ["temperature"],
    ),
    (
        "logprob_start_len 2**63",
        "/generate",
        {"text": "a", "return_logprob": True, "logprob_start_len": 2**63},
        ["logprob_start_len"],
    ),
    ("nested 5000 deep", "/generate", nested(5000), ["nested too deeply"]),
    (
        "nested 5000 deep (chat)",
        "/v1/chat/completions",
        b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        ["nested too deeply"],
    ),
    ("n 0", "/generate", {"text": "a", "sampling_params": {"n": 0}}, ["n: must be >= 1"]),
    ("n 0 (completions)", "/v1/completions", {"prompt": "a", "n": 0}, ["n: must be >= 1"]),
    ("n 0 (chat)", "/v1/chat/completions", {"messages": MSGS, "n": 0}, ["n: must be >= 1"]),
    ("n 2**70 (chat)", "/v1/chat/completions", {"messages": MSGS, "n": 2**70}, ["n"]),
    ("lone surrogate in text", "/generate", b'{"text": "\\ud800 hi"}', ["text", "surrogate"]),
    (
        "lone surrogate in a message",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
        ["messages[0].content", "surrogate"],
    ),
    ("number beyond a float", "/v1/completions", b'{"prompt": "a", "top_p": 1e400}', ["top_p"]),
]


@pytest.mark.parametrize("name,path,body,words", CASES, ids=[case[0] for case in CASES])
def test_hostile_input_is_a_400_naming_the_field(front, name, path, body, words):
    r = front.post(path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "invalid_request_error"
    for word in words:
        assert word in err["message"], (word, err["message"])
    assert (
        "Traceback" not in r.text and "Error(" not in err["message"]
    )  # nothing of the internals leaks
    front.assert_clean()


def test_still_serves_after_hostile_input(front):
    for _, path, body, _ in CASES:
        front.post(path, body)
    r = front.post(
        "/generate",
        {"text": "still here", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}},
    )
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 3
    front.assert_clean()


# ---------------------------------------------------------------------------------- property
HUGE_INTS = st.sampled_from(
    [2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70, -(2**63) - 1]
)
INTS = st.one_of(st.integers(-3, 70), HUGE_INTS)
FLOATS = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, -0.0, 5e-324, 1e-300, 1e308, 0.5]),
)
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, st.text(max_size=6))
JUNK = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=3),
    st.dictionaries(st.text(max_size=4), SCALARS, max_size=2),
)
# invalid values only for fields whose valid values can be slow (a large max_tokens, n)
BAD_COUNTS = st.one_of(
    st.sampled_from([-1, "2", 1.5, True, [1], {}]), HUGE_INTS.filter(lambda v: v > 64 or v < 0)
)
TEXT = st.text(max_size=24)
PROMPT = st.text(min_size=1, max_size=24)
IDS = st.lists(st.integers(0, 49151), max_size=12)


@st.composite
def _either(draw, good, bad, odds: int):
    # Hypothesis leans to small integers, so a draw of the top value is the rarer branch.
    return draw(bad if draw(st.integers(0, odds)) == odds else good)


def _sometimes_junk(good):
    """Mostly a plausible value, now and then a value of any type or size."""
    return _either(good, JUNK, 7)


SAMPLING = {
    "temperature": _sometimes_junk(st.floats(0, 2)),
    "top_p": _sometimes_junk(st.floats(0.01, 1)),
    "top_k": _sometimes_junk(st.sampled_from([-1, 1, 3, 50])),
    "min_p": _sometimes_junk(st.floats(0, 1)),
    "presence_penalty": _sometimes_junk(st.floats(-2, 2)),
    "frequency_penalty": _sometimes_junk(st.floats(-2, 2)),
    "repetition_penalty": _sometimes_junk(st.floats(0.5, 2)),
    "seed": _sometimes_junk(INTS),
    "stop": _sometimes_junk(st.one_of(TEXT, st.lists(TEXT, max_size=3))),
    "stop_token_ids": _sometimes_junk(st.lists(INTS, max_size=3)),
    "ignore_eos": _sometimes_junk(st.booleans()),
    "skip_special_tokens": _sometimes_junk(st.booleans()),
    "min_tokens": _sometimes_junk(st.integers(0, 3)),
}


@st.composite
def some_of(draw, fields: dict) -> dict:
    names = draw(st.lists(st.sampled_from(sorted(fields)), unique=True, max_size=len(fields)))
    return {name: draw(fields[name]) for name in names}


def _count(good):
    return _either(good, BAD_COUNTS, 5)


@st.composite
def bodies(draw) -> tuple[str, dict]:
    path = draw(st.sampled_from(PATHS))
    extra = draw(st.dictionaries(st.text(max_size=6), JUNK, max_size=2))  # unknown fields
    common = {
        "stream": _sometimes_junk(st.booleans()),
        "rid": _sometimes_junk(TEXT),
        "bootstrap_room": _sometimes_junk(INTS),
        "routed_dp_rank": _sometimes_junk(st.sampled_from([0, 1])),
    }
    if path == "/generate":
        sampling = draw(some_of({**SAMPLING, "n": _count(st.integers(1, 3))}))
        sampling["max_new_tokens"] = draw(_count(st.integers(0, 4)))
        if "min_tokens" in sampling:
            sampling["min_new_tokens"] = sampling.pop("min_tokens")
        texts = st.one_of(PROMPT, st.lists(PROMPT, min_size=1, max_size=3))
        ids = st.one_of(IDS, st.lists(IDS, min_size=1, max_size=3))
        prompt = draw(
            st.one_of(
                st.fixed_dictionaries({"text": _sometimes_junk(texts)}),
                st.fixed_dictionaries({"input_ids": _sometimes_junk(ids)}),
            )
        )
        body = {
            **prompt,
            "sampling_params": draw(_sometimes_junk(st.just(sampling))),
            **draw(
                some_of(
                    {
                        **common,
                        "return_logprob": _sometimes_junk(st.booleans()),
                        "logprob_start_len": _sometimes_junk(st.integers(-1, 3)),
                        "top_logprobs_num": _sometimes_junk(st.integers(0, 3)),
                    }
                )
            ),
        }
    else:
        body = draw(
            some_of(
                {
                    **SAMPLING,
                    **common,
                    "model": _sometimes_junk(st.just(SERVED_MODEL_NAME)),
                    "n": _count(st.integers(1, 3)),
                    "stream_options": _sometimes_junk(
                        st.fixed_dictionaries({"include_usage": st.booleans()})
                    ),
                }
            )
        )
        body["max_tokens"] = draw(_count(st.integers(0, 4)))
        if path == "/v1/completions":
            body["prompt"] = draw(
                _sometimes_junk(st.one_of(PROMPT, st.lists(PROMPT, min_size=1, max_size=3), IDS))
            )
            body.update(
                draw(
                    some_of(
                        {
                            "echo": _sometimes_junk(st.booleans()),
                            "logprobs": _sometimes_junk(st.integers(0, 3)),
                        }
                    )
                )
            )
        else:
            message = st.fixed_dictionaries(
                {
                    "role": _sometimes_junk(st.sampled_from(["user", "system"])),
                    "content": _sometimes_junk(PROMPT),
                }
            )
            body["messages"] = draw(_sometimes_junk(st.lists(message, min_size=1, max_size=3)))
            body.update(
                draw(
                    some_of(
                        {
                            "logprobs": _sometimes_junk(st.booleans()),
                            "top_logprobs": _sometimes_junk(st.integers(0, 3)),
                        }
                    )
                )
            )
    return path, {**extra, **body}


def server_errors(r: httpx.Response) -> list:
    """5xx answers, including error events in a stream that started with 200."""
    if r.status_code >= 500:
        return [r.status_code, r.text]
    if not r.headers.get("content-type", "").startswith("text/event-stream"):
        return []
    events = [
        json.loads(line[6:])
        for line in r.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    return [
        e for e in events if isinstance(e, dict) and int(e.get("error", {}).get("code", 0)) >= 500
    ]


def test_no_request_body_gets_a_server_error_or_leaks(front):
    @settings(
        max_examples=60,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(bodies())
    def check(case):
        path, body = case
        r = front.post(path, body)  # a hang is a ReadTimeout here
        event(f"{path} -> {r.status_code}")  # pytest --hypothesis-show-statistics shows the mix
        assert not server_errors(r), (path, body, r.status_code, r.text[:500])
        assert r.status_code < 300 or "error" in r.json(), r.text[:500]

    check()
    front.assert_clean()
