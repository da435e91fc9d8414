"""`pdserve launch`: the local PD cluster comes up, serves through its router, and Ctrl-C stops
every process it started."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from tests.helpers import localhttp
from tests.helpers.cluster import children, free_port, is_alive, wait_for


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = children(p)
        out += kids
        todo += kids
    return out


def test_launch_serves_and_stops_everything(tiny_llama_path, tmp_path):
    port = free_port()
    log = open(tmp_path / "launch.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "launch",
            "--model-path",
            tiny_llama_path,
            "--port",
            str(port),
            "--num-prefill",
            "1",
            "--num-decode",
            "1",
            "--torch-num-threads",
            "1",
            "--max-total-tokens",
            "16384",
            "--pd-policy",
            "conditional",
            "--decode-radix-cache",
            "--enable-deterministic-inference",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def ready():
            assert proc.poll() is None, (tmp_path / "launch.log").read_text()[-3000:]
            return b"pdserve cluster ready" in (tmp_path / "launch.log").read_bytes()

        wait_for(ready, 300, "the cluster to be ready", interval=0.5)
        r = localhttp.post(
            url + "/generate",
            json={"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["completion_tokens"] == 4
        assert r.json()["meta_info"]["pd_decision"]["mode"] in ("local", "pd")
        # the servers publish KV events and the router follows them (conditional needs the caches)
        index = localhttp.get(url + "/kv_index", timeout=10).json()
        assert len(index["workers"]) == 2 and index["tokenizer"], index
        wait_for(
            lambda: all(
                g["synced"]
                for gs in localhttp.get(url + "/kv_index", timeout=10).json()["workers"].values()
                for g in gs
            ),
            10,
            "KV indices in sync",
        )
        prefill = localhttp.get(url + "/server_info", timeout=60).json()["prefill"][0]
        assert (
            prefill["server_info"]["disaggregation_secret"] == "***"
        )  # launch gave its servers one
        assert (
            prefill["server_info"]["enable_deterministic_inference"] is True
        )  # the README's flag reaches them
        lookup = localhttp.get(
            f"http://127.0.0.1:{prefill['bootstrap_port']}/route?prefill_dp_rank=-1&target_tp_rank=-1"
            "&target_pp_rank=-1",
            timeout=10,
        )
        assert lookup.status_code == 401  # unsigned bootstrap look-ups are refused
        descendants = _tree(proc.pid)
        assert len(descendants) >= 5  # 2 front ends + 2 schedulers + router
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
        log.close()
    assert code == 0, (tmp_path / "launch.log").read_text()[-3000:]
    deadline = time.monotonic() + 15
    while any(is_alive(p) for p in descendants) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in descendants if is_alive(p)], "processes left running after Ctrl-C"


def test_launch_moe_prefill_tp_decode_dp_attention_ep(tmp_path):
    """The README's MoE command on the tiny Qwen3-MoE: prefill tp2, decode tp2 with DP attention and
    expert parallelism (all-to-all dispatch); the tokens equal the one-rank engine's."""
    import pdserve
    from tests.helpers.checkpoints import build_tiny_checkpoint

    path = build_tiny_checkpoint("qwen3_moe")
    port = free_port()
    log = open(tmp_path / "launch.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "launch",
            "--model-path",
            path,
            "--port",
            str(port),
            "--torch-num-threads",
            "1",
            "--max-total-tokens",
            "4096",
            "--prefill-tp-size",
            "2",
            "--decode-tp-size",
            "2",
            "--decode-dp-size",
            "2",
            "--decode-ep-size",
            "2",
            "--decode-moe-a2a-backend",
            "torch",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    ids = [101, 2042, 377, 9001, 31337, 12, 4444, 805]
    sp = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    try:

        def ready():
            assert proc.poll() is None, (tmp_path / "launch.log").read_text()[-3000:]
            return b"pdserve cluster ready" in (tmp_path / "launch.log").read_bytes()

        wait_for(ready, 300, "the cluster to be ready", interval=0.5)
        info = localhttp.get(url + "/server_info", timeout=60).json()
        decode = info["decode"][0]["server_info"]
        assert (
            decode["tp_size"],
            decode["dp_size"],
            decode["ep_size"],
            decode["moe_a2a_backend"],
        ) == (2, 2, 2, "torch")
        assert info["prefill"][0]["server_info"]["ep_size"] == 1
        r = localhttp.post(
            url + "/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=120
        )
        assert r.status_code == 200, r.text
        eng = pdserve.Engine(model_path=path, torch_num_threads=1, max_total_tokens=4096)
        try:
            assert (
                r.json()["output_ids"]
                == eng.generate(input_ids=ids, sampling_params=sp)["output_ids"]
            )
        finally:
            eng.shutdown()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        log.close()


def _start_cluster(model_path: str, tmp_path, name: str) -> tuple[subprocess.Popen, str]:
    """``pdserve launch`` (1 prefill + 1 decode, no warm-up) started the way a script's background
    job starts it: with SIGINT ignored, which the launcher inherits. Returns it once ready."""
    port = free_port()
    log_path = tmp_path / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdserve.cli",
                "launch",
                "--model-path",
                model_path,
                "--port",
                str(port),
                "--torch-num-threads",
                "1",
                "--max-total-tokens",
                "4096",
                "--skip-warmup",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
            env={**os.environ, "OMP_NUM_THREADS": "1", "PDSERVE_DISABLE_CPU_KERNELS": "1"},
        )

    def ready():
        assert proc.poll() is None, log_path.read_text()[-3000:]
        return b"pdserve cluster ready" in log_path.read_bytes()

    wait_for(ready, 300, "the cluster to be ready", interval=0.5)
    return proc, f"http://127.0.0.1:{port}"


def _cluster_ports(url: str) -> list[int]:
    """The router's port, every server's HTTP port and every prefill's bootstrap port."""
    info = localhttp.get(url + "/server_info", timeout=60).json()
    workers = info["prefill"] + info["decode"]
    assert len(workers) == 2, info
    return [
        int(url.rsplit(":", 1)[1]),
        *(int(w["url"].rsplit(":", 1)[1]) for w in workers),
        *(w["bootstrap_port"] for w in info["prefill"]),
    ]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(
            socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
        )  # as a server binding it again would
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _assert_all_gone(pids: list[int], ports: list[int], within: float) -> None:
    wait_for(
        lambda: not any(is_alive(p) for p in pids),
        within,
        "every process of the cluster to exit",
        interval=0.1,
    )
    wait_for(
        lambda: all(_port_free(p) for p in ports), 5, f"ports {ports} to be free", interval=0.1
    )


def test_launch_from_a_background_job_stops_on_sigint(tiny_llama_path, tmp_path):
    """SIGINT ignored at start (a background job's lot) does not make the launcher deaf to it."""
    proc, url = _start_cluster(tiny_llama_path, tmp_path, "launch")
    try:
        descendants, ports = _tree(proc.pid), _cluster_ports(url)
        assert len(descendants) >= 5, descendants  # 2 front ends + 2 schedulers + router
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, (tmp_path / "launch.log").read_text()[-3000:]
    _assert_all_gone(descendants, ports, 15)


def test_launcher_killed_takes_its_cluster_along(tiny_llama_path, tmp_path):
    """SIGKILL leaves the launcher no chance to clean up: its servers (and their schedulers) and its
    router end by themselves and free their ports."""
    proc, url = _start_cluster(tiny_llama_path, tmp_path, "launch")
    descendants, ports = _tree(proc.pid), _cluster_ports(url)
    assert len(descendants) >= 5, descendants
    t0 = time.monotonic()
    proc.kill()
    proc.wait()
    try:
        _assert_all_gone(descendants, ports, 20)
    finally:
        for pid in descendants:  # never leave orphans behind, even when the test fails
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)
    print(f"cluster gone {time.monotonic() - t0:.1f}s after the launcher was killed")
