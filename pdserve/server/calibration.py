"""Start-up calibration: how long this server takes to prefill, measured on itself.

After the warm-up the front end times a one-token generation of a short and of a longer prompt
(random token ids, so no cache hit; the best of three runs each) and fits
``prefill_s(n) = fixed_s + s_per_token * n``. A router that decides per request where to prefill
(``pdserve router --pd-policy conditional``) reads the fit from ``/server_info``
(``calibration``). A prefill server runs the prompts with the warm-up's fake bootstrap host, so
no KV moves; a decode server prefills them locally. The cache is flushed afterwards, so the
prompts leave nothing behind (nor KV events for blocks nobody asked for).
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any, Awaitable, Callable

from pdserve.disagg.fake import fake_bootstrap
from pdserve.server import http_util
from pdserve.server.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

SHORT_TOKENS = 32
LONG_TOKENS = 256
RUNS = 3


async def calibrate(tm: TokenizerManager, flush: Callable[[], Awaitable[Any]]) -> dict:
    """The prefill fit of this server (see the module doc)."""
    capacity = int(tm.client.info.get("max_total_tokens") or LONG_TOKENS * 4)
    long_n = max(SHORT_TOKENS + 1, min(LONG_TOKENS, tm.context_length - 2, capacity // 4))
    short_n = min(SHORT_TOKENS, long_n - 1)
    rng = random.Random(0x5EED)
    times: dict[int, float] = {}
    for n in (short_n, long_n):
        best = float("inf")
        for _ in range(RUNS):
            ids = [rng.randrange(tm.vocab_size) for _ in range(n)]
            best = min(best, await _time_prefill(tm, ids))
        times[n] = best
    per_token = max(0.0, (times[long_n] - times[short_n]) / (long_n - short_n))
    fixed = max(0.0, times[short_n] - per_token * short_n)
    await flush()
    out = {
        "prefill_fixed_s": round(fixed, 6),
        "prefill_s_per_token": round(per_token, 9),
        "measured": {str(n): round(t, 6) for n, t in times.items()},
    }
    logger.info(
        "calibration: prefill takes %.1f ms + %.3f ms/token (%s)",
        fixed * 1e3,
        per_token * 1e3,
        ", ".join(f"{n} tokens {t * 1e3:.1f} ms" for n, t in times.items()),
    )
    return out


async def _time_prefill(tm: TokenizerManager, ids: list[int]) -> float:
    # a decode server prefills locally (no bootstrap fields); a prefill server with the fake host
    bootstrap = fake_bootstrap("prefill") if tm.server_args.disaggregation_mode == "prefill" else {}
    spec = tm.make_spec(
        ids, {"max_new_tokens": 1, "temperature": 0.0}, default_max_new_tokens=1, **bootstrap
    )
    t0 = time.perf_counter()
    state = tm.submit(spec)
    await tm.wait(state)
    http_util.raise_if_failed([state])
    return time.perf_counter() - t0
