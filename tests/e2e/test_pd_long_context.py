"""Long prompts through PD, and liveness that never waits on a forward.

A 32k-token prompt goes through a prefill that computes it in two 16k-token chunks on one core
(each chunk's attention is one kernel call of about a second, a forward takes seconds) and sends
its pages a layer at a time as the forward writes them, into a decode that gives the colocated
server's tokens. Both PD servers run with tight liveness settings (heartbeats every 0.1 s, 3
misses: a peer silent for 0.3 s is dead; a decode waits 2 s for a silent room): the kernels run
without the GIL, so the prefill's I/O thread answers heartbeats during a kernel call, and a thread
of its own sends the rooms' keepalives during a forward. A prefill killed with SIGKILL mid-prompt
still ends its decode's request within a second.
"""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest

from tests.helpers import cluster as c
from tests.helpers import localhttp
from tests.helpers.checkpoints import build_tiny_checkpoint

LONG = 32768
CHUNK = 16384
NEW_TOKENS = 4
SERVE = [
    "--dtype",
    "bfloat16",
    "--torch-num-threads",
    "1",
    "--page-size",
    "16",
    "--max-total-tokens",
    "36000",
    "--chunked-prefill-size",
    str(CHUNK),
    "--max-prefill-tokens",
    str(CHUNK),
]
LIVENESS = [
    "--disaggregation-heartbeat-interval",
    "0.1",
    "--disaggregation-heartbeat-misses",
    "3",
    "--disaggregation-waiting-timeout",
    "2",
    "--disaggregation-bootstrap-timeout",
    "20",
]


@pytest.fixture(scope="module")
def long_pd(tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd-long")
    path = build_tiny_checkpoint("llama", max_position_embeddings=LONG + 1024)
    layer_wise = [
        "--enable-disagg-layer-pipeline",
        "--disagg-layer-pipeline-min-prefill-len",
        "0",
    ]
    yield from c.running(
        {
            "S": c.server("S", path, logs, *SERVE),
            "P": c.prefill("P", path, logs, *SERVE, *LIVENESS, *layer_wise)[0],
            "D": c.decode("D", path, logs, *SERVE, *LIVENESS),
        }
    )


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 30000) for _ in range(LONG)]


def test_a_32k_prompt_through_pd_gives_the_colocated_tokens(long_pd):
    P, D, S = long_pd["P"], long_pd["D"], long_pd["S"]
    ids = prompt(1)
    want = localhttp.post(S.url + "/generate", json=c.greedy_body(ids, NEW_TOKENS), timeout=300)
    assert want.status_code == 200, want.text
    body = c.greedy_body(ids, NEW_TOKENS, P, random.randrange(2**63))
    rp, rd = c.post_pd(P, D, body)
    assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
    assert rd.json()["output_ids"] == want.json()["output_ids"]
    last = P.http.get("/server_info").json()["internal_states"][0]["recent_transfers"][-1]
    assert last["pages_per_group"] == [LONG // 16]
    # each forward's 2 layers go as the second is written (a group of up to 4: the last one)
    assert last["layer_groups"] >= 2, last
    for proc in (P, D, S):
        proc.wait_idle()


def test_a_killed_prefill_ends_its_decode_request_within_a_second(long_pd):
    """(Last: it kills the module's prefill.) The decode hears no heartbeat answer for 0.3 s."""
    P, D = long_pd["P"], long_pd["D"]
    body = c.greedy_body(prompt(2), NEW_TOKENS, P, random.randrange(2**63))
    out: dict = {}

    def run() -> None:
        r = localhttp.post(D.url + "/generate", json=body, timeout=120)
        out["status"], out["text"], out["end"] = r.status_code, r.text, time.monotonic()

    def prefill() -> None:
        try:
            localhttp.post(P.url + "/generate", json=body, timeout=120)
        except httpx.HTTPError:  # killed under it
            pass

    threading.Thread(target=prefill, daemon=True).start()
    waiting = threading.Thread(target=run, daemon=True)
    waiting.start()

    def computing() -> bool:
        r = P.http.get("/debug/integrity")
        if r.status_code == 503:  # a long chunk's forward outlasted the control call's 10 s
            return False
        assert r.status_code == 200, r.text
        return r.json()["integrity"]["running"] == 1

    c.wait_for(computing, 60, "the prefill to compute the prompt")
    time.sleep(0.5)  # inside its first chunk's forward
    killed = time.monotonic()
    P.kill9()
    waiting.join(30)
    assert out["status"] >= 500 and "unreachable" in out["text"], out
    print(f"killed prefill: the decode request ended {out['end'] - killed:.2f} s after")
    assert out["end"] - killed < 1.0, out["end"] - killed
    D.wait_idle()
