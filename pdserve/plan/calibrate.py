"""Profiles from running servers, or from a server this command starts (``--calibrate``).

Servers of one TP/DP/PP shape make one profile: its prefill fit from their start-up calibration
(a prefill server's when there is one; with one more point from the probe when the workload's
prompts are longer than the calibration measured), its decode fit from the probe of one decode
or colocated server of that shape (none: the shape can only be a prefill profile), its KV
figures and limits from a decode or colocated server (else the prefill's). KV bandwidth: the
flag, else a prefill's measured ``kv_transfer_bytes_per_s``, else, for the ``local`` backend,
this host's memcpy speed, else the router's default (1 GB/s).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import httpx

from pdserve.plan import measure
from pdserve.plan.profile import PrefillFit, Profile
from pdserve.plan.workload import PlanError
from pdserve.ports import reserve_port

logger = logging.getLogger(__name__)

DEFAULT_BANDWIDTH = 1e9  # as pdserve router's --pd-kv-bandwidth
READY_TIMEOUT_S = 900.0


def from_servers(
    servers: list[tuple[str, Optional[str]]],
    *,
    batches: tuple[int, ...],
    long_prompt: int,
    api_key: Optional[str] = None,
    kv_bandwidth: Optional[float] = None,
    pd_overhead_s: float = 0.005,
) -> list[Profile]:
    """One profile per server shape; ``servers`` are (url, role or None)."""
    if not servers:
        raise PlanError(
            "calibration: give --calibration FILE, servers (--prefill/--decode/--server) "
            "or --router"
        )
    views = [measure.read_server(url, role, api_key) for url, role in servers]
    shapes: dict[tuple, list[measure.ServerView]] = {}
    for v in views:
        shapes.setdefault(v.shape, []).append(v)
    bandwidth, bw_source = _bandwidth(views, kv_bandwidth)
    out = []
    for shape, group in shapes.items():
        pre = next((v for v in group if v.role == "prefill"), group[0])
        dec = next((v for v in group if v.role != "prefill"), None)
        main = dec or pre
        cal = pre.info["calibration"]
        points = {int(k): float(t) for k, t in (cal.get("measured") or {}).items()}
        sources = {
            "prefill": f"{pre.url} start-up calibration",
            "kv": f"{main.url} scheduler_info",
            "kv_bandwidth": bw_source,
        }
        decode, overhead, raw = None, 0.002, {"calibration": cal}
        if dec is not None:
            logger.info(
                "probing %s: decode at batches %s and a %d-token prompt (a few seconds)",
                dec.url,
                ",".join(map(str, batches)),
                long_prompt,
            )
            decode, extra, overhead, probe_raw = measure.probe(dec, batches, long_prompt, api_key)
            raw.update(probe=probe_raw)
            sources["decode"] = f"{dec.url} probe"
            sources["request_overhead_s"] = f"{dec.url} probe (time to first token - calibration)"
            if extra:
                points.update(extra)
                sources["prefill"] += f", + {dec.url} probe at {','.join(map(str, extra))} tokens"
        prefill = (
            PrefillFit.fit(points)
            if len(points) >= 2
            else PrefillFit(float(cal["prefill_fixed_s"]), float(cal["prefill_s_per_token"]))
        )
        info, sched = main.info, main.sched
        tp, dp, pp = shape
        out.append(
            Profile(
                prefill=prefill,
                decode=decode,
                kv_bytes_per_token=int(sched.get("kv_bytes_per_token") or 1),
                kv_bytes_per_request=int(sched.get("kv_bytes_per_request") or 0),
                kv_bandwidth=bandwidth,
                max_total_tokens=int(
                    sched.get("max_total_tokens") or info.get("max_total_num_tokens") or 1 << 20
                ),
                max_running_requests=int(
                    sched.get("max_running_requests") or info.get("max_running_requests") or 256
                ),
                max_prefill_tokens=int(
                    pre.info.get("max_prefill_tokens")
                    or pre.info.get("chunked_prefill_size")
                    or 2048
                ),
                chunked_prefill_size=int(pre.info.get("chunked_prefill_size") or 2048),
                request_overhead_s=overhead,
                pd_overhead_s=pd_overhead_s,
                tp_size=tp,
                dp_size=dp,
                pp_size=pp,
                model=str(info.get("served_model_name") or info.get("model_path") or ""),
                sources=sources,
                measured=raw,
            )
        )
    models = {p.model for p in out}
    if len(models) > 1:
        logger.warning(
            "the servers serve different models (%s): their profiles are planned together",
            ", ".join(sorted(models)),
        )
    return out


def _bandwidth(views: list[measure.ServerView], flag: Optional[float]) -> tuple[float, str]:
    if flag is not None:
        if not flag > 0:
            raise PlanError(f"kv_bandwidth: must be > 0 bytes/s, got {flag}")
        return flag, "--kv-bandwidth"
    rates = [v.load.get("kv_transfer_bytes_per_s") for v in views if v.role == "prefill"]
    rates = [float(r) for r in rates if isinstance(r, (int, float)) and r > 0]
    if rates:
        return sum(rates) / len(rates), "prefill /get_load kv_transfer_bytes_per_s"
    backends = {
        v.info.get("disaggregation_transfer_backend") for v in views if v.role != "colocated"
    }
    if backends <= {"local", None}:
        return measure.host_memcpy_bandwidth(), "this host's memcpy (the local backend's copies)"
    logger.warning(
        "no measured KV transfer rate yet (backends %s): assuming %.0e bytes/s; "
        "pass --kv-bandwidth",
        ", ".join(sorted(b for b in backends if b)),
        DEFAULT_BANDWIDTH,
    )
    return DEFAULT_BANDWIDTH, "assumed (the router's --pd-kv-bandwidth default)"


def calibrate_model(
    model_path: str,
    serve_args: list[str],
    *,
    threads: int,
    batches: tuple[int, ...],
    long_prompt: int,
    kv_bandwidth: Optional[float],
    pd_overhead_s: float,
) -> Profile:
    """Start ``pdserve serve`` (colocated) on this machine, measure it as a running server, stop it.
    The server inherits this process's CPU affinity (run under ``taskset`` to pin it)."""
    reserved = (
        reserve_port()
    )  # held until the server listens on it (uvicorn binds with SO_REUSEADDR too)
    port = reserved.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "serve",
        "--model-path",
        model_path,
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--torch-num-threads",
        str(threads),
        *serve_args,
    ]
    log = tempfile.NamedTemporaryFile(prefix="pdserve-plan-calibrate-", suffix=".log", delete=False)
    logger.info("starting %s (log: %s)", " ".join(cmd), log.name)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            _wait_ready(proc, url, Path(log.name))
        finally:
            reserved.close()
        (profile,) = from_servers(
            [(url, "colocated")],
            batches=batches,
            long_prompt=long_prompt,
            kv_bandwidth=kv_bandwidth,
            pd_overhead_s=pd_overhead_s,
        )
        profile.sources["server"] = " ".join(cmd[3:])
        return profile
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").splitlines()[-15:]
            raise PlanError(
                f"calibrate: the server exited with {proc.returncode}:\n" + "\n".join(tail)
            )
        try:
            info = httpx.get(url + "/server_info", timeout=5).json()
            if info.get("status") == "ready" and info.get("calibration"):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise PlanError(
        f"calibrate: the server was not ready within {READY_TIMEOUT_S:.0f} s (log: {log})"
    )
