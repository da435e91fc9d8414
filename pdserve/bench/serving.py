"""``pdserve bench``: serving benchmark against an HTTP endpoint, with bench_serving's flags.

    pdserve bench --backend sglang --base-url http://127.0.0.1:30000 --num-prompts 64 \\
        --random-input-len 128 --random-output-len 64 --request-rate 4 --output-file run.json
    pdserve bench plot run.json [more.json ...] --output runs.png

Sessions (one request each, except multi-turn generated-shared-prefix) arrive as a Poisson
process of ``--request-rate`` per second; turns of a session follow each other. At most
``--max-concurrency`` requests are in flight. Warm-up requests are not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import sys
import time
from contextlib import nullcontext
from typing import Any, Optional

import aiohttp
import numpy as np
from tqdm import tqdm

from pdserve.bench import datasets
from pdserve.bench.backends import ENDPOINTS, RequestOptions, send_request
from pdserve.bench.datasets import BenchRequest
from pdserve.bench.metrics import RequestRecord, format_summary, summarize

logger = logging.getLogger(__name__)


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets in seconds: the first at 0, then exponential gaps of mean 1 / rate;
    all 0 for an infinite rate."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"request_rate: must be > 0, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pdserve bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--backend", choices=sorted(ENDPOINTS), default="sglang")
    p.add_argument("--base-url", default=None, help="overrides --host/--port")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--model", default=None, help="default: the first model of /v1/models")
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="sessions per second (Poisson); inf sends all at once",
    )
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--disable-stream", action="store_true")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly the output length")
    p.add_argument("--extra-request-body", default=None, help="JSON merged into every request")
    p.add_argument("--request-timeout", type=float, default=6 * 3600.0, help="seconds")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--output-file", default=None, help="JSON with args, summary and records")
    datasets.add_args(p)
    args = p.parse_args(argv)
    if args.base_url is None:
        args.base_url = f"http://{args.host}:{args.port}"
    args.base_url = args.base_url.rstrip("/")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error(f"--max-concurrency: must be >= 1, got {args.max_concurrency}")
    if args.warmup_requests < 0:
        p.error(f"--warmup-requests: must be >= 0, got {args.warmup_requests}")
    if args.extra_request_body:
        args.extra_request_body = json.loads(args.extra_request_body)
    return args


async def fetch_model(session: aiohttp.ClientSession, base_url: str) -> Optional[str]:
    try:
        async with session.get(base_url + "/v1/models") as resp:
            if resp.status != 200:
                return None
            data = (await resp.json(content_type=None)).get("data") or []
            return data[0]["id"] if data else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError):
        return None


async def run_requests(
    session: aiohttp.ClientSession,
    args: argparse.Namespace,
    requests: list[BenchRequest],
    opts: RequestOptions,
) -> tuple[list[RequestRecord], float]:
    """Send ``requests``; returns their records (in the order of ``requests``) and the duration."""
    sessions: dict[int, list[int]] = {}
    for i, req in enumerate(requests):
        sessions.setdefault(req.session, []).append(i)
    arrivals = poisson_arrivals(len(sessions), args.request_rate, args.seed)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    records: list[Optional[RequestRecord]] = [None] * len(requests)
    pbar = tqdm(total=len(requests), disable=args.disable_tqdm)
    start = time.perf_counter()

    async def run_session(indices: list[int], at: float) -> None:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        history, prev = None, -1  # multi-turn: the conversation so far, and its last turn
        for i in sorted(indices, key=lambda i: requests[i].turn):
            req = requests[i]
            if req.follows_history and history is not None:
                await asyncio.sleep(req.think_time)
                req = dataclasses.replace(
                    req,
                    prompt=history + req.prompt,
                    prompt_len=req.prompt_len + records[prev].prompt_len + records[prev].output_len,
                )
            async with sem if sem is not None else nullcontext():
                rec = await send_request(session, args.backend, args.base_url, req, opts)
            rec.start_time -= start
            records[i] = rec
            pbar.update(1)
            if not rec.success:
                break  # the conversation cannot go on without this answer
            history, prev = req.prompt + rec.generated, i
        for i in indices:  # turns never sent after a failure count as failed
            if records[i] is None:
                records[i] = RequestRecord(
                    error="an earlier turn of the conversation failed",
                    prompt_len=requests[i].prompt_len,
                    session=requests[i].session,
                    turn=requests[i].turn,
                )

    await asyncio.gather(*(run_session(idx, at) for idx, at in zip(sessions.values(), arrivals)))
    duration = time.perf_counter() - start
    pbar.close()
    return [r for r in records if r is not None], duration


def _jsonable(x: Any) -> Any:
    """Strict JSON: infinities become the string "inf", NaN becomes null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


async def benchmark(args: argparse.Namespace, requests: list[BenchRequest]) -> Optional[dict]:
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=0)  # the default pool (100) would cap concurrency
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = args.model or await fetch_model(session, args.base_url)
        if model is None and args.backend != "sglang":
            logger.error("no --model given and %s/v1/models did not name one", args.base_url)
            return None
        opts = RequestOptions(
            model=model,
            ignore_eos=args.ignore_eos,
            stream=not args.disable_stream,
            extra_body=args.extra_request_body or {},
        )
        if args.warmup_requests:
            warm = [requests[i % len(requests)] for i in range(args.warmup_requests)]
            recs = await asyncio.gather(
                *(send_request(session, args.backend, args.base_url, r, opts) for r in warm)
            )
            if not any(r.success for r in recs):
                logger.error("all warm-up requests failed: %s", recs[0].error)
                return None
        records, duration = await run_requests(session, args, requests, opts)
    summary = summarize(records, duration, args.slo_ttft_ms, args.slo_tpot_ms)
    info = {
        "Backend": args.backend,
        "Model": model or "-",
        "Traffic request rate": args.request_rate,
        "Max request concurrency": args.max_concurrency or "not set",
    }
    print(format_summary(summary, info))
    return {
        "args": {**vars(args), "model": model},
        "summary": summary,
        "records": [
            {**{k: v for k, v in vars(r).items() if k != "generated"}, "tpot": r.tpot}
            for r in records
        ],
    }


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plot":
        from pdserve.bench import plot

        return plot.main(argv[1:])
    args = parse_args(argv)
    if not logging.getLogger().handlers:
        from pdserve.log import setup_logging

        setup_logging("bench")
    tokenizer = datasets.load_tokenizer(args.tokenizer) if args.tokenizer else None
    try:
        requests = datasets.get_dataset(args, tokenizer)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    if not requests:
        logger.error("the dataset produced no requests")
        return 2
    result = asyncio.run(benchmark(args, requests))
    if result is None:
        return 1
    if args.output_file:
        with open(args.output_file, "w", encoding="utf-8") as f:
            json.dump(_jsonable(result), f, allow_nan=False)
        logger.info("wrote %s", args.output_file)
    return 0 if result["summary"]["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
