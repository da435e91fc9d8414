"""``--init-expert-location``: the initial expert placement from a JSON file, validated against
the model at start-up, and ``pdserve expert-placement``, which turns a recorded distribution
into a placement file.

A file is a JSON object with one of (SGLang's key names):

- ``physical_to_logical_map``: a placement, per MoE layer the logical expert of each physical
  slot (``num_experts + --ep-num-redundant-experts`` entries, every expert at least once);
- ``logical_count``: a recorded distribution, per MoE layer the tokens of each logical expert
  (what ``/dump_expert_distribution_record`` returns); the placement is computed from it for
  ``--ep-size`` and ``--ep-num-redundant-experts`` (``eplb.py``). SGLang's 3-D form [steps,
  layers, experts] is summed over the steps.

Either value is a list with one row per decoder layer (SGLang's layout: the rows of dense layers
are read as lists and ignored) or an object keyed by layer id holding exactly the model's MoE
layers. Optional ``architecture``, ``num_layers`` and ``num_experts`` must match the model's;
an ``ep_size`` that differs from ``--ep-size`` is logged (the placement stays valid, but it was
balanced for another rank count). Every mismatch is a ``ValueError`` naming the flag and values.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any, Optional

from pdserve.layers.moe.eplb import balance_layer, expected_imbalance
from pdserve.layers.moe.placement import ExpertPlacement, MoEModelInfo

logger = logging.getLogger(__name__)


def initial_placement(
    location: str, info: MoEModelInfo, layers: list[int], ep_size: int, num_redundant: int = 0
) -> ExpertPlacement:
    """The placement of this stage's MoE ``layers``: ``trivial`` or from the file ``location``
    (read and checked for every MoE layer of the model)."""
    if location == "trivial":
        return ExpertPlacement.trivial(layers, info.num_experts, ep_size, num_redundant)
    where = f"--init-expert-location {location!r}"
    rows = placement_rows(
        read_location(location, where), info, ep_size, num_redundant, layers, where
    )
    return ExpertPlacement(
        info.num_experts, ep_size, {layer: rows[layer] for layer in layers}, num_redundant
    )


def read_location(path: str, where: str) -> dict:
    """The JSON object in ``path`` (``where``: the flag and path, for errors)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"{where}: cannot read the file: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: must hold a JSON object, got {type(data).__name__}")
    return data


def placement_rows(
    data: dict,
    info: MoEModelInfo,
    ep_size: int,
    num_redundant: int,
    layers: Optional[list[int]] = None,
    where: str = "--init-expert-location",
) -> dict[int, list[int]]:
    """Slot -> expert per MoE layer (``layers``, default all) from a placement or a distribution
    (``data``), the whole file checked against the model."""

    def bad(msg: str) -> ValueError:
        return ValueError(f"{where}: {msg}")

    _check_model(data, info, bad)
    slots = info.num_experts + num_redundant
    if slots % ep_size:
        raise bad(
            f"--ep-size {ep_size} does not divide the {slots} expert slots ({info.num_experts} "
            f"experts + --ep-num-redundant-experts {num_redundant})"
        )
    if "physical_to_logical_map" in data:
        rows = _per_layer(data["physical_to_logical_map"], info, "physical_to_logical_map", bad)
        for layer, row in rows.items():
            _check_placement_row(layer, row, info, slots, num_redundant, bad)
        if isinstance(data.get("ep_size"), int) and data["ep_size"] != ep_size:
            logger.warning(
                "%s: the placement was computed for ep_size %d, this server runs --ep-size %d",
                where,
                data["ep_size"],
                ep_size,
            )
        return rows
    if "logical_count" in data:
        counts = _per_layer(_sum_steps(data["logical_count"]), info, "logical_count", bad)
        for layer, row in counts.items():
            if len(row) != info.num_experts or not all(
                isinstance(c, (int, float)) and c >= 0 for c in row
            ):
                raise bad(
                    f"logical_count of layer {layer} must hold {info.num_experts} non-negative "
                    f"counts (one per expert), got {_short(row)}"
                )
        wanted = counts if layers is None else layers
        return {
            layer: balance_layer([float(c) for c in counts[layer]], slots, ep_size)
            for layer in wanted
        }
    raise bad(
        "needs 'physical_to_logical_map' (a placement) or 'logical_count' (a recorded "
        f"distribution); keys: {sorted(data)}"
    )


def _check_model(data: dict, info: MoEModelInfo, bad) -> None:
    for key, mine in (
        ("architecture", info.architecture),
        ("num_layers", info.num_layers),
        ("num_experts", info.num_experts),
    ):
        if key in data and data[key] != mine:
            raise bad(f"made for another model: {key} {data[key]!r}, this model has {mine!r}")


def _sum_steps(value: Any) -> Any:
    """SGLang's [steps, layers, experts] counts summed over the steps."""
    if (
        isinstance(value, list)
        and value
        and all(isinstance(s, list) and s and isinstance(s[0], list) for s in value)
    ):
        return [[sum(col) for col in zip(*rows)] for rows in zip(*value)]
    return value


def _per_layer(value: Any, info: MoEModelInfo, key: str, bad) -> dict[int, list]:
    if isinstance(value, list):
        if len(value) != info.num_layers or not all(isinstance(r, list) for r in value):
            raise bad(
                f"{key} has {len(value)} rows; the model has {info.num_layers} layers "
                "(one list per layer)"
            )
        return {layer: value[layer] for layer in info.moe_layers}
    if not isinstance(value, dict):
        raise bad(
            f"{key} must be a list (one row per layer) or an object keyed by layer id, "
            f"got {type(value).__name__}"
        )
    rows: dict[int, list] = {}
    for k, row in value.items():
        if not str(k).isdigit() or int(k) not in info.moe_layers:
            raise bad(
                f"{key}: layer {k!r} is not a MoE layer of the model (MoE layers: "
                f"{list(info.moe_layers)})"
            )
        if not isinstance(row, list):
            raise bad(f"{key}: layer {k} must be a list, got {type(row).__name__}")
        rows[int(k)] = row
    missing = [layer for layer in info.moe_layers if layer not in rows]
    if missing:
        raise bad(f"{key} lacks MoE layer(s) {missing}")
    return rows


def _check_placement_row(
    layer: int, row: list, info: MoEModelInfo, slots: int, num_redundant: int, bad
) -> None:
    if len(row) != slots:
        raise bad(
            f"layer {layer} has {len(row)} slots; the model's {info.num_experts} experts plus "
            f"--ep-num-redundant-experts {num_redundant} make {slots}"
        )
    wrong = [
        e
        for e in row
        if not isinstance(e, int) or isinstance(e, bool) or not 0 <= e < info.num_experts
    ]
    if wrong:
        raise bad(
            f"layer {layer}: slot entries must be expert ids in [0, {info.num_experts}), "
            f"got {_short(wrong)}"
        )
    absent = sorted(set(range(info.num_experts)) - set(row))
    if absent:
        raise bad(f"layer {layer} holds no slot of expert(s) {_short(absent)}")


def _short(values: list) -> str:
    return str(values[:8])[:-1] + (f", ... ({len(values)} in all)]" if len(values) > 8 else "]")


# ---- files pdserve writes ---------------------------------------------------------------------
def placement_document(
    info: MoEModelInfo,
    rows: dict[int, list[int]],
    ep_size: int,
    num_redundant: int,
    counts: Optional[dict[int, list[float]]] = None,
) -> dict:
    """A placement file: the model facts, the rank layout it was made for and, per MoE layer,
    slot -> expert (and the expected imbalance when made from counts)."""
    doc: dict[str, Any] = {
        "architecture": info.architecture,
        "num_layers": info.num_layers,
        "num_experts": info.num_experts,
        "ep_size": ep_size,
        "num_redundant_experts": num_redundant,
        "physical_to_logical_map": {str(k): v for k, v in sorted(rows.items())},
    }
    if counts is not None:
        doc["expected_imbalance"] = {
            str(k): round(expected_imbalance(rows[k], counts[k], ep_size), 4) for k in sorted(rows)
        }
    return doc


def distribution_info(data: dict, where: str) -> MoEModelInfo:
    """The model facts of a recorded distribution; without them (a bare SGLang file) every row
    counts as a MoE layer."""
    counts = _sum_steps(data.get("logical_count"))
    if isinstance(counts, dict) and counts and all(str(k).isdigit() for k in counts):
        layers, rows = tuple(sorted(int(k) for k in counts)), list(counts.values())
        num_layers = max(layers) + 1
    elif isinstance(counts, list) and counts:
        layers, rows = tuple(data.get("moe_layers") or range(len(counts))), counts
        num_layers = len(counts)
    else:
        raise ValueError(
            f"{where}: needs 'logical_count' (what /dump_expert_distribution_record returns)"
        )
    width = max((len(r) for r in rows if isinstance(r, list)), default=0)
    return MoEModelInfo(
        data.get("architecture") or "",
        data.get("num_layers") or num_layers,
        data.get("num_experts") or width,
        layers,
    )


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="pdserve expert-placement",
        description="Turn a recorded expert "
        "distribution into a placement file for --init-expert-location.",
    )
    p.add_argument(
        "--distribution", required=True, help="JSON from /dump_expert_distribution_record"
    )
    p.add_argument("--ep-size", type=int, required=True)
    p.add_argument("--num-redundant-experts", type=int, default=0)
    p.add_argument("-o", "--output", required=True, help="placement JSON to write")
    a = p.parse_args(argv)
    try:
        if a.ep_size < 1 or a.num_redundant_experts < 0:
            raise ValueError(
                f"--ep-size must be >= 1 and --num-redundant-experts >= 0, got {a.ep_size} and "
                f"{a.num_redundant_experts}"
            )
        where = f"--distribution {a.distribution!r}"
        data = read_location(a.distribution, where)
        info = distribution_info(data, where)
        rows = placement_rows(data, info, a.ep_size, a.num_redundant_experts, where=where)
    except ValueError as e:
        print(f"pdserve expert-placement: {e}", file=sys.stderr)
        return 2
    counts = _per_layer(_sum_steps(data["logical_count"]), info, "logical_count", ValueError)
    doc = placement_document(
        info,
        rows,
        a.ep_size,
        a.num_redundant_experts,
        {k: [float(c) for c in v] for k, v in counts.items()},
    )
    with open(a.output, "w") as f:
        json.dump(doc, f, indent=1)
    recorded = data.get("last_physical_to_logical_map") or {}  # the layout the tokens ran on
    trivial = ExpertPlacement.trivial(
        list(rows), info.num_experts, a.ep_size, a.num_redundant_experts
    )
    for layer in sorted(rows):
        old, what = recorded.get(str(layer)), "recorded"
        if old is None or len(old) % a.ep_size:
            old, what = trivial.physical_to_logical[layer], "trivial"
        before = expected_imbalance(old, counts[layer], a.ep_size)
        print(
            f"layer {layer}: imbalance over {a.ep_size} ranks {before:.3f} ({what} placement) -> "
            f"{doc['expected_imbalance'][str(layer)]:.3f}"
        )
    print(f"wrote {a.output}")
    return 0
