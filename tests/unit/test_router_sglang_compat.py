"""Our router and the reference Rust sglang-router, side by side in front of the same fake workers:
the bootstrap fields they add must have the same shape, and merged stream output must agree."""

from __future__ import annotations

import json

import pytest

from pdserve.router.app import create_app
from pdserve.router.args import RouterArgs
from tests.helpers import localhttp
from tests.helpers.fake_workers import AppServer, FakeCluster, free_port, wait_until
from tests.helpers.sglang_router import sglang_router_available, start_sglang_router

pytestmark = pytest.mark.skipif(
    not sglang_router_available(), reason="sglang-router is not installed"
)

CASES = [
    ("/generate", {"text": "hello world", "sampling_params": {"max_new_tokens": 2}}),
    ("/generate", {"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": {"max_new_tokens": 2}}),
    ("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 2, "n": 2}}),
    ("/v1/completions", {"model": "m", "prompt": ["a", "b"], "max_tokens": 2}),
    ("/v1/completions", {"model": "m", "prompt": "a", "max_tokens": 2, "n": 2}),
    (
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    ),
    (
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2},
    ),
]


@pytest.fixture(scope="module")
def routers():
    cluster = FakeCluster()
    p, d = cluster.add("prefill"), cluster.add("decode")
    ours = AppServer(
        create_app(RouterArgs(prefill=[(p.url, p.bootstrap_port)], decode=[d.url])), lifespan="on"
    )
    ref = start_sglang_router([(p.url, p.bootstrap_port)], [d.url], free_port())
    try:
        wait_until(
            lambda: localhttp.get(ours.url + "/health").status_code == 200, what="our router ready"
        )
        yield p, d, ours.url, f"http://127.0.0.1:{ref.args[ref.args.index('--port') + 1]}"
    finally:
        ref.terminate()
        ref.wait(timeout=15)
        ours.stop()
        cluster.close()


def bootstrap_shape(body: dict) -> dict:
    def shape(v):
        if not isinstance(v, list):
            return type(v).__name__
        return "list", len(v), len(set(v)) if v and isinstance(v[0], int) else None

    return {k: shape(body[k]) for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room")}


@pytest.mark.parametrize("path,body", CASES)
def test_bootstrap_fields_match_reference_router(routers, path, body):
    p, d, ours, ref = routers
    seen = []
    for base in (ours, ref):
        before = len(d.generation_requests())
        assert localhttp.post(base + path, json=body, timeout=30).status_code == 200
        seen.append(d.generation_requests()[before:][-1].json)
    mine, theirs = seen
    assert bootstrap_shape(mine) == bootstrap_shape(theirs)
    for key in ("bootstrap_host", "bootstrap_port"):
        assert mine[key] == theirs[key]


def test_stream_logprob_merge_matches_reference_router(routers):
    _, _, ours, ref = routers
    body = {
        "text": "one two three",
        "sampling_params": {"max_new_tokens": 3},
        "return_logprob": True,
        "stream": True,
    }
    outputs = []
    for base in (ours, ref):
        raw = localhttp.post(base + "/generate", json=body, timeout=30).content.decode()
        outputs.append(
            [
                json.loads(line[6:]) if line[6:] != "[DONE]" else line[6:]
                for line in raw.split("\n")
                if line.startswith("data: ")
            ]
        )
    mine, theirs = outputs
    assert len(mine) == len(theirs) == 4 and mine[-1] == theirs[-1] == "[DONE]"
    # The reference merges only the first event of each network read (the fake decode writes
    # several events per write); ours merges every event, so compare the first one in full.
    assert mine[0] == theirs[0]
    assert all(e["meta_info"]["input_token_logprobs"][0] == [-1.0, 100, None] for e in mine[:-1])
