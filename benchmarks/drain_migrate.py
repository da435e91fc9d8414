"""Drain time of a decode running long generations: the router's drain waiting for them to end
against ``--drain-migrate`` (its requests move to another decode, KV and all), in one run on
the same servers.

  python benchmarks/drain_migrate.py [--model-path DIR] [--streams 8] [--tokens 400]
      [--backend local] [--json OUT]

Set-up: one prefill, decodes D1 and D2, one torch thread each. Per mode (``wait``, then
``migrate``): a router with the prefill and D1 (``--drain-migrate`` for ``migrate``) gets
``--streams`` greedy /generate streams of ``--tokens`` tokens; once every stream has output, D2
joins the router (``POST /workers``) and D1 is removed (``DELETE /workers``). Reported: the
time from the removal until D1 is gone from the router (the drain), until the last stream
ended, the ratio of the drains, and whether both modes produced the same tokens.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import lscpu_model  # noqa: E402

from tests.helpers import cluster as c  # noqa: E402


def stream(url: str, ids: list[int], tokens: int, out: dict, i: int, progress: list) -> None:
    body = {**c.greedy_body(ids, tokens), "stream": True}
    last = None
    with httpx.stream("POST", url + "/generate", json=body, timeout=900) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                last = json.loads(line[6:])
                progress[i] += 1
    out[i] = (last or {}).get("output_ids")


def run_mode(mode: str, P, D1, D2, logs: Path, a) -> dict:
    extra = ["--drain-migrate"] if mode == "migrate" else []
    R = c.router(f"R-{mode}", [P], [D1], logs, "--drain-timeout", "900", *extra).start()
    try:
        rng = random.Random(7)
        prompts = [[rng.randrange(100, 40000) for _ in range(40)] for _ in range(a.streams)]
        outs: dict = {}
        progress = [0] * a.streams
        threads = [
            threading.Thread(target=stream, args=(R.url, p, a.tokens, outs, i, progress))
            for i, p in enumerate(prompts)
        ]
        for t in threads:
            t.start()
        c.wait_for(lambda: all(n >= 2 for n in progress), 300, "every stream to be going")
        r = httpx.post(
            R.url + "/workers", json={"url": D2.url, "worker_type": "decode"}, timeout=60
        )
        assert r.status_code == 202, r.text
        t0 = time.monotonic()
        at_removal = sum(progress)
        httpx.delete(f"{R.url}/workers/{D1.url}", timeout=30).raise_for_status()

        def gone() -> bool:
            ws = httpx.get(R.url + "/workers", timeout=10).json()["workers"]
            return all(w["url"] != D1.url for w in ws)

        c.wait_for(gone, 900, "the drain", interval=0.05)
        drain_s = time.monotonic() - t0
        for t in threads:
            t.join()
        streams_s = time.monotonic() - t0
        for s in (P, D1, D2):
            s.wait_idle(60)
        return {
            "mode": mode,
            "drain_s": round(drain_s, 3),
            "last_stream_end_s": round(streams_s, 3),
            "events_before_removal": at_removal,
            "outputs": [outs[i] for i in range(a.streams)],
        }
    finally:
        R.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="default: the tests' tiny Llama")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--tokens", type=int, default=400)
    p.add_argument("--backend", default="local")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    model = a.model_path
    if model is None:
        from tests.helpers.checkpoints import build_tiny_checkpoint

        model = build_tiny_checkpoint("llama")
    logs = Path(tempfile.mkdtemp(prefix="drain-migrate-"))
    common = ["--max-total-tokens", "32768", "--disaggregation-transfer-backend", a.backend]
    P, _ = c.prefill("P", model, logs, *common)
    D1 = c.decode("D1", model, logs, *common)
    D2 = c.decode("D2", model, logs, *common)
    try:
        c.start_all((P, D1, D2))
        results = [run_mode(m, P, D1, D2, logs, a) for m in ("wait", "migrate")]
    finally:
        for s in (D2, D1, P):
            s.stop()
    wait, mig = results
    same = wait["outputs"] == mig["outputs"]
    for r in results:
        r.pop("outputs")
    report = {
        "command": " ".join(sys.argv),
        "machine": {"cpu": lscpu_model(), "python": platform.python_version()},
        "streams": a.streams,
        "tokens": a.tokens,
        "backend": a.backend,
        "results": results,
        "drain_ratio_wait_over_migrate": round(wait["drain_s"] / max(mig["drain_s"], 1e-9), 2),
        "same_tokens": same,
    }
    print(json.dumps(report, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
