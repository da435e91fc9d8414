"""The planner's model (pdserve/plan): closed forms, the direction of its recommendations, fits,
and bad input. Synthetic profiles; no server."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from pdserve.plan import planner, simulate
from pdserve.plan import profile as prof_mod
from pdserve.plan import workload as wl
from pdserve.plan.profile import DecodeFit, PrefillFit, Profile
from pdserve.plan.workload import Lengths, PlanError, Requests


def profile(**kw) -> Profile:
    base = dict(
        prefill=PrefillFit(0.01, 0.001),
        decode=DecodeFit(0.02, 0.001, 1e-6),
        kv_bytes_per_token=20000,
        kv_bandwidth=2e9,
        max_total_tokens=1 << 20,
        request_overhead_s=0.002,
        pd_overhead_s=0.005,
    )
    return Profile(**{**base, **kw})


def spaced(n: int, prompt: int, output: int, gap: float = 100.0) -> Requests:
    """Requests far enough apart that none waits for another."""
    return Requests(np.arange(n) * gap, np.full(n, prompt), np.full(n, output))


def test_alone_closed_form_colocated_and_pd():
    """A request alone: TTFT = path + prefill (+ transfer and PD overhead), TPOT = the mean of its
    decode steps, whose context grows by one token per step."""
    p = profile()
    n, m = 300, 50
    reqs = spaced(5, n, m)
    tpot = (
        p.decode.fixed_s
        + p.decode.s_per_request
        + p.decode.s_per_context_token * (n + 1 + (m - 2) / 2)
    )
    col = simulate.colocated(p, 1, reqs, float("inf"))
    assert np.allclose(col.ttft, p.request_overhead_s + p.prefill.time(n))
    assert np.allclose(col.tpot, tpot)
    pd = simulate.disaggregated(p, p, 1, 1, reqs, float("inf"))
    transfer = n * p.kv_bytes_per_token / p.kv_bandwidth
    assert np.allclose(
        pd.ttft, p.request_overhead_s + p.prefill.time(n) + transfer + p.pd_overhead_s
    )
    assert np.allclose(pd.tpot, tpot)
    # a hybrid also moves a fixed-size state per request
    h = profile(kv_bytes_per_request=40_000_000)
    hpd = simulate.disaggregated(h, h, 1, 1, reqs, float("inf"))
    assert np.allclose(hpd.ttft, pd.ttft + 40_000_000 / h.kv_bandwidth)


def test_goodput_counts_requests_meeting_both_slos_over_the_span():
    p = profile()
    w = wl.make(
        {
            "request_rate": 0.01,
            "input_len": 300,
            "output_len": 50,
            "slo_ttft_ms": 1000,
            "slo_tpot_ms": 100,
            "num_requests": 20,
        }
    )
    pred = planner.evaluate(planner.Candidate(0, 0, 1, d_prof=p), w, 0.01)
    reqs = w.requests()
    e2e = p.prefill.time(300) + 49 * (p.decode.step_s(1, 0)) + p.request_overhead_s
    span = reqs.arrivals[-1] + e2e  # the last request ends a little after this (its context grows)
    assert pred.share == 1.0
    assert pred.goodput == pytest.approx(20 / span, rel=1e-3)
    # a TPOT SLO below the decode step: nobody meets it
    strict = wl.make(
        {
            **{"request_rate": 0.01, "input_len": 300, "output_len": 50, "num_requests": 20},
            "slo_tpot_ms": 10,
        }
    )
    assert planner.evaluate(planner.Candidate(0, 0, 1, d_prof=p), strict, 0.01).goodput == 0


def test_prefill_queue_matches_md1():
    """One prefill server taking one prompt per forward is an M/D/1 queue: mean wait
    rho S / (2 (1 - rho)) (Pollaczek-Khinchine), S the prefill time."""
    n = 500
    p = profile(
        max_prefill_tokens=n,
        chunked_prefill_size=n,
        kv_bandwidth=1e15,
        pd_overhead_s=0.0,
        request_overhead_s=0.0,
        decode=DecodeFit(1e-6, 0.0, 0.0),
    )
    service = p.prefill.time(n)
    for rho in (0.5, 0.8):
        rate = rho / service
        w = wl.make(
            {
                "request_rate": rate,
                "input_len": n,
                "output_len": 1,
                "num_requests": 20000,
                "seed": 3,
            }
        )
        res = simulate.disaggregated(p, p, 1, 1, w.requests(), float("inf"))
        wait = rho * service / (2 * (1 - rho))
        assert res.ttft.mean() == pytest.approx(wait + service, rel=0.08), rho


def test_decode_runs_give_the_same_result_as_single_forwards(monkeypatch):
    """Decode-only forwards simulated as one event per run are the same as one per forward,
    also when arrivals cut runs (colocated and PD, chunked prompts, a tight KV pool)."""
    p = profile(max_total_tokens=6000, chunked_prefill_size=256, max_prefill_tokens=512)
    w = wl.make(
        {
            "request_rate": 3,
            "input_len": "50-900",
            "output_len": "1-120",
            "num_requests": 150,
            "seed": 5,
        }
    )
    reqs = w.requests()
    runs = [
        simulate.colocated(p, 2, reqs, float("inf")),
        simulate.disaggregated(p, p, 1, 2, reqs, float("inf")),
    ]
    monkeypatch.setattr(simulate.Server, "runs", False)
    steps = [
        simulate.colocated(p, 2, reqs, float("inf")),
        simulate.disaggregated(p, p, 1, 2, reqs, float("inf")),
    ]
    for a, b in zip(runs, steps):
        assert not np.isnan(a.finish).any()
        for x, y in ((a.ttft, b.ttft), (a.finish, b.finish)):
            assert np.allclose(x, y, rtol=0, atol=1e-9)


def best_pd_prefills(prompt: str, budget: int = 6) -> int:
    """Prefill servers in the PD split that sustains the highest rate."""
    p = profile(prefill=PrefillFit(0.01, 0.0005), decode=DecodeFit(0.02, 0.002, 2e-6))
    w = wl.make(
        {
            "input_len": prompt,
            "output_len": "64-128",
            "slo_ttft_ms": 2000,
            "slo_tpot_ms": 60,
            "num_requests": 200,
        }
    )
    preds = [x for x in planner.plan(w, budget, [p], [p]) if not x.candidate.colocated]
    return preds[0].candidate.prefill


def test_longer_prompts_move_the_split_toward_prefill():
    counts = [best_pd_prefills(prompt) for prompt in ("16-64", "256-512", "1024-2048")]
    assert counts == sorted(counts), counts
    assert counts[-1] > counts[0], counts


def test_candidates_fill_the_budget_and_offer_no_single_role_split():
    p1, p2 = profile(), profile(tp_size=2)
    labels = {c.label for c in planner.candidates(4, [p1], [p1])}
    assert labels == {"4 colocated", "1P3D", "2P2D", "3P1D"}
    mixed = {
        (c.prefill, c.decode, c.colocated, c.units)
        for c in planner.candidates(4, [p1, p2], [p1, p2])
    }
    assert (2, 1, 0, 4) in mixed  # two TP-1 prefills and one TP-2 decode
    assert all(units <= 4 for *_, units in mixed)
    assert all(c.colocated or (c.prefill and c.decode) for c in planner.candidates(3, [p1], [p1]))
    with pytest.raises(PlanError, match="budget"):
        planner.candidates(1, [p2], [p2])


def test_recommendation_without_rate_ranks_by_max_rate():
    p = profile()
    w = wl.make(
        {
            "input_len": "100-200",
            "output_len": 32,
            "slo_ttft_ms": 2000,
            "slo_tpot_ms": 80,
            "num_requests": 100,
        }
    )
    preds = planner.plan(w, 2, [p], [p])
    assert all(x.goodput is None and x.max_rate is not None for x in preds)
    assert preds[0].max_rate == max(x.max_rate for x in preds)
    # max rate: the share meets the attainment there and not at twice the rate
    best = preds[0]
    assert planner.evaluate(best.candidate, w, best.max_rate).share >= 0.9
    assert planner.evaluate(best.candidate, w, best.max_rate * 2).share < 0.9


def test_fits_recover_their_coefficients():
    true = PrefillFit(0.01, 0.001, 2e-7)
    got = PrefillFit.fit({n: true.time(n) for n in (32, 256, 1024)})
    assert (got.fixed_s, got.s_per_token, got.s_per_token2) == pytest.approx(
        (0.01, 0.001, 2e-7), rel=1e-6
    )
    linear = PrefillFit.fit({32: 0.042, 256: 0.266})
    assert (linear.fixed_s, linear.s_per_token, linear.s_per_token2) == pytest.approx(
        (0.01, 0.001, 0.0)
    )
    d = DecodeFit(0.02, 0.0005, 1e-6)
    pts = [(b, b * c, d.step_s(b, b * c)) for b, c in ((1, 40), (8, 40), (32, 40), (4, 520))]
    got = DecodeFit.fit(pts)
    assert (got.fixed_s, got.s_per_request, got.s_per_context_token) == pytest.approx(
        (0.02, 0.0005, 1e-6), rel=1e-6
    )
    # noise (a longer prompt measured faster) gives no negative term: the n^2 term goes first
    noisy_prefill = PrefillFit.fit({32: 0.0539, 256: 0.0515, 512: 0.0724})
    assert (
        noisy_prefill.s_per_token > 0
        and noisy_prefill.s_per_token2 == 0
        and noisy_prefill.fixed_s > 0
    )
    # a coefficient the noise makes negative is dropped, not kept below zero
    noisy = DecodeFit.fit([(1, 40, 0.03), (8, 320, 0.029), (32, 1280, 0.031)])
    assert min(noisy.fixed_s, noisy.s_per_request, noisy.s_per_context_token) >= 0


def test_lengths_and_bench_draws():
    assert Lengths.parse("x", 5) == Lengths(5, 5)
    assert Lengths.parse("x", "256-512") == Lengths(256, 512)
    assert Lengths.parse("x", {"uniform": [2, 9]}) == Lengths(2, 9)
    assert Lengths.parse("x", [3, 1, 2]).values == (3, 1, 2)
    assert Lengths.parse("x", "3,1,2").values == (3, 1, 2)
    # the same lengths and arrivals as pdserve bench's random dataset under the same seed
    from pdserve.bench.datasets import sample_lengths
    from pdserve.bench.serving import poisson_arrivals

    w = wl.make(
        {
            "request_rate": 2,
            "input_len": "256-512",
            "output_len": "64-128",
            "num_requests": 50,
            "seed": 7,
        }
    )
    reqs = w.requests()
    rng = np.random.default_rng(7)
    assert list(reqs.prompts) == list(sample_lengths(rng, 50, 512, 0.5))
    assert list(reqs.outputs) == list(sample_lengths(rng, 50, 128, 0.5))
    assert list(reqs.arrivals) == poisson_arrivals(50, 2, 7)


@pytest.mark.parametrize(
    "values, match",
    [
        ({"input_len": "512-256", "output_len": 8}, "input_len: need 1 <= LOW <= HIGH"),
        ({"input_len": "abc", "output_len": 8}, "input_len: 'abc' is not a whole number"),
        ({"input_len": 8, "output_len": 0}, "output_len: need 1 <= LOW"),
        ({"input_len": 8}, "output_len: required"),
        (
            {"input_len": 8, "output_len": 8, "request_rate": -1},
            "request_rate: must be a finite number > 0",
        ),
        ({"input_len": 8, "output_len": 8, "slo_ttft_ms": 0}, "slo_ttft_ms: must be > 0"),
        ({"input_len": 8, "output_len": 8, "num_requests": 3}, "num_requests: must be >= 10"),
        ({"input_len": True, "output_len": 8}, "input_len: expected a length"),
    ],
)
def test_bad_workload_names_the_field(values, match):
    with pytest.raises(PlanError, match=match):
        wl.make(values)


def test_bad_files_name_the_problem(tmp_path):
    f = tmp_path / "w.yaml"
    f.write_text("request_rate: 2\ninput_len: 128\noutput_len: 16\nslo_ttft: 100\n")
    with pytest.raises(PlanError, match="unknown key.*slo_ttft"):
        wl.load_file(f)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(PlanError, match="not valid JSON"):
        wl.load_file(tmp_path / "bad.json")
    with pytest.raises(PlanError, match="No such file"):
        wl.load_file(tmp_path / "missing.json")
    cal = profile().to_json()
    for broken, match in (
        ({**cal, "version": 99}, "version 99"),
        ({k: v for k, v in cal.items() if k != "decode"}, "missing decode"),
        ({**cal, "kv_bandwidth": 0}, "kv_bandwidth must be a number > 0"),
        ({**cal, "speed": 1}, "unknown key.*speed"),
    ):
        (tmp_path / "cal.json").write_text(json.dumps(broken))
        with pytest.raises(PlanError, match=match):
            prof_mod.load(tmp_path / "cal.json")
    (tmp_path / "cal.json").write_text(json.dumps(cal))
    assert prof_mod.load(tmp_path / "cal.json") == profile()


def test_cli_plans_from_a_calibration_file(tmp_path, capsys):
    """The command on a file: --json, the table (through ``pdserve plan``), errors with exit code
    2."""
    from pdserve.plan import cli

    prof_mod.save(profile(), tmp_path / "cal.json")
    w = tmp_path / "w.json"
    w.write_text(
        json.dumps(
            {
                "request_rate": 1,
                "input_len": "100-300",
                "output_len": 32,
                "slo_ttft_ms": 2000,
                "slo_tpot_ms": 100,
                "num_requests": 100,
            }
        )
    )
    args = ["--calibration", str(tmp_path / "cal.json"), "--workload", str(w), "--budget", "3"]
    assert cli.main(args + ["--json", "--no-max-rate"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {c["split"] for c in data["candidates"]} == {"3 colocated", "1P2D", "2P1D"}
    assert data["recommended"] == data["candidates"][0]
    assert data["recommended"]["goodput"] > 0 and data["recommended"]["max_rate"] is None
    assert cli.main(args[:-2] + ["--budget", "3", "--input-len", "9-1"]) == 2
    assert "input_len: need 1 <= LOW <= HIGH" in capsys.readouterr().err
    assert cli.main(["--input-len", "9", "--output-len", "9", "--budget", "2"]) == 2
    assert "calibration: give --calibration FILE" in capsys.readouterr().err
    assert cli.main(args[:-2]) == 2
    assert "budget: required" in capsys.readouterr().err
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "plan", *args, "--output-len", "16"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "**recommended**" in out.stdout and "TTFT p50/p90/p99 ms" in out.stdout
    rows = [ln.split("|")[1].strip() for ln in out.stdout.splitlines() if ln.startswith("| ")][1:]
    assert {r.replace(" **recommended**", "") for r in rows} == {"3 colocated", "1P2D", "2P1D"}
