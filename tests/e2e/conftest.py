"""A live ``pdserve serve`` for the server tests (one per session) and the offline engine to
compare it with, both on the same tiny random Llama checkpoint."""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.helpers import localhttp
from tests.helpers.checkpoints import build_tiny_checkpoint
from tests.helpers.cluster import children as child_pids  # noqa: F401
from tests.helpers.cluster import free_port, is_alive, wait_for
from tests.helpers.elastic import elastic_servers  # noqa: F401  (session fixture)
from tests.helpers.last_use import (  # noqa: F401  (hooks: servers end after their last test)
    pytest_collection_modifyitems,
    pytest_runtest_teardown,
    until_last_use,
)
from tests.helpers.netns import netns_hosts, netns_pd  # noqa: F401  (session fixtures)

SERVED_MODEL_NAME = "tiny-llama"
SERVER_MAX_TOTAL_TOKENS = 65536
SERVER_MAX_BODY_BYTES = 1 << 20
READY_TIMEOUT_S = 300.0


class LiveServer:
    def __init__(self, proc: subprocess.Popen, url: str, model_path: str, log_path: Path):
        self.proc = proc
        self.url = url
        self.model_path = model_path
        self.log_path = log_path
        self.http = localhttp.Client(base_url=url, timeout=60)
        self.children: list[int] = []

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def integrity(self) -> dict:
        r = self.http.get("/debug/integrity")
        assert r.status_code == 200, r.text
        return r.json()

    def scheduler_stats(self) -> dict:
        r = self.http.get("/server_info")
        assert r.status_code == 200, r.text
        return r.json()["internal_states"][0]

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Wait until nothing runs and every KV page is free or cached; returns the accounting."""

        def idle():
            body = self.integrity()
            pools = body["integrity"]
            done = (
                body["front_end_requests"] == 0
                and pools["running"] == 0
                and pools["waiting"] == 0
                and pools["in_use_pages"] == 0
            )
            return body if done else None

        body = wait_for(idle, timeout, "the server to become idle")
        pools = body["integrity"]
        assert (
            pools["free_pages"] + pools["cached_pages"] + pools["in_use_pages"]
            == pools["total_pages"]
        ), pools
        return pools


@pytest.fixture(scope="session")
def tiny_llama_path() -> str:
    return build_tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def server(request, tiny_llama_path, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "serve",
        "--model-path",
        tiny_llama_path,
        "--port",
        str(port),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--torch-num-threads",
        "1",
        "--max-total-tokens",
        str(SERVER_MAX_TOTAL_TOKENS),
        "--max-body-bytes",
        str(SERVER_MAX_BODY_BYTES),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    live = LiveServer(proc, f"http://127.0.0.1:{port}", tiny_llama_path, log_path)

    def healthy() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{live.log_tail()}")
        try:
            return live.http.get("/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def shutdown() -> None:
        live.http.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        if not live.children:
            return  # it never came up: the start-up error is what counts
        # Shutdown contract: SIGTERM exits cleanly and takes the scheduler process with it.
        assert code == 0, live.log_tail()
        wait_for(
            lambda: not any(is_alive(pid) for pid in live.children),
            10,
            "the scheduler process to exit",
        )

    stop = until_last_use(request, shutdown)
    try:
        wait_for(healthy, READY_TIMEOUT_S, "the server's /health", interval=0.25)
        live.children = child_pids(proc.pid)
        assert live.children, "the server should run its scheduler in a child process"
        yield live
    finally:
        stop()


@pytest.fixture
def live(server):
    """The session server; after the test, nothing may run and no KV page may have leaked."""
    yield server
    server.wait_idle()


@pytest.fixture(scope="session")
def offline_engine(tiny_llama_path):
    import pdserve

    return pdserve.Engine(model_path=tiny_llama_path, torch_num_threads=1, max_total_tokens=16384)


def sse_events(lines) -> list:
    """The ``data:`` payloads of an SSE stream, parsed; ``"[DONE]"`` stays a string."""
    import json

    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# greedy generation length of the PD tests' reference outputs
PD_NEW_TOKENS = 8


@pytest.fixture(scope="session")
def reference(offline_engine):
    """Offline-engine greedy outputs (``PD_NEW_TOKENS`` tokens, ignore_eos), cached per
    (prompt, logprobs); with logprobs, input logprobs start at token 0. ``reference.many(jobs)``
    answers a list of (prompt, logprobs) at once, the missing ones generated as one batch."""
    cache: dict = {}
    params = {"temperature": 0, "max_new_tokens": PD_NEW_TOKENS, "ignore_eos": True}

    def generate(prompts: list[list[int]], logprobs: bool) -> None:
        outs = offline_engine.generate(
            input_ids=prompts,
            sampling_params=params,
            return_logprob=logprobs,
            logprob_start_len=0 if logprobs else -1,
        )
        for ids, out in zip(prompts, outs):
            cache[(tuple(ids), logprobs)] = out

    def get(ids: list[int], logprobs: bool = False) -> dict:
        if (tuple(ids), logprobs) not in cache:
            generate([ids], logprobs)
        return cache[(tuple(ids), logprobs)]

    def many(jobs: list[tuple[list[int], bool]]) -> list[dict]:
        for logprobs in (False, True):
            todo = {tuple(ids): ids for ids, lp in jobs if lp == logprobs}
            todo = [ids for key, ids in todo.items() if (key, logprobs) not in cache]
            if todo:
                generate(todo, logprobs)
        return [cache[(tuple(ids), lp)] for ids, lp in jobs]

    get.many = many
    return get


@pytest.fixture(autouse=True)
def _integrity_after(request):
    """An offline engine a test left in ``request.node._engine``: its pools consistent, then let
    go (pytest keeps every test's node for the whole session; a fixture may still hold it)."""
    yield
    eng = getattr(request.node, "_engine", None)
    if eng is not None:
        del request.node._engine
        eng.check_integrity()


# module-level caches of HF reference models and outputs, and of offline engines
_CACHES = ("_hf_cache", "_hf", "_hf_rounded", "_hf_references", "_engines")


@pytest.fixture(scope="module", autouse=True)
def _drop_module_caches():
    """What the e2e modules cache (HF reference models and logits, offline engines: the names in
    ``_CACHES`` and ``functools.lru_cache`` functions) dropped when a module ends: the suite's
    process would hold every family's. The C heap's free memory goes back to the system too
    (glibc keeps it otherwise). What is left then lives on (imported modules, session fixtures):
    it is frozen out of the cycle collector's passes (``gc.freeze``), so the next module's passes
    walk only what that module made (a full pass took about half a second per module)."""
    yield
    for name, module in list(sys.modules.items()):
        if not name.startswith("tests.e2e.") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if attr in _CACHES and isinstance(value, dict):
                value.clear()
            elif hasattr(value, "cache_clear") and getattr(value, "__module__", None) == name:
                value.cache_clear()  # the module's own lru_cache functions only
    gc.collect()
    gc.freeze()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc
