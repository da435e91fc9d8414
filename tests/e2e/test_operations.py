"""Operations, on the cluster ``pdserve launch`` starts with the demo model (1 prefill + 1 decode +
router): the README's first example as written, the handoff timeline of a PD request and its
histograms on every process, and the Grafana dashboard's metrics."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.models.demo import DEMO_MODELS
from tests.e2e.conftest import SERVED_MODEL_NAME, sse_events
from tests.helpers import localhttp
from tests.helpers.cluster import free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
TIMELINE = {"X-PDServe-Timeline": "1"}
SAMPLING = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}

# events of a PD request in causal order: each happens after the one before it
CHAIN = [
    "router_received",
    "router_dispatched",
    "prefill_received",
    "prefill_queued",
    "prefill_bootstrapped",
    "prefill_forward_start",
    "prefill_forward_end",
    "decode_kv_received",
    "decode_first_token",
    "decode_finished",
]
DECODE_SIDE = [
    "router_dispatched",
    "decode_received",
    "decode_queued",
    "decode_preallocated",
    "prefill_bootstrapped",
]
PREFILL_END = ["prefill_forward_end", "prefill_kv_sent", "prefill_finished"]
SERVER_STAGES = {
    "prefill": [
        "to_scheduler",
        "prefill_bootstrap",
        "prefill_waiting",
        "prefill_forward",
        "prefill_transfer",
    ],
    "decode": [
        "to_scheduler",
        "decode_prealloc",
        "decode_transfer",
        "decode_first_token",
        "decode_generate",
    ],
}
ROUTER_STAGES = ["router_dispatch", "router_first_byte", "router_last_byte"]


class Launched:
    def __init__(self, router: str, prefill: str, decode: str):
        self.router = localhttp.Client(base_url=router, timeout=120)
        self.servers = {
            "prefill": localhttp.Client(base_url=prefill, timeout=60),
            "decode": localhttp.Client(base_url=decode, timeout=60),
        }


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("launch") / "launch.log"
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdserve.cli",
                "launch",
                "--port",
                str(port),
                "--torch-num-threads",
                "1",
                "--max-total-tokens",
                "8192",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def ready() -> bool:
        assert proc.poll() is None, log_path.read_text(errors="replace")[-4000:]
        return b"pdserve cluster ready" in log_path.read_bytes()

    try:
        wait_for(ready, 600, "the launched cluster to be ready", interval=0.5)
        router = f"http://127.0.0.1:{port}"
        info = localhttp.get(router + "/server_info", timeout=30).json()
        cluster = Launched(router, info["prefill"][0]["url"], info["decode"][0]["url"])
        cluster.server_info = info
        yield cluster
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def readme_first_curl() -> tuple[str, dict]:
    """(path, JSON body) of the README's first curl command."""
    text = (ROOT / "README.md").read_text()
    command = re.search(r"^curl .*?(?<!\\)$", text, flags=re.M | re.S).group(0).replace("\\\n", " ")
    words = shlex.split(command)
    url = next(w for w in words if "localhost:8000" in w)
    return url.split("localhost:8000", 1)[1], json.loads(words[words.index("-d") + 1])


def test_readme_first_example_and_served_name(launched):
    path, body = readme_first_curl()
    r = launched.router.post(path, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == DEMO_MODELS[0]
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
    # every server `pdserve launch` started serves the demo model under its short name
    for role in ("prefill", "decode"):
        (entry,) = launched.server_info[role]
        assert entry["server_info"]["served_model_name"] == DEMO_MODELS[0]
    assert [m["id"] for m in launched.router.get("/v1/models").json()["data"]] == [DEMO_MODELS[0]]
    r = launched.router.post(path, json={**body, "model": "x"})
    assert r.status_code == 404 and DEMO_MODELS[0] in r.json()["error"]["message"]


def scrape(client: httpx.Client) -> dict[tuple[str, str], float]:
    """(sample name, stage label) -> value of every sample with a ``stage`` label."""
    text = client.get("/metrics").text
    return {
        (s.name, s.labels["stage"]): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if "stage" in s.labels
    }


def assert_causal(events: dict[str, float]) -> None:
    for chain in (CHAIN, DECODE_SIDE, PREFILL_END):
        missing = [e for e in chain if e not in events]
        assert not missing, f"missing {missing} in {events}"
        times = [events[e] for e in chain]
        assert times == sorted(times), f"not in causal order: {list(zip(chain, times))}"
    assert list(events.values()) == sorted(events.values())  # the answer lists them in time order


def test_timeline_through_the_router_and_stage_histograms(launched):
    before = {role: scrape(c) for role, c in launched.servers.items()}
    router_before = scrape(launched.router)
    prompt = {"text": "The handoff timeline of one request", "sampling_params": SAMPLING}

    r = launched.router.post("/generate", json=prompt, headers=TIMELINE)
    assert r.status_code == 200, r.text
    assert_causal(r.json()["meta_info"]["timeline"])
    assert "timeline" not in launched.router.post("/generate", json=prompt).json()["meta_info"]

    with launched.router.stream(
        "POST", "/generate", json={**prompt, "stream": True}, headers=TIMELINE
    ) as r:
        events = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    assert "timeline" not in events[0]["meta_info"]  # only the finished output carries it
    assert_causal(events[-1]["meta_info"]["timeline"])

    chat = {
        "model": DEMO_MODELS[0],
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
    }
    r = launched.router.post("/v1/chat/completions", json=chat, headers=TIMELINE)
    assert r.status_code == 200, r.text
    assert_causal(r.json()["choices"][0]["timeline"])

    requests = 4  # with the one without the header
    for role, client in launched.servers.items():
        after = scrape(client)
        for stage in SERVER_STAGES[role]:
            key = ("pdserve:per_stage_req_latency_seconds_count", stage)
            assert after.get(key, 0) - before[role].get(key, 0) == requests, (role, stage)

    def router_counted() -> bool:
        after = scrape(launched.router)
        return all(
            after.get(("pdserve_router_per_stage_req_latency_seconds_count", s), 0)
            - router_before.get(("pdserve_router_per_stage_req_latency_seconds_count", s), 0)
            == requests
            for s in ROUTER_STAGES
        )

    wait_for(router_counted, 10, "the router's stage histograms to count every request")


def exported_names(client: httpx.Client) -> set[str]:
    """Every metric name a ``/metrics`` page declares (# TYPE) or has samples of."""
    names: set[str] = set()
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            suffixes = ("_bucket", "_sum", "_count") if kind == "histogram" else ("",)
            names.update(name + s for s in suffixes)
        elif line and not line.startswith("#"):
            names.add(re.match(r"[^{ ]+", line).group(0))
    return names


def test_dashboard_names_only_exported_metrics(launched):
    dashboard = json.loads((ROOT / "docs" / "grafana" / "pdserve.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    named = {m for e in exprs for m in re.findall(r"\bpdserve[:_][A-Za-z0-9_:]*", e)}
    launched.router.post(
        "/generate", json={"text": "fill the metrics", "sampling_params": SAMPLING}
    )
    exported = exported_names(launched.router).union(
        *(exported_names(c) for c in launched.servers.values())
    )
    assert not named - exported, (
        f"the dashboard names metrics nobody exports: {sorted(named - exported)}"
    )
    # and it covers what operators look at
    for needle in (
        "time_to_first_token",
        "inter_token_latency",
        "num_waiting_reqs",
        "kv_pages_used",
        "kv_transfer_bytes",
        "per_stage_req_latency",
        "router_worker_circuit_open",
        "upstream_latency",
    ):
        assert any(needle in m for m in named), needle


def test_timeline_of_a_colocated_server(live):
    """A colocated server (no router): its own events, and the histograms of its stages."""
    before = scrape(live.http)
    body = {"model": SERVED_MODEL_NAME, "prompt": "a colocated request", "max_tokens": 3, "n": 2}
    r = live.http.post("/v1/completions", json=body, headers=TIMELINE)
    assert r.status_code == 200, r.text
    chain = [
        "server_received",
        "server_queued",
        "server_forward_start",
        "server_first_token",
        "server_finished",
    ]
    for choice in r.json()["choices"]:
        events = choice["timeline"]
        assert list(events) == chain, events
        assert list(events.values()) == sorted(events.values())
    after = scrape(live.http)
    for stage in ("to_scheduler", "waiting", "prefill_forward", "decode_generate"):
        key = ("pdserve:per_stage_req_latency_seconds_count", stage)
        assert after[key] - before.get(key, 0) == 2, stage
