"""Secure defaults: exposing PD endpoints beyond loopback without a secret (warning, or refusal
with --disaggregation-require-secret), and signed bootstrap look-ups."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from pdserve.config import ServerArgs, is_loopback
from pdserve.disagg.bootstrap import (
    AUTH_HEADER,
    TIME_HEADER,
    BootstrapError,
    BootstrapServer,
    fetch_prefill_info,
    fetch_rank_info,
    register_rank,
    registration_tag,
)
from tests.unit.test_disagg_bootstrap import rank_info

SECRET = "s3cret"
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def args(**kw) -> ServerArgs:
    return ServerArgs(model_path="unused", device="cpu", **kw)


def test_loopback_addresses():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.5", "example.org", ""))


def test_exposed_pd_server_without_secret_is_warned_about_or_refused():
    exposed = args(disaggregation_mode="prefill", host="0.0.0.0")
    warnings = exposed.exposure_warnings()
    assert any("--disaggregation-secret" in w for w in warnings) and any(
        "--api-key" in w for w in warnings
    )
    assert (
        args(
            disaggregation_mode="decode", host="0.0.0.0", disaggregation_secret="x", api_key="k"
        ).exposure_warnings()
        == []
    )
    assert args(disaggregation_mode="prefill").exposure_warnings() == []  # loopback
    with pytest.raises(ValueError, match="^disaggregation_require_secret: --host 0.0.0.0"):
        args(disaggregation_mode="prefill", host="0.0.0.0", disaggregation_require_secret=True)
    # satisfied by a secret, or by staying on loopback
    args(
        disaggregation_mode="decode",
        host="0.0.0.0",
        disaggregation_require_secret=True,
        disaggregation_secret="x",
    )
    args(disaggregation_mode="decode", disaggregation_require_secret=True)
    with pytest.raises(ValueError, match="^api_key"):
        args(api_key="")


def test_serve_refuses_to_start_exposed_without_a_secret():
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "serve",
        "--model-path",
        "unused",
        "--device",
        "cpu",
        "--disaggregation-mode",
        "prefill",
        "--host",
        "0.0.0.0",
        "--disaggregation-require-secret",
    ]
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_DISAGGREGATION_SECRET"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert done.returncode == 2, done.stderr
    assert (
        "disaggregation_require_secret" in done.stderr and "--disaggregation-secret" in done.stderr
    )


def get(port: int, target: str, headers: dict | None = None) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{target}", headers=headers or {})
    try:
        with _opener.open(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_route_lookups_need_the_secret():
    s = BootstrapServer("127.0.0.1", 0, expected_ranks=1, secret=SECRET)
    try:
        register_rank("127.0.0.1", s.port, rank_info(0, tp_size=1), secret=SECRET)
        instance = "/route?prefill_dp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
        assert get(s.port, instance) == 401
        assert get(s.port, "/health") == 200  # stays open
        with pytest.raises(BootstrapError, match="401.*not authenticated"):
            fetch_prefill_info("127.0.0.1", s.port)
        with pytest.raises(BootstrapError, match="401.*bad HMAC"):
            fetch_prefill_info("127.0.0.1", s.port, secret="wrong")
        assert fetch_prefill_info("127.0.0.1", s.port, secret=SECRET)["tp_size"] == 1
        assert fetch_rank_info("127.0.0.1", s.port, 0, 0, 0, secret=SECRET)["rank_port"] == 40000
        ts = f"{time.time():.3f}"
        tag = registration_tag(SECRET.encode(), ts, instance.encode())
        assert get(s.port, instance, {TIME_HEADER: ts, AUTH_HEADER: tag}) == 200
        # a tag is for one request target: it does not open another
        assert (
            get(
                s.port,
                "/route?prefill_dp_rank=0&target_tp_rank=0&target_pp_rank=0",
                {TIME_HEADER: ts, AUTH_HEADER: tag},
            )
            == 401
        )
        old = f"{time.time() - 3600:.3f}"
        assert (
            get(
                s.port,
                instance,
                {
                    TIME_HEADER: old,
                    AUTH_HEADER: registration_tag(SECRET.encode(), old, instance.encode()),
                },
            )
            == 401
        )
    finally:
        s.shutdown()


def test_route_lookups_stay_open_without_a_secret():
    s = BootstrapServer("127.0.0.1", 0, expected_ranks=1)
    try:
        register_rank("127.0.0.1", s.port, rank_info(0, tp_size=1))
        assert get(s.port, "/route?prefill_dp_rank=-1&target_tp_rank=-1&target_pp_rank=-1") == 200
    finally:
        s.shutdown()
