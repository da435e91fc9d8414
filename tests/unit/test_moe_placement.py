"""Expert placement and load accounting of MoE layers: the balancer (``eplb.py``) against
brute-force and simple references, ``to_physical``'s spread over copies, ``--init-expert-location``
files and their errors, the recorder's windows, the per-rank gather and the load metrics, and a
tiny Qwen3-MoE loaded with copies of its experts."""

from __future__ import annotations

import itertools
import json
import random
from types import SimpleNamespace

import msgspec
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from pdserve.layers.moe.eplb import (
    balance_layer,
    expected_imbalance,
    expected_rank_loads,
    replicate,
)
from pdserve.layers.moe.placement import ExpertPlacement, MoEModelInfo, imbalance, to_physical
from pdserve.layers.moe.placement_file import initial_placement, placement_rows
from pdserve.layers.moe.placement_file import main as placement_main
from pdserve.layers.moe.recorder import ExpertRecorder
from pdserve.server import expert_api

torch.set_num_threads(1)

INFO = MoEModelInfo("Qwen3MoeForCausalLM", 3, 8, (0, 2))  # the tiny checkpoint's shape
SKEWED = [1000.0, 900.0, 10.0, 10.0, 10.0, 10.0, 10.0, 10.0]


def trivial_row(num_experts: int, num_slots: int) -> list[int]:
    return ExpertPlacement.trivial(
        [0], num_experts, 1, num_slots - num_experts
    ).physical_to_logical[0]


# ---- the balancer ---------------------------------------------------------------------------
def test_replicate_gives_each_copy_to_the_highest_load_per_copy():
    assert replicate([100, 10, 10, 10], 6, ep_size=4) == [3, 1, 1, 1]  # 100 -> 50 -> 33 still ahead
    assert replicate([100, 10, 10, 10], 6, ep_size=2) == [
        2,
        2,
        1,
        1,
    ]  # no third copy over two ranks
    assert replicate([0, 0, 0, 0], 6, ep_size=4) == [2, 2, 1, 1]  # ties: fewer copies, lower id
    rng = random.Random(1)
    for _ in range(200):
        n, ep = rng.choice([4, 8, 16]), rng.choice([2, 4, 8])
        loads = [rng.expovariate(1) * 100 for _ in range(n)]
        copies = replicate(loads, n + rng.randint(0, 2 * n), ep)
        # each extra copy was justified: the last one taken beats every copy not taken
        taken = [loads[e] / (copies[e] - 1) for e in range(n) if copies[e] > 1]
        open_ = [loads[e] / copies[e] for e in range(n) if copies[e] < ep]
        if taken and open_:
            assert min(taken) >= max(open_) - 1e-9


def brute_force_best(loads: list[float], copies: list[int], ep: int) -> float:
    """Lowest max rank load over every assignment of these copies to ranks (exactly S per rank,
    no rank with two copies of one expert)."""
    slots = [e for e, c in enumerate(copies) for _ in range(c)]
    per = len(slots) // ep
    best = float("inf")
    for ranks in itertools.product(range(ep), repeat=len(slots)):
        if any(ranks.count(r) != per for r in range(ep)):
            continue
        held = [[slots[i] for i in range(len(slots)) if ranks[i] == r] for r in range(ep)]
        if any(len(set(h)) < len(h) for h in held):
            continue
        best = min(best, max(sum(loads[e] / copies[e] for e in h) for h in held))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_balanced_layer_is_a_valid_placement_close_to_the_best_packing(seed):
    rng = random.Random(seed)
    n, ep, extra = rng.choice([(4, 2, 2), (4, 2, 4), (6, 3, 3), (4, 4, 4)])
    loads = [rng.paretovariate(1.0) * 50 for _ in range(n)]
    row = balance_layer(loads, n + extra, ep)
    per = (n + extra) // ep
    assert len(row) == n + extra and sorted(set(row)) == list(range(n))
    assert all(
        len(set(row[r * per : (r + 1) * per])) == per for r in range(ep)
    )  # no rank holds a copy twice
    copies = [row.count(e) for e in range(n)]
    mine = max(expected_rank_loads(row, loads, ep))
    assert mine <= brute_force_best(loads, copies, ep) * 1.15 + 1e-9
    assert (
        expected_imbalance(row, loads, ep)
        <= expected_imbalance(trivial_row(n, n + extra), loads, ep) + 1e-9
    )


def test_many_layouts_never_worse_than_trivial_and_never_a_copy_twice_on_a_rank():
    rng = random.Random(7)
    better = 0
    for _ in range(300):
        n, ep = rng.choice([8, 16, 32]), rng.choice([1, 2, 4, 8])
        extra = rng.choice([0, ep, 2 * ep])
        loads = [rng.paretovariate(1.2) * rng.randint(0, 100) for _ in range(n)]
        row = balance_layer(loads, n + extra, ep)
        per = (n + extra) // ep
        assert sorted(set(row)) == list(range(n)) and len(row) == n + extra
        if max(row.count(e) for e in range(n)) <= ep:  # avoidable: no rank holds a copy twice
            assert all(len(set(row[r * per : (r + 1) * per])) == per for r in range(ep))
        mine, trivial = (
            expected_imbalance(row, loads, ep),
            expected_imbalance(trivial_row(n, n + extra), loads, ep),
        )
        assert mine <= trivial + 1e-9
        better += mine < trivial - 1e-6
    assert better > 150  # and usually strictly better


def test_skewed_distribution_is_strictly_better_balanced_with_copies():
    trivial = trivial_row(8, 8)
    before = expected_imbalance(trivial, SKEWED, 2)  # experts 0..3 on rank 0: 1920 of 1960 tokens
    row = balance_layer(SKEWED, 10, 2)
    after = expected_imbalance(row, SKEWED, 2)
    assert before > 1.9 and after < 1.05 and after < before
    assert row.count(0) == 2 and row.count(1) == 2  # the two hot experts got the copies
    assert 0 in row[:5] and 0 in row[5:] and 1 in row[:5] and 1 in row[5:]  # one copy on each rank


def test_two_ranks_cannot_avoid_duplicates_when_copies_outnumber_them():
    row = balance_layer(
        [100.0, 1.0], 6, 2
    )  # 2 experts, 6 slots over 2 ranks: some rank holds a copy twice
    assert row.count(1) == 2 and 1 in row[:3] and 1 in row[3:]
    assert expected_rank_loads(row, [100.0, 1.0], 2) == pytest.approx([50.5, 50.5])


# ---- placement and dispatch -----------------------------------------------------------------
def test_trivial_with_redundant_slots_copies_the_first_experts_round_robin():
    p = ExpertPlacement.trivial([0, 2], 8, 2, num_redundant=2)
    assert p.physical_to_logical[0] == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    assert p.num_slots == 10 and p.slots_per_rank == 5 and p.rank_slots(2, 1) == [5, 6, 7, 0, 1]
    with pytest.raises(ValueError, match="ep_size: 4 does not divide the 10 expert slots"):
        ExpertPlacement.trivial([0], 8, 4, num_redundant=2)


def test_to_physical_deals_each_experts_pairs_over_its_copies_in_token_order():
    row = [3, 0, 1, 0, 2, 0, 3, 1]  # expert 0 in slots 1, 3, 5; 1 in 2, 7; 3 in 0, 6; 2 in 4
    p = ExpertPlacement(4, 2, {0: row}, num_redundant=4)
    table, counts = p.dispatch_table(0)
    ids = torch.randint(0, 4, (37, 2), generator=torch.Generator().manual_seed(0))
    slots = to_physical(ids, table, counts)
    seen = {e: 0 for e in range(4)}
    for (t, k), e in zip(
        itertools.product(range(37), range(2)), ids.reshape(-1).tolist()
    ):  # a plain reference
        copies = [s for s, x in enumerate(row) if x == e]
        assert slots[t, k].item() == copies[seen[e] % len(copies)]
        seen[e] += 1
    trivial = ExpertPlacement.trivial([0], 4, 2)
    assert torch.equal(to_physical(ids, *trivial.dispatch_table(0)), ids)


# ---- placement files ----------------------------------------------------------------------------
def write(tmp_path, name: str, doc) -> str:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


def test_placement_file_by_layer_id_and_by_row(tmp_path):
    rows = {"0": [0, 1, 2, 3, 4, 5, 6, 7, 0, 1], "2": [7, 6, 5, 4, 3, 2, 1, 0, 7, 7]}
    path = write(tmp_path, "p.json", {"num_experts": 8, "physical_to_logical_map": rows})
    p = initial_placement(path, INFO, [2], 2, num_redundant=2)
    assert p.physical_to_logical == {2: rows["2"]} and p.num_slots == 10
    sglang_rows = [
        rows["0"],
        list(range(8)) + [0, 0],
        rows["2"],
    ]  # one row per layer, dense ones ignored
    path = write(tmp_path, "rows.json", {"physical_to_logical_map": sglang_rows})
    assert initial_placement(path, INFO, [0, 2], 2, 2).physical_to_logical == {
        0: rows["0"],
        2: rows["2"],
    }


def test_distribution_file_gives_the_balanced_placement(tmp_path):
    counts = [SKEWED, [0] * 8, list(reversed(SKEWED))]
    path = write(
        tmp_path, "d.json", {"architecture": "Qwen3MoeForCausalLM", "logical_count": counts}
    )
    p = initial_placement(path, INFO, [0, 2], 2, num_redundant=2)
    assert p.physical_to_logical == {
        0: balance_layer(SKEWED, 10, 2),
        2: balance_layer(counts[2], 10, 2),
    }
    steps = write(
        tmp_path, "steps.json", {"logical_count": [counts, counts]}
    )  # SGLang's [steps, layers, experts]
    doubled = [[2 * c for c in row] for row in counts]
    assert (
        initial_placement(steps, INFO, [0, 2], 2, 2).physical_to_logical
        == ExpertPlacement(
            8, 2, placement_rows({"logical_count": doubled}, INFO, 2, 2)
        ).physical_to_logical
    )


def test_cli_turns_a_dump_into_the_placement_the_server_would_compute(tmp_path, capsys):
    dump = {
        "architecture": INFO.architecture,
        "num_layers": 3,
        "num_experts": 8,
        "moe_layers": [0, 2],
        "logical_count": [SKEWED, [0] * 8, list(reversed(SKEWED))],
        "last_physical_to_logical_map": {"0": list(range(8)), "2": list(range(8))},
    }
    src, out = write(tmp_path, "dump.json", dump), str(tmp_path / "placement.json")
    assert (
        placement_main(
            ["--distribution", src, "--ep-size", "2", "--num-redundant-experts", "2", "-o", out]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "layer 0: imbalance over 2 ranks 1.959 (recorded placement) -> 1.0" in printed
    assert "layer 2: imbalance over 2 ranks 1.959 (recorded placement) -> 1.0" in printed
    doc = json.loads(open(out).read())
    assert doc["physical_to_logical_map"] == {
        str(k): v for k, v in placement_rows(dump, INFO, 2, 2).items()
    }
    assert doc["expected_imbalance"]["0"] < 1.05
    assert initial_placement(out, INFO, [0, 2], 2, 2).physical_to_logical == placement_rows(
        dump, INFO, 2, 2
    )
    bad = placement_main(["--distribution", out, "--ep-size", "2", "-o", str(tmp_path / "x.json")])
    assert bad == 2 and "needs 'logical_count'" in capsys.readouterr().err


GOOD_ROW = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]


@pytest.mark.parametrize(
    "doc, redundant, ep, message",
    [
        ("{not json", 2, 2, "not JSON \\(Expecting property name"),
        ([1, 2], 2, 2, "must hold a JSON object, got list"),
        (
            {"foo": 1},
            2,
            2,
            "needs 'physical_to_logical_map' .* or 'logical_count' .*keys: \\['foo'\\]",
        ),
        (
            {"num_experts": 4, "physical_to_logical_map": {}},
            2,
            2,
            "made for another model: num_experts 4, this model has 8",
        ),
        (
            {"architecture": "MixtralForCausalLM", "logical_count": {}},
            2,
            2,
            "architecture 'MixtralForCausalLM'",
        ),
        (
            {"physical_to_logical_map": [GOOD_ROW, GOOD_ROW]},
            2,
            2,
            "has 2 rows; the model has 3 layers",
        ),
        (
            {"physical_to_logical_map": {"0": GOOD_ROW, "1": GOOD_ROW, "2": GOOD_ROW}},
            2,
            2,
            "layer '1' is not a MoE layer of the model \\(MoE layers: \\[0, 2\\]\\)",
        ),
        ({"physical_to_logical_map": {"0": GOOD_ROW}}, 2, 2, "lacks MoE layer\\(s\\) \\[2\\]"),
        (
            {"physical_to_logical_map": {"0": GOOD_ROW, "2": GOOD_ROW}},
            4,
            2,
            "layer 0 has 10 slots; the model's 8 experts plus --ep-num-redundant-experts 4 make 12",
        ),
        (
            {"physical_to_logical_map": {"0": GOOD_ROW, "2": [0, 1, 2, 3, 4, 5, 6, 0, 0, 1]}},
            2,
            2,
            "layer 2 holds no slot of expert\\(s\\) \\[7\\]",
        ),
        (
            {"physical_to_logical_map": {"0": GOOD_ROW, "2": [0, 1, 2, 3, 4, 5, 6, 7, 8, 1]}},
            2,
            2,
            "slot entries must be expert ids in \\[0, 8\\), got \\[8\\]",
        ),
        (
            {"physical_to_logical_map": {"0": GOOD_ROW, "2": GOOD_ROW}},
            2,
            4,
            "--ep-size 4 does not divide the 10 expert slots \\(8 experts \\+ "
            "--ep-num-redundant-experts 2\\)",
        ),
        (
            {"logical_count": {"0": [1] * 8, "2": [1] * 7}},
            2,
            2,
            "logical_count of layer 2 must hold 8 non-negative",
        ),
    ],
)
def test_bad_files_are_refused_naming_the_flag_and_values(tmp_path, doc, redundant, ep, message):
    path = write(tmp_path, "bad.json", doc)
    with pytest.raises(ValueError, match=f"^--init-expert-location '{path}': .*{message}"):
        initial_placement(path, INFO, [0, 2], ep, redundant)


def test_missing_file_names_the_flag(tmp_path):
    path = str(tmp_path / "nope.json")
    with pytest.raises(
        ValueError, match=f"^--init-expert-location '{path}': cannot read the file: No such file"
    ):
        initial_placement(path, INFO, [0, 2], 2, 0)


# ---- recorder, gather, metrics ------------------------------------------------------------------
def test_recorder_counts_slots_and_keeps_a_record_window():
    p = ExpertPlacement(8, 2, {0: GOOD_ROW, 2: GOOD_ROW}, num_redundant=2)
    rec = ExpertRecorder(INFO, p)
    ids = torch.tensor([[0, 3], [0, 1], [0, 7]])
    rec.observe(0, ids)  # before any window: counted since start-up only
    # expert 0's pairs take its copies in slots 0, 8, 0; expert 1's first pair slot 1
    assert rec.counts[0].tolist() == [2, 1, 0, 1, 0, 0, 0, 1, 1, 0] and rec.window().sum() == 0
    rec.start()
    rec.observe(2, ids)
    rec.stop()
    rec.observe(2, ids)  # after stop: not in the window
    assert rec.window()[2].tolist() == [2, 1, 0, 1, 0, 0, 0, 1, 1, 0] and rec.window()[0].sum() == 0
    assert p.logical_counts(2, rec.window()[2].tolist()) == [3, 1, 0, 1, 0, 0, 0, 1]
    rec.restart_window()
    assert rec.window().sum() == 0 and rec.counts[2].sum() == 12
    report = rec.report(window=False)
    assert (
        report["counts"]["2"] == [4, 2, 0, 2, 0, 0, 0, 2, 2, 0]
        and report["placement"]["0"] == GOOD_ROW
    )


class FakeWorld:
    """Two ranks' reports, as ``all_gather_bytes`` returns them."""

    def __init__(self, *reports: dict):
        self.reports = reports

    def all_gather_bytes(self, mine: bytes) -> list[bytes]:
        return [msgspec.json.encode(r) for r in self.reports]


def test_dump_sums_every_ranks_counts_and_reports_rank_loads():
    p = ExpertPlacement(8, 2, {0: GOOD_ROW, 2: GOOD_ROW}, num_redundant=2)
    a, b = ExpertRecorder(INFO, p), ExpertRecorder(INFO, p)
    a.start(), b.start()
    a.observe(0, torch.tensor([[0, 5], [0, 6]]))
    b.observe(0, torch.tensor([[0, 5]]))
    b.observe(2, torch.tensor([[7, 6]]))
    loop = SimpleNamespace(
        world=FakeWorld(a.report(True), b.report(True)),
        args=SimpleNamespace(),
        scheduler=SimpleNamespace(runner=SimpleNamespace(model=SimpleNamespace(expert_recorder=a))),
    )
    dump = expert_api.scheduler_control(loop, {"action": "dump"})
    # rank b's first token of expert 0 took copy 0 (slot 0), as rank a's first did
    assert dump["logical_count"] == [[3, 0, 0, 0, 0, 2, 1, 0], [0] * 8, [0, 0, 0, 0, 0, 0, 1, 1]]
    assert dump["physical_count"]["0"] == [2, 0, 0, 0, 0, 2, 1, 0, 1, 0]
    assert dump["rank_load"] == {"0": [2, 4], "2": [0, 2]}
    assert dump["imbalance"] == {"0": pytest.approx(4 / 3), "2": pytest.approx(2.0)}  # max / mean
    assert imbalance([2, 4]) == pytest.approx(4 / 3) and imbalance([0, 0]) == 1.0
    assert (
        dump["moe_layers"] == [0, 2]
        and dump["num_experts"] == 8
        and dump["num_redundant_experts"] == 2
    )
    assert dump["last_physical_to_logical_map"] == {"0": GOOD_ROW, "2": GOOD_ROW}
    with pytest.raises(ValueError, match="action must be one of"):
        expert_api.scheduler_control(loop, {"action": "reset"})
    loop.scheduler.runner.model = SimpleNamespace()
    loop.args.expert_distribution_recorder_mode = "stat"
    with pytest.raises(ValueError, match="no MoE layers"):
        expert_api.scheduler_control(loop, {"action": "start"})


def test_metrics_add_what_the_totals_grew_by():
    registry = CollectorRegistry()
    m = expert_api.ExpertLoadMetrics(registry, "m")
    m.update({"logical_count": {"0": [3, 0], "2": [1, 1]}, "imbalance": {"0": 1.5, "2": 1.0}})
    m.update({"logical_count": {"0": [5, 1], "2": [1, 1]}, "imbalance": {"0": 1.25, "2": 1.0}})
    text = generate_latest(registry).decode()
    assert 'pdserve:moe_expert_tokens_total{expert="0",layer="0",model_name="m"} 5.0' in text
    assert 'pdserve:moe_expert_tokens_total{expert="1",layer="0",model_name="m"} 1.0' in text
    assert 'pdserve:moe_expert_imbalance{layer="0",model_name="m"} 1.25' in text


def test_record_routes_answer_400_when_the_recorder_is_off():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from pdserve.server.errors import APIError

    app = FastAPI()

    @app.exception_handler(APIError)
    async def _err(request, exc):
        return exc.response()

    async def control(op, **kw):
        raise AssertionError("the scheduler must not be asked")

    args = SimpleNamespace(expert_distribution_recorder_mode=None, served_model_name="m")
    expert_api.add_routes(app, args, control, CollectorRegistry())
    with TestClient(app) as client:
        for path in (
            "/start_expert_distribution_record",
            "/stop_expert_distribution_record",
            "/dump_expert_distribution_record",
        ):
            r = client.post(path)
            assert (
                r.status_code == 400
                and "--expert-distribution-recorder-mode stat" in r.json()["error"]["message"]
            )


# ---- a model with copies of its experts ----------------------------------------------------------
def test_model_loads_every_copy_and_records_through_its_context(tmp_path):
    from safetensors import safe_open

    from pdserve.layers.moe.context import MoEOptions
    from pdserve.layers.moe.experts import Experts
    from pdserve.models.loader import load_model
    from tests.helpers.checkpoints import build_tiny_checkpoint

    path = build_tiny_checkpoint("qwen3_moe")
    rows = {"0": [5, 5, 0, 1, 2, 3, 4, 6, 7, 5], "2": [7, 6, 5, 4, 3, 2, 1, 0, 0, 0]}
    placement = write(tmp_path, "p.json", {"physical_to_logical_map": rows})
    model, _ = load_model(
        path,
        dtype="float32",
        moe=MoEOptions(
            init_expert_location=placement, num_redundant_experts=2, record_experts=True
        ),
    )
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert [e.slots for e in experts] == [rows["0"], rows["2"]]
    with safe_open(f"{path}/model.safetensors", framework="pt") as st:
        for layer, e in zip((0, 2), experts):
            for slot, expert in enumerate(e.slots):  # every copy holds its expert's weights
                name = f"model.layers.{layer}.mlp.experts.{expert}"
                assert torch.equal(e.w2[slot], st.get_tensor(f"{name}.down_proj.weight"))
                assert torch.equal(e.w13[slot, :32], st.get_tensor(f"{name}.gate_proj.weight"))
    rec = model.expert_recorder
    assert rec.observe in model._moe_ctx.observers and rec.info == INFO
    trivial, _ = load_model(path, dtype="float32", moe=MoEOptions(num_redundant_experts=2))
    assert [m.slots for m in trivial.modules() if isinstance(m, Experts)] == [GOOD_ROW, GOOD_ROW]
    assert trivial.expert_recorder is None
