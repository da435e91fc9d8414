"""Expert load accounting and expert placement end to end on the tiny Qwen3-MoE (8 experts, top
2, layers 0 and 2 sparse): a ``--tp-size 2 --ep-size 2`` server records a distribution whose
counts are what HF's router picks for the tokens the model ran through (prompt + generated but
the last) and agree with its /metrics; the placement computed from it with 2 redundant experts
is expected to balance the ranks at least as well; a server started with that placement (and
the all-to-all backend, where every rank counts its own share) serves the offline engine's
greedy tokens, records the same counts, and leaks nothing. A placement file for another model
stops a server at start-up, naming the flag."""

from __future__ import annotations

import json
import random

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from pdserve.layers.moe.eplb import expected_imbalance
from pdserve.layers.moe.placement import imbalance
from pdserve.layers.moe.placement_file import main as placement_main
from tests.e2e.test_engine import make_engine
from tests.helpers import cluster as c
from tests.helpers.checkpoints import build_tiny_checkpoint

torch.set_num_threads(1)

NEW_TOKENS = 4
MOE_LAYERS = (0, 2)
NUM_EXPERTS = 8
COMMON = [
    "--dtype",
    "float32",
    "--tp-size",
    "2",
    "--ep-size",
    "2",
    "--disable-radix-cache",
    "--skip-warmup",
    "--max-total-tokens",
    "4096",
    "--expert-distribution-recorder-mode",
    "stat",
]
SAMPLING = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(100, 40000) for _ in range(n)] for n in (9, 23, 5, 31)]


@pytest.fixture(scope="module")
def path() -> str:
    return build_tiny_checkpoint("qwen3_moe")


@pytest.fixture(scope="module")
def reference(path) -> list[list[int]]:
    eng = make_engine(path, dtype="float32")
    try:
        outs = eng.generate(input_ids=prompts(), sampling_params=SAMPLING)
        eng.check_integrity()
        return [o["output_ids"] for o in outs]
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def hf_counts(path, reference) -> dict[int, list[int]]:
    """Tokens per expert HF's router picks for every token the server ran (each top-2 pick 1)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    counts = {layer: torch.zeros(NUM_EXPERTS, dtype=torch.int64) for layer in MOE_LAYERS}

    def count(layer: int):
        def hook(module, inputs, out) -> None:  # out: (logits, weights, top-k expert ids)
            counts[layer] += torch.bincount(out[2].reshape(-1), minlength=NUM_EXPERTS)

        return hook

    hooks = [
        hf.model.layers[layer].mlp.gate.register_forward_hook(count(layer)) for layer in MOE_LAYERS
    ]
    with torch.no_grad():
        for ids, out in zip(prompts(), reference):
            hf(torch.tensor([ids + out[:-1]]))  # the last generated token is never fed back
    for h in hooks:
        h.remove()
    return {layer: v.tolist() for layer, v in counts.items()}


def expert_metrics(proc: c.Proc) -> tuple[dict[tuple[int, int], float], dict[int, float]]:
    text = proc.http.get("/metrics").text
    tokens, gauge = {}, {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "pdserve:moe_expert_tokens_total":
                tokens[(int(s.labels["layer"]), int(s.labels["expert"]))] = s.value
            elif s.name == "pdserve:moe_expert_imbalance":
                gauge[int(s.labels["layer"])] = s.value
    return tokens, gauge


def run_recorded(proc: c.Proc) -> tuple[list[list[int]], dict, tuple, tuple]:
    """Greedy outputs of the prompts inside a record window; the dump and /metrics around it."""
    assert proc.http.post("/start_expert_distribution_record").status_code == 200
    before = expert_metrics(proc)
    outs = []
    for ids in prompts():
        r = proc.http.post("/generate", json={"input_ids": ids, "sampling_params": SAMPLING})
        assert r.status_code == 200, r.text
        outs.append(r.json()["output_ids"])
    assert proc.http.get("/stop_expert_distribution_record").status_code == 200
    after = expert_metrics(proc)
    r = proc.http.post("/dump_expert_distribution_record")
    assert r.status_code == 200, r.text
    return outs, r.json(), before, after


@pytest.fixture(scope="module")
def recorded(path, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("moe-recorded")
    bad = log_dir / "other-model.json"
    bad.write_text(
        json.dumps(
            {"num_experts": 4, "physical_to_logical_map": {"0": [0, 1, 2, 3], "2": [0, 1, 2, 3]}}
        )
    )
    server = c.server("recording", path, log_dir, *COMMON)
    refused = c.server(
        "refused", path, log_dir, "--skip-warmup", "--init-expert-location", str(bad)
    )
    try:
        refused.start(wait=False)
        server.start()
        outs, dump, before, after = run_recorded(server)
        again = server.http.get(
            "/dump_expert_distribution_record"
        ).json()  # the dump began a new window
        server.wait_idle()
        code = refused.proc.wait(timeout=120)
    finally:
        server.stop()
        refused.stop()
    yield {
        "outs": outs,
        "dump": dump,
        "before": before,
        "after": after,
        "again": again,
        "refused": (code, refused.log_tail(200)),
        "log_dir": log_dir,
    }


def test_recorded_counts_are_hf_routers_choices(recorded, reference, hf_counts):
    assert recorded["outs"] == reference
    dump = recorded["dump"]
    assert (dump["architecture"], dump["num_layers"], dump["num_experts"], dump["moe_layers"]) == (
        "Qwen3MoeForCausalLM",
        3,
        NUM_EXPERTS,
        list(MOE_LAYERS),
    )
    assert dump["logical_count"][0] == hf_counts[0] and dump["logical_count"][2] == hf_counts[2]
    assert dump["logical_count"][1] == [0] * NUM_EXPERTS  # the dense layer
    tokens = sum(len(p) + NEW_TOKENS - 1 for p in prompts())
    assert (
        sum(dump["logical_count"][0]) == 2 * tokens
    )  # counted once over the two ranks, top 2 each
    assert dump["rank_load"]["0"] == [
        sum(hf_counts[0][:4]),
        sum(hf_counts[0][4:]),
    ]  # trivial: 4 experts a rank
    assert sum(sum(row) for row in recorded["again"]["logical_count"]) == 0


def test_metrics_agree_with_the_dump(recorded):
    (tokens0, _), (tokens1, gauge) = recorded["before"], recorded["after"]
    dump = recorded["dump"]
    assert set(tokens1) == {
        (layer, e) for layer in MOE_LAYERS for e in range(NUM_EXPERTS)
    }  # bounded labels
    for layer in MOE_LAYERS:
        totals = [tokens1[(layer, e)] for e in range(NUM_EXPERTS)]
        assert [t - tokens0.get((layer, e), 0) for e, t in enumerate(totals)] == dump[
            "logical_count"
        ][layer]
        assert gauge[layer] == pytest.approx(
            imbalance([sum(totals[:4]), sum(totals[4:])]), rel=1e-4
        )


def test_start_up_refuses_a_placement_of_another_model(recorded):
    code, log = recorded["refused"]
    assert code != 0
    assert (
        "--init-expert-location" in log
        and "made for another model: num_experts 4, this model has 8" in log
    )


@pytest.fixture(scope="module")
def placement(recorded) -> str:
    out = recorded["log_dir"] / "placement.json"
    src = recorded["log_dir"] / "dump.json"
    src.write_text(json.dumps(recorded["dump"]))
    assert (
        placement_main(
            [
                "--distribution",
                str(src),
                "--ep-size",
                "2",
                "--num-redundant-experts",
                "2",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    return str(out)


def test_placement_from_the_record_balances_the_ranks_no_worse(recorded, placement):
    doc = json.loads(open(placement).read())
    for layer in MOE_LAYERS:
        row = doc["physical_to_logical_map"][str(layer)]
        assert len(row) == NUM_EXPERTS + 2 and set(row) == set(range(NUM_EXPERTS))
        counts = [float(x) for x in recorded["dump"]["logical_count"][layer]]
        assert (
            expected_imbalance(row, counts, 2) <= recorded["dump"]["imbalance"][str(layer)] + 1e-9
        )


def test_server_with_the_placement_serves_the_same_tokens(
    path, placement, reference, hf_counts, tmp_path_factory
):
    log_dir = tmp_path_factory.mktemp("moe-placed")
    server = c.server(
        "placed",
        path,
        log_dir,
        *COMMON,
        "--moe-a2a-backend",
        "torch",
        "--init-expert-location",
        placement,
        "--ep-num-redundant-experts",
        "2",
    )
    try:
        server.start()
        outs, dump, _, (tokens, _) = run_recorded(server)
        assert outs == reference
        # every rank counted its own share of the tokens; the sum is HF's again
        assert dump["logical_count"][0] == hf_counts[0] and dump["logical_count"][2] == hf_counts[2]
        placed = json.loads(open(placement).read())["physical_to_logical_map"]
        assert dump["last_physical_to_logical_map"] == placed and dump["num_redundant_experts"] == 2
        assert {layer for layer, _ in tokens} == set(MOE_LAYERS)
        pools = server.wait_idle()
        assert pools["in_use_pages"] == 0
    finally:
        server.stop()
    assert server.proc.returncode == 0, server.log_tail()
