"""API keys end to end: a prefill/decode pair that requires one key (and shares a control-plane
secret), a router that requires another and presents the workers' key to them; clients are the
official ``openai`` client and httpx."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import SERVED_MODEL_NAME
from tests.helpers import cluster as c
from tests.helpers import localhttp

WORKER_KEY, ROUTER_KEY = "worker-key-1", "router-key-2"
MISSING = {
    "error": {
        "message": "missing API key: send it as 'Authorization: Bearer <key>'",
        "type": "invalid_request_error",
        "code": 401,
    }
}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, tiny_llama_path):
    logs = tmp_path_factory.mktemp("api_key")
    common = [
        "--max-total-tokens",
        "16384",
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--api-key",
        WORKER_KEY,
        "--disaggregation-secret",
        "pd-secret",
        "--disaggregation-bootstrap-timeout",
        "10",
        "--disaggregation-waiting-timeout",
        "10",
    ]
    P, _ = c.prefill("KP", tiny_llama_path, logs, *common)
    D = c.decode("KD", tiny_llama_path, logs, *common)
    procs = [P, D]
    for s in procs:  # what the tests' own checks (wait_idle) send
        s.http.headers["Authorization"] = f"Bearer {WORKER_KEY}"
    try:
        c.start_all((P, D))  # /health needs no key
        R = c.router(
            "KR",
            [P],
            [D],
            logs,
            "--api-key",
            ROUTER_KEY,
            "--worker-api-key",
            WORKER_KEY,
            "--policy",
            "least_load",
        )  # least_load: the router polls /get_load with the key
        procs.append(R.start())
        yield {"prefill": P, "decode": D, "router": R}
    finally:
        c.stop_all(reversed(procs))


def test_server_requires_its_key(keyed):
    server = keyed["decode"]
    h = localhttp.Client(base_url=server.url, timeout=30)
    for path in ("/v1/models", "/get_load", "/server_info", "/debug/integrity"):
        r = h.get(path)
        assert r.status_code == 401 and r.json() == MISSING, (path, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
    r = h.get("/v1/models", headers={"Authorization": f"Bearer {ROUTER_KEY}"})
    assert r.status_code == 401 and r.json()["error"]["message"] == "incorrect API key provided"
    r = h.get("/v1/models", headers={"Authorization": f"Basic {WORKER_KEY}"})  # not a bearer token
    assert r.status_code == 401
    r = h.post("/generate", json={"text": "hi"})
    assert r.status_code == 401  # refused before the body is looked at
    assert h.get("/health").status_code == 200 and h.get("/metrics").status_code == 200
    r = h.get("/server_info", headers={"Authorization": f"Bearer {WORKER_KEY}"})
    assert r.status_code == 200
    assert r.json()["api_key"] == "***" and r.json()["disaggregation_secret"] == "***"


def test_openai_client_with_and_without_the_key(keyed):
    base = keyed["router"].url + "/v1"
    with pytest.raises(openai.AuthenticationError) as err:
        openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
    assert err.value.status_code == 401
    assert err.value.body == {
        "message": "incorrect API key provided",
        "type": "invalid_request_error",
        "code": 401,
    }
    with pytest.raises(openai.AuthenticationError):  # the router's key is not the workers'
        openai.OpenAI(
            base_url=keyed["decode"].url + "/v1", api_key=ROUTER_KEY, max_retries=0
        ).models.list()

    client = openai.OpenAI(base_url=base, api_key=ROUTER_KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [SERVED_MODEL_NAME]
    out = client.completions.create(
        model=SERVED_MODEL_NAME,
        prompt="Hello",
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.usage.completion_tokens == 4
    chat = client.chat.completions.create(
        model=SERVED_MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert sum(len(ch.choices[0].delta.content or "") > 0 for ch in chat if ch.choices) >= 1
    for s in (keyed["prefill"], keyed["decode"]):
        s.wait_idle()


def test_router_passes_the_worker_key_to_every_call(keyed):
    h = localhttp.Client(
        base_url=keyed["router"].url, timeout=60, headers={"Authorization": f"Bearer {ROUTER_KEY}"}
    )
    assert h.get("/health").status_code == 200  # its health checks pass
    r = h.post(
        "/generate",
        json={"text": "hi", "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}},
    )
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2  # both legs
    loads = h.get("/get_load").json()  # fan-out
    assert all(
        "load" in w and "error" not in w for role in ("prefill", "decode") for w in loads[role]
    ), loads
    info = h.get("/server_info").json()
    assert all("server_info" in w for role in ("prefill", "decode") for w in info[role]), info
    assert info["router"]["api_key"] == "***"
    for s in (keyed["prefill"], keyed["decode"]):
        s.wait_idle()
