"""The conditional PD decision from the servers' calibrations, loads and cached prefixes."""

from __future__ import annotations

from pdserve.router.args import RouterArgs
from pdserve.router.kv_index import PromptBlocks
from pdserve.router.pd_policy import LOCAL, PD, PDPolicy, add_to_meta_event, add_to_meta_json
from pdserve.router.workers import Worker


class _Index:
    def __init__(self, held: dict):
        self.held = held

    def matched_tokens(self, worker, prompt):
        return self.held.get(worker.url, 0), 0


def pair(prefill_fit=(0.01, 1e-4), decode_fit=(0.01, 1e-4)):
    p, d = Worker("http://p:1", "prefill", 8998), Worker("http://d:1", "decode")
    p.info = {
        "calibration": {"prefill_fixed_s": prefill_fit[0], "prefill_s_per_token": prefill_fit[1]}
    }
    d.info = {
        "calibration": {"prefill_fixed_s": decode_fit[0], "prefill_s_per_token": decode_fit[1]},
        "scheduler_info": {"kv_bytes_per_token": 100_000},
    }
    for w in (p, d):
        w.polled_load, w.in_flight_at_poll = (0, 0), 0
    return p, d


def policy(held=None, **kw) -> PDPolicy:
    args = RouterArgs(
        prefill=[("http://p:1", 8998)], decode=["http://d:1"], pd_policy="conditional", **kw
    )
    return PDPolicy(args, _Index(held or {}))


def test_short_prompt_idle_decode_is_local_long_prompt_goes_through_prefill():
    p, d = pair()
    short, long = PromptBlocks(list(range(50))), PromptBlocks(list(range(2000)))
    got = policy().decide(short, p, d, batch=False)
    assert (got.mode, got.reason) == (LOCAL, "faster_local")
    # local saves the transfer (50 x 100 kB at 1 GB/s) and the overhead
    assert abs(got.ttft_pd_s - got.ttft_local_s - (50 * 100_000 / 1e9 + 0.005)) < 1e-9
    assert policy().decide(long, p, d, batch=False).reason == "too_long"
    assert policy().decide(short, p, d, batch=True).reason == "batch"
    assert policy().decide(None, p, d, batch=False).reason == "prompt_unknown"


def test_a_hybrids_fixed_state_is_part_of_the_transfer_time():
    """A hybrid's decode moves per-token pages (its attention layers) plus a fixed-size state:
    the router charges both."""
    p, d = pair()
    d.info["scheduler_info"] = {"kv_bytes_per_token": 10_000, "kv_bytes_per_request": 20_000_000}
    got = policy().decide(PromptBlocks(list(range(50))), p, d, batch=False)
    transfer = (50 * 10_000 + 20_000_000) / 1e9
    assert abs(got.ttft_pd_s - got.ttft_local_s - (transfer + 0.005)) < 1e-9


def test_busy_decode_slow_decode_busy_prefill_and_cached_prefixes():
    p, d = pair()
    prompt = PromptBlocks(list(range(400)))
    assert policy().decide(prompt, p, d, batch=False).mode == LOCAL
    d.polled_load = (30, 9000)  # 30 streams would stall while decode prefills 400 tokens
    busy = policy().decide(prompt, p, d, batch=False)
    assert (busy.mode, busy.reason) == (PD, "faster_pd") and busy.itl_penalty_s > 0
    # decode holding all but 20 tokens of the prompt makes the local prefill short: worth the
    # 30 streams' stall when the stall weighs less than the TTFT (--pd-itl-weight 0.1), not at 1
    cached = policy(held={d.url: 380}, pd_itl_weight=0.1).decide(prompt, p, d, batch=False)
    assert cached.mode == LOCAL and cached.decode_cached_tokens == 380
    assert policy(held={d.url: 380}).decide(prompt, p, d, batch=False).mode == PD
    d.polled_load = (0, 0)
    p2, d2 = pair(decode_fit=(0.5, 1e-3))  # a much slower decode prefill
    assert policy().decide(prompt, p2, d2, batch=False).mode == PD
    p.polled_load = (20, 20_000)  # a long prefill queue makes local worth it even for long prompts
    assert (
        policy(pd_local_max_tokens=4096)
        .decide(PromptBlocks(list(range(1000))), p, d, batch=False)
        .mode
        == LOCAL
    )
    # flags override the calibration; no calibration and no flags: PD
    d.info = {}
    assert policy().decide(prompt, p, d, batch=False).reason == "no_calibration"
    assert (
        policy(pd_prefill_fixed_s=0.01, pd_prefill_s_per_token=1e-4)
        .decide(prompt, p, d, batch=False)
        .mode
        == LOCAL
    )
    assert (
        PDPolicy(RouterArgs(prefill=[("http://p:1", 1)], decode=["http://d:1"]), None)
        .decide(prompt, p, d, batch=False)
        .reason
        == "always"
    )


def test_decision_goes_into_meta_info():
    meta = {"mode": "local"}
    assert b'"pd_decision": {"mode": "local"}' in add_to_meta_json(
        b'{"text": "a", "meta_info": {"id": "x"}}', meta
    )
    event = b'data: {"text": "a", "meta_info": {"finish_reason": null}}\n\n'
    assert add_to_meta_event(event, meta) == event  # not finished: unchanged
    last = add_to_meta_event(
        b'data: {"text": "ab", "meta_info": {"finish_reason": {"type": "length"}}}\n\n', meta
    )
    assert b"pd_decision" in last
