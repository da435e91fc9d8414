"""Router overhead: what `pdserve router` costs per request against the Rust `sglang-router`,
both in front of the same fake workers that answer at once, driven by the same load generator.

  python benchmarks/router_overhead.py [--modes pd,regular]
      [--endpoints generate,generate-stream,chat-stream]
      [--concurrency 1,64,512] [--duration 5] [--warmup 1] [--repeats 2]
      [--router-cpus 1] [--worker-cpus 0] [--client-cpus 0] [--pdserve-workers 1[,2]]
      [--baseline-tree DIR [--baseline-asyncio]] [--out FILE]

``--baseline-tree DIR`` adds an older pdserve (a directory holding its ``pdserve`` package, e.g.
``git archive REV pdserve | tar -x -C DIR``) as target ``pdserve-base``; ``--baseline-asyncio``
runs it without uvloop and httptools (uvicorn then uses asyncio's loop and h11).

Every process runs on its own: one fake prefill and one fake decode (``--modes pd``) or one
fake colocated worker (``regular``), each a minimal HTTP/1.1 server on asyncio; the routers
under test; and a load generator, a minimal asyncio HTTP/1.1 client with one keep-alive
connection per concurrent request, in a process of its own. The fakes answer like pdserve's
servers (``/health``, ``/server_info``, ``/model_info``, ``/get_load``, the three generation
routes, streamed or not) and count the requests that carry bootstrap fields, so a run checks
that each routed request reached prefill and decode.

For each mode, endpoint and concurrency, the targets take turns (the order rotates with each
repeat): the decode (or colocated) fake directly, then each router. Reported per target, over
the requests that completed in the measured window (after ``--warmup``): requests/s sustained
by the closed loop, latency p50/p99 (router minus direct: the latency the router adds), and the
router's CPU seconds per 1,000 requests (user + system of the router's processes and their
children over the window, from /proc through psutil).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOOTSTRAP_PORT = 18998  # only named in the bodies; the fakes never listen on it
MODEL = "fake-model"

BODIES = {  # endpoint: (path, body); a chat-sized prompt, a handful of sampling fields
    "generate": (
        "/generate",
        {
            "text": "The quick brown fox jumps over the lazy dog. " * 8,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        },
    ),
    "generate-stream": (
        "/generate",
        {
            "text": "The quick brown fox jumps over the lazy dog. " * 8,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0},
            "stream": True,
        },
    ),
    "chat": (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "max_tokens": 8,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me about foxes. " * 16}],
        },
    ),
    "chat-stream": (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "max_tokens": 8,
            "temperature": 0,
            "stream": True,
            "messages": [{"role": "user", "content": "Tell me about foxes. " * 16}],
        },
    ),
}


def _use_uvloop() -> None:
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


# ---------------------------------------------------------------------------- fake worker
_STREAM_RE = re.compile(rb'"stream"\s*:\s*true')


def _json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class FakeWorker(asyncio.Protocol):
    """One connection of a fake prefill, decode or colocated worker (HTTP/1.1, keep-alive)."""

    role = "decode"
    stats = {"requests": 0, "with_bootstrap": 0, "probes": 0}
    tokens = 8

    def connection_made(self, transport):
        self.transport = transport
        self.buf = b""

    def data_received(self, data):
        self.buf += data
        while True:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buf[:head_end].decode("latin-1")
            lines = head.split("\r\n")
            parts = lines[0].split(" ")
            if len(parts) != 3 or not parts[2].startswith("HTTP/1"):  # e.g. an HTTP/2 (gRPC) probe
                self.transport.write(
                    b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                )
                self.transport.close()
                return
            headers = {}
            for line in lines[1:]:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
            start = head_end + 4
            if headers.get("transfer-encoding", "").lower() == "chunked":
                body, used = _dechunk(self.buf, start)
                if body is None:
                    return
            else:
                n = int(headers.get("content-length", "0"))
                if len(self.buf) < start + n:
                    return
                body, used = self.buf[start : start + n], start + n
            self.buf = self.buf[used:]
            self.answer(parts[0], parts[1].split("?")[0], body)

    def send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.transport.write(
            b"HTTP/1.1 %d OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
            % (status, ctype.encode(), len(body), body)
        )

    def answer(self, method: str, path: str, body: bytes) -> None:
        if method == "GET":
            FakeWorker.stats["probes"] += 1
            if path in ("/health", "/health_generate", "/readiness", "/liveness"):
                return self.send(200, b"{}")
            if path in ("/server_info", "/get_server_info"):
                return self.send(
                    200,
                    _json(
                        {
                            "model_path": MODEL,
                            "disaggregation_mode": self.role,
                            "dp_size": 1,
                            "disaggregation_transfer_backend": "mooncake",
                            "tp_size": 1,
                        }
                    ),
                )
            if path in ("/model_info", "/get_model_info"):
                return self.send(200, _json({"model_path": MODEL, "is_generation": True}))
            if path == "/v1/models":
                return self.send(
                    200, _json({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
                )
            if path == "/get_load":
                return self.send(
                    200, _json({"num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0})
                )
            if path == "/stats":
                return self.send(200, _json(FakeWorker.stats))
            return self.send(404, b'{"error":"not found"}')
        if path == "/flush_cache":
            return self.send(200, b"{}")
        FakeWorker.stats["requests"] += 1
        if b'"bootstrap_room"' in body:
            FakeWorker.stats["with_bootstrap"] += 1
        chat = path == "/v1/chat/completions"
        if (
            self.role == "prefill"
        ):  # one token, as one JSON object (what decode's answer does not need)
            return self.send(
                200,
                _json(
                    {"text": "", "output_ids": [1], "meta_info": {"id": "p", "prompt_tokens": 16}}
                ),
            )
        if not _STREAM_RE.search(body):
            if chat:
                out = {
                    "id": "c",
                    "object": "chat.completion",
                    "created": 0,
                    "model": MODEL,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "tok " * self.tokens},
                            "finish_reason": "length",
                        }
                    ],
                    "usage": {
                        "prompt_tokens": 16,
                        "completion_tokens": self.tokens,
                        "total_tokens": 16 + self.tokens,
                    },
                }
            else:
                out = {
                    "text": "tok " * self.tokens,
                    "output_ids": list(range(self.tokens)),
                    "meta_info": {
                        "id": "d",
                        "prompt_tokens": 16,
                        "completion_tokens": self.tokens,
                        "finish_reason": {"type": "length", "length": self.tokens},
                    },
                }
            return self.send(200, _json(out))
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: "
            b"chunked\r\n\r\n"
        )
        for i in range(self.tokens):  # one write per token, as a server's detokenizer sends them
            if chat:
                ev = {
                    "id": "c",
                    "object": "chat.completion.chunk",
                    "created": 0,
                    "model": MODEL,
                    "choices": [{"index": 0, "delta": {"content": "tok "}, "finish_reason": None}],
                }
            else:
                ev = {
                    "text": "tok " * (i + 1),
                    "output_ids": list(range(i + 1)),
                    "meta_info": {"id": "d", "prompt_tokens": 16, "completion_tokens": i + 1},
                }
            data = b"data: " + _json(ev) + b"\n\n"
            self.transport.write(b"%x\r\n%s\r\n" % (len(data), data))
        done = b"data: [DONE]\n\n"
        self.transport.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))


def _dechunk(buf: bytes, start: int) -> tuple[bytes | None, int]:
    """A chunked body starting at ``start``: (body, end offset), or (None, 0) until it is whole."""
    out, pos = [], start
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None, 0
        size = int(buf[pos:eol].split(b";")[0], 16)
        if size == 0:
            end = buf.find(b"\r\n", eol + 2)
            return (b"".join(out), end + 2) if end >= 0 else (None, 0)
        if len(buf) < eol + 2 + size + 2:
            return None, 0
        out.append(buf[eol + 2 : eol + 2 + size])
        pos = eol + 2 + size + 2


def run_fake(role: str, port: int) -> None:
    _use_uvloop()
    FakeWorker.role = role

    async def main():
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            FakeWorker, "127.0.0.1", port, backlog=4096, reuse_address=True
        )
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# ---------------------------------------------------------------------------- load generator
class Conn:
    """One keep-alive HTTP/1.1 connection of the load generator."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    async def request(self, raw: bytes) -> tuple[int, bytes]:
        self.writer.write(raw)
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionError("connection closed")
        status = int(status_line.split(b" ", 2)[1])
        length, chunked, close = None, False, False
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            k, _, v = line.partition(b":")
            k, v = k.strip().lower(), v.strip().lower()
            if k == b"content-length":
                length = int(v)
            elif k == b"transfer-encoding" and v == b"chunked":
                chunked = True
            elif k == b"connection" and v == b"close":
                close = True
        if chunked:
            parts = []
            while True:
                size = int((await self.reader.readline()).split(b";")[0], 16)
                if size == 0:
                    await self.reader.readline()
                    break
                parts.append(await self.reader.readexactly(size + 2))
            body = b"".join(p[:-2] for p in parts)
        elif length is not None:
            body = await self.reader.readexactly(length)
        else:
            body = await self.reader.read()
            close = True
        if close:
            raise ConnectionAbortedError(status)  # the caller reconnects
        return status, body


async def _load(
    url: str,
    path: str,
    body: dict,
    concurrency: int,
    warmup: float,
    duration: float,
    pids: list[int],
) -> dict:
    import psutil

    host, port = url.split("//")[1].split(":")
    payload = json.dumps(body).encode()
    raw = (
        f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    stream = bool(body.get("stream"))
    procs = []
    for pid in pids:  # the router's processes: the one started and all its descendants
        p = psutil.Process(pid)
        procs += [p] + p.children(recursive=True)

    def cpu() -> float:
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    latencies: list[float] = []
    errors: list[str] = []
    clock = time.perf_counter  # uvloop's loop.time() counts whole milliseconds
    t0 = clock()
    start, end = t0 + warmup, t0 + warmup + duration
    marks: dict[str, float] = {}

    async def one_client():
        conn = None
        while True:
            if clock() >= end:
                break
            if conn is None:
                conn = Conn(*await asyncio.open_connection(host, int(port)))
            t = clock()
            try:
                status, resp = await conn.request(raw)
            except (ConnectionError, asyncio.IncompleteReadError) as e:
                conn.writer.close()
                conn = None
                if not isinstance(e, ConnectionAbortedError):
                    errors.append(repr(e))
                    continue
                status, resp = e.args[0], b""
            done = clock()
            if status != 200 or (stream and not resp.rstrip().endswith(b"data: [DONE]")):
                errors.append(f"HTTP {status}: {resp[:200]!r}")
            elif start <= done <= end:  # completions in the window: what its CPU time paid for
                latencies.append(done - t)
        if conn is not None:
            conn.writer.close()

    async def window():
        await asyncio.sleep(max(0.0, start - clock()))
        marks["cpu0"], marks["t0"] = cpu(), clock()
        await asyncio.sleep(max(0.0, end - clock()))
        marks["cpu1"], marks["t1"] = cpu(), clock()

    await asyncio.gather(window(), *(one_client() for _ in range(concurrency)))
    latencies.sort()
    n = len(latencies)
    wall = marks["t1"] - marks["t0"]
    cpu_s = marks["cpu1"] - marks["cpu0"]
    return {
        "requests": n,
        "rps": n / wall,
        "p50_ms": 1e3 * latencies[n // 2] if n else None,
        "p99_ms": 1e3 * latencies[min(n - 1, int(n * 0.99))] if n else None,
        "mean_ms": 1e3 * statistics.fmean(latencies) if n else None,
        "cpu_s_per_1k": 1e3 * cpu_s / n if n and pids else None,
        "cpu_util": cpu_s / wall if pids else None,
        "errors": len(errors),
        "first_errors": errors[:3],
    }


def run_load(spec: str) -> None:
    a = json.loads(spec)
    _use_uvloop()
    out = asyncio.run(
        _load(
            a["url"], a["path"], a["body"], a["concurrency"], a["warmup"], a["duration"], a["pids"]
        )
    )
    print(json.dumps(out))


# ---------------------------------------------------------------------------- orchestration
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pinned(cpus: str | None, cmd: list[str]) -> list[str]:
    return (["taskset", "-c", cpus] if cpus else []) + cmd


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def get_json(url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


class Bench:
    def __init__(self, a, logs: Path):
        self.a = a
        self.logs = logs
        self.procs: list[subprocess.Popen] = []

    def spawn(
        self, name: str, cpus: str | None, cmd: list[str], env: dict | None = None
    ) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "ab")
        proc = subprocess.Popen(
            pinned(cpus, cmd),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        log.close()
        self.procs.append(proc)
        return proc

    def fake(self, role: str) -> tuple[str, subprocess.Popen]:
        port = free_port()
        proc = self.spawn(
            f"fake-{role}-{port}",
            self.a.worker_cpus,
            [sys.executable, __file__, "--run-fake", role, str(port)],
        )
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", proc)
        return url, proc

    def pdserve_router(
        self, mode: str, workers: dict[str, str], processes: int = 1, tree: str | None = None
    ) -> tuple[str, subprocess.Popen]:
        port = free_port()
        if mode == "pd":
            targets = [
                "--prefill",
                workers["prefill"],
                str(BOOTSTRAP_PORT),
                "--decode",
                workers["decode"],
            ]
        else:
            targets = ["--worker", workers["regular"]]
        extra = ["--workers", str(processes)] if processes > 1 else []
        env = {"PDSERVE_DISABLE_CPU_KERNELS": "1"}
        if tree is not None:
            paths = [tree] + ([str(self.no_uvloop())] if self.a.baseline_asyncio else [])
            env["PYTHONPATH"] = os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")])
        proc = self.spawn(
            f"pdserve-router-{mode}-{processes}{'-base' if tree else ''}",
            self.a.router_cpus,
            [
                sys.executable,
                "-m",
                "pdserve.cli",
                "router",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--policy",
                "round_robin",
                "--log-level",
                "warning",
                *targets,
                *extra,
            ],
            env=env,
        )
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", proc)
        return url, proc

    def no_uvloop(self) -> Path:
        """A directory whose uvloop and httptools fail to import, so uvicorn falls back to asyncio
        and h11."""
        stub = self.logs / "no-uvloop"
        for name in ("uvloop", "httptools"):
            (stub / name).mkdir(parents=True, exist_ok=True)
            (stub / name / "__init__.py").write_text(
                f"raise ImportError('{name} hidden by the benchmark')\n"
            )
        return stub

    def sglang_router(self, mode: str, workers: dict[str, str]) -> tuple[str, subprocess.Popen]:
        port = free_port()
        if mode == "pd":
            targets = [
                "--pd-disaggregation",
                "--prefill",
                workers["prefill"],
                str(BOOTSTRAP_PORT),
                "--decode",
                workers["decode"],
            ]
        else:
            targets = ["--worker-urls", workers["regular"]]
        proc = self.spawn(
            f"sglang-router-{mode}",
            self.a.router_cpus,
            [
                sys.executable,
                "-m",
                "sglang_router.launch_router",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--policy",
                "round_robin",
                "--log-level",
                "warn",
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(free_port()),
                *targets,
            ],
        )
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/readiness", proc, timeout=120)
        return url, proc

    def load(self, url: str, endpoint: str, concurrency: int, pids: list[int]) -> dict:
        path, body = BODIES[endpoint]
        spec = json.dumps(
            {
                "url": url,
                "path": path,
                "body": body,
                "concurrency": concurrency,
                "warmup": self.a.warmup,
                "duration": self.a.duration,
                "pids": pids,
            }
        )
        out = subprocess.run(
            pinned(self.a.client_cpus, [sys.executable, __file__, "--run-load", spec]),
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=self.a.warmup + self.a.duration + 120,
        )
        if out.returncode != 0:
            raise RuntimeError(f"load generator failed: {out.stderr[-2000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    def close(self) -> None:
        for p in reversed(self.procs):
            stop(p)


def run_mode(bench: Bench, mode: str, results: list[dict]) -> None:
    a = bench.a
    roles = ["prefill", "decode"] if mode == "pd" else ["regular"]
    workers = {r: bench.fake(r)[0] for r in roles}
    main_url = workers["decode" if mode == "pd" else "regular"]
    targets = {"direct": (main_url, [])}
    if a.baseline_tree:
        url, proc = bench.pdserve_router(mode, workers, tree=a.baseline_tree)
        targets["pdserve-base"] = (url, [proc.pid])
    for n in a.pdserve_workers:
        url, proc = bench.pdserve_router(mode, workers, processes=n)
        targets["pdserve" if n == 1 else f"pdserve-x{n}"] = (url, [proc.pid])
    if not a.skip_sglang:
        url, proc = bench.sglang_router(mode, workers)
        targets["sglang"] = (url, [proc.pid])
    names = list(targets)
    for rep in range(a.repeats):
        order = names[rep % len(names) :] + names[: rep % len(names)]  # rotate who goes first
        for endpoint in a.endpoints:
            for conc in a.concurrency:
                for name in order:
                    url, pids = targets[name]
                    before = {r: get_json(u + "/stats") for r, u in workers.items()}
                    r = bench.load(url, endpoint, conc, pids)
                    after = {r_: get_json(u + "/stats") for r_, u in workers.items()}
                    r.update(
                        mode=mode, endpoint=endpoint, concurrency=conc, target=name, repeat=rep
                    )
                    # every routed PD request must reach both fakes with bootstrap fields
                    got = {
                        role: after[role]["with_bootstrap"] - before[role]["with_bootstrap"]
                        for role in after
                    }
                    r["reached"] = got
                    results.append(r)
                    print(
                        f"{mode:7s} {endpoint:15s} c={conc:<4d} {name:8s} rep {rep}: "
                        f"{r['rps']:8.0f} req/s  "
                        + (
                            f"p50 {r['p50_ms']:7.2f} ms  p99 {r['p99_ms']:7.2f} ms  "
                            if r["requests"]
                            else ""
                        )
                        + (
                            f"cpu {r['cpu_s_per_1k']:.3f} s/1k ({r['cpu_util']:.2f} cores)  "
                            if r["cpu_s_per_1k"]
                            else ""
                        )
                        + f"errors {r['errors']} reached {got}"
                        + (f" {r['first_errors']}" if r["errors"] else ""),
                        flush=True,
                    )


def summarize(results: list[dict], a) -> str:
    """Medians over repeats, and pdserve / sglang ratios (added latency: minus direct)."""

    def med(rows, key):
        vals = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    lines = [
        "| mode | endpoint | conc | target | req/s | p50 ms | p99 ms | added p50 ms | added p99 ms "
        "| router CPU s/1k req | router cores busy |",
        "|" + "---|" * 11,
    ]
    ratios = [
        "| mode | endpoint | conc | pdserve | req/s sglang/pdserve | added p50 pdserve/sglang "
        "| added p99 pdserve/sglang | CPU/req pdserve/sglang |",
        "|" + "---|" * 8,
    ]
    keys = sorted(
        {(r["mode"], r["endpoint"], r["concurrency"]) for r in results},
        key=lambda k: (a.modes.index(k[0]), a.endpoints.index(k[1]), k[2]),
    )
    for mode, endpoint, conc in keys:
        names = list(dict.fromkeys(r["target"] for r in results))
        rows = {
            t: [
                r
                for r in results
                if (r["mode"], r["endpoint"], r["concurrency"], r["target"])
                == (mode, endpoint, conc, t)
            ]
            for t in names
        }
        direct = {k: med(rows["direct"], k) for k in ("p50_ms", "p99_ms")}
        stats = {}
        for t, rs in rows.items():
            if not rs:
                continue
            s = {k: med(rs, k) for k in ("rps", "p50_ms", "p99_ms", "cpu_s_per_1k", "cpu_util")}
            known = t != "direct" and None not in (s["p50_ms"], direct["p50_ms"])
            s["add50"] = s["p50_ms"] - direct["p50_ms"] if known else None
            s["add99"] = s["p99_ms"] - direct["p99_ms"] if known else None
            stats[t] = s
            fmt = lambda v, f="{:.2f}": "" if v is None else f.format(v)  # noqa: E731
            spread = (
                f" ({min(r['rps'] for r in rs):.0f}-{max(r['rps'] for r in rs):.0f})"
                if len(rs) > 1
                else ""
            )
            lines.append(
                f"| {mode} | {endpoint} | {conc} | {t} | {s['rps']:.0f}{spread} | "
                f"{fmt(s['p50_ms'])} | {fmt(s['p99_ms'])} | {fmt(s['add50'])} | {fmt(s['add99'])} "
                f"| {fmt(s['cpu_s_per_1k'], '{:.3f}')} | {fmt(s['cpu_util'])} |"
            )
        for t in (t for t in stats if t.startswith("pdserve") and "sglang" in stats):
            p, g = stats[t], stats["sglang"]
            ratio = lambda x, y: f"{x / y:.2f}" if x is not None and y and y > 0 else "n/a"  # noqa: E731
            ratios.append(
                f"| {mode} | {endpoint} | {conc} | {t} | {ratio(g['rps'], p['rps'])} "
                f"| {ratio(p['add50'], g['add50'])} | {ratio(p['add99'], g['add99'])} "
                f"| {ratio(p['cpu_s_per_1k'], g['cpu_s_per_1k'])} |"
            )
    return "\n".join(lines) + "\n\n" + "\n".join(ratios)


def machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(
            (ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")),
            "?",
        )
        flags = next(
            (ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Flags")), ""
        )
    except OSError:
        model, flags = platform.processor(), ""
    wanted = [f for f in flags.split() if f.startswith(("avx", "amx")) or f in ("sse4_2", "fma")]
    return (
        f"{model}, {os.cpu_count()} CPUs, flags {' '.join(wanted)}; Python "
        f"{platform.python_version()}"
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--run-fake":
        return run_fake(sys.argv[2], int(sys.argv[3]))
    if len(sys.argv) > 1 and sys.argv[1] == "--run-load":
        return run_load(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="pd,regular")
    ap.add_argument("--endpoints", default="generate,generate-stream,chat-stream")
    ap.add_argument("--concurrency", default="1,64,512")
    ap.add_argument("--duration", type=float, default=5.0, help="measured seconds per run")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--router-cpus", default="1", help="taskset list for the routers ('' to not pin)"
    )
    ap.add_argument("--worker-cpus", default="0", help="taskset list for the fake workers")
    ap.add_argument("--client-cpus", default="0", help="taskset list for the load generator")
    ap.add_argument(
        "--pdserve-workers",
        default="1",
        help="pdserve router process counts (--workers) to run, each a target of its own",
    )
    ap.add_argument(
        "--baseline-tree", default=None, help="a directory holding an older pdserve package"
    )
    ap.add_argument(
        "--baseline-asyncio",
        action="store_true",
        help="run the baseline without uvloop and httptools",
    )
    ap.add_argument("--skip-sglang", action="store_true")
    ap.add_argument("--out", default=None, help="write every run and the summary as JSON here")
    a = ap.parse_args()
    a.modes = a.modes.split(",")
    a.endpoints = a.endpoints.split(",")
    a.concurrency = [int(c) for c in a.concurrency.split(",")]
    a.pdserve_workers = [int(n) for n in a.pdserve_workers.split(",")]
    for e in a.endpoints:
        if e not in BODIES:
            ap.error(f"--endpoints: unknown {e!r}, choose from {', '.join(BODIES)}")
    if not a.skip_sglang:
        import importlib.util

        if importlib.util.find_spec("sglang_router") is None:
            ap.error(
                "sglang-router is not installed (pip install sglang-router==0.3.2), "
                "or pass --skip-sglang"
            )
    sys.path.insert(0, str(ROOT))
    from pdserve import lifetime

    lifetime.handle_stop_signals(
        lifetime.raise_interrupt
    )  # also when started with SIGINT ignored (nohup ... &)
    logs = Path(tempfile.mkdtemp(prefix="router-overhead-"))
    print(f"machine: {machine()}\nlogs: {logs}", flush=True)
    results: list[dict] = []
    bench = Bench(a, logs)
    try:
        for mode in a.modes:
            run_mode(bench, mode, results)
    finally:
        bench.close()
    summary = summarize(results, a)
    print("\n" + summary)
    if a.out:
        Path(a.out).write_text(
            json.dumps(
                {"machine": machine(), "args": vars(a), "runs": results, "summary": summary},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
