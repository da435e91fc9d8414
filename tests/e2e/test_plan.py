"""``pdserve plan`` against real running servers: the PD servers of the membership tests behind a
router of their own, and the session's colocated server."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve.plan import profile as prof_mod
from tests.helpers import localhttp

WORKLOAD = [
    "--request-rate",
    "2",
    "--input-len",
    "32-96",
    "--output-len",
    "16",
    "--slo-ttft-ms",
    "2000",
    "--slo-tpot-ms",
    "300",
    "--num-requests",
    "60",
    "--budget",
    "2",
]


def plan(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "plan", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def pd_router(elastic_servers):
    s = elastic_servers
    router = s.router("plan-router", s.prefills[:1], s.decodes[:1]).start()
    try:
        yield router, s.prefills[0], s.decodes[0]
    finally:
        router.stop()


def test_plan_reads_a_pd_cluster_through_its_router(pd_router, tmp_path):
    router, prefill, decode = pd_router
    saved = tmp_path / "cal.json"
    out = plan(
        "--router",
        router.url,
        *WORKLOAD,
        "--no-max-rate",
        "--json",
        "--save-calibration",
        str(saved),
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert {c["split"] for c in data["candidates"]} == {"2 colocated", "1P1D"}
    assert data["recommended"]["split"] in {"2 colocated", "1P1D"}
    assert all(
        c["goodput"] >= 0 and c["ttft_ms"]["p50"] > 0 and c["tpot_ms"]["p50"] > 0
        for c in data["candidates"]
    )

    # the figures are the servers' own: prefill's start-up calibration, decode's KV size and pool
    p_info = localhttp.get(prefill.url + "/server_info", timeout=10).json()
    d_info = localhttp.get(decode.url + "/server_info", timeout=10).json()
    prof = prof_mod.load(saved)
    assert prof.measured["calibration"] == p_info["calibration"]
    assert prefill.url in prof.sources["prefill"] and decode.url in prof.sources["decode"]
    assert prof.kv_bytes_per_token == d_info["scheduler_info"]["kv_bytes_per_token"]
    assert prof.max_total_tokens == d_info["scheduler_info"]["max_total_tokens"]
    # the probe measured decode steps at three batch sizes and one longer context
    points = prof.measured["probe"]["decode"]
    assert [b for b, _, _ in points][:3] == [1, 8, 32] and all(s > 0 for _, _, s in points)
    assert prof.decode.step_s(8, 800) >= prof.decode.step_s(1, 100) > 0

    # the same calibration, read back from the file, gives the same plan
    again = plan("--calibration", str(saved), *WORKLOAD, "--no-max-rate", "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["candidates"] == data["candidates"]
    decode.wait_idle()


def test_plan_from_a_colocated_server_prints_a_table(server):
    out = plan("--server", server.url, *WORKLOAD, "--probe-batches", "1,4")
    assert out.returncode == 0, out.stderr
    assert (
        "recommended: " in out.stdout and "| 1P1D" in out.stdout and "| 2 colocated" in out.stdout
    )
    assert f"{server.url} probe" not in out.stdout  # sources are in --json, the table stays short
    server.wait_idle()


def test_plan_names_a_server_given_in_the_wrong_role(server):
    out = plan("--prefill", server.url, *WORKLOAD)
    assert out.returncode == 2
    assert f"{server.url} was given as prefill but is a colocated server" in out.stderr
    out = plan("--router", server.url, *WORKLOAD)
    assert out.returncode == 2 and f"{server.url}/workers answered 404" in out.stderr
