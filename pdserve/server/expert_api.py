"""Expert load over HTTP (``--expert-distribution-recorder-mode stat``; the recorder is
``layers/moe/recorder.py``): SGLang's record endpoints and the Prometheus load metrics.

- ``/start_expert_distribution_record``, ``/stop_expert_distribution_record`` (GET or POST):
  open and close the record window on every rank;
- ``/dump_expert_distribution_record`` (GET or POST): the window's counts summed over every rank
  of every stage, as JSON (a distribution ``--init-expert-location`` and ``pdserve
  expert-placement`` read), and a new window starts (SGLang's dump resets too);
- ``/metrics`` gains ``pdserve:moe_expert_tokens_total{layer, expert}`` (tokens per logical
  expert since start-up; each (token, top-k slot) pair counts 1) and
  ``pdserve:moe_expert_imbalance{layer}`` (max over mean tokens per EP rank since start-up,
  under the current placement; 1 is balanced). Labels: the MoE layers times the experts.

With the recorder off these routes answer 400 naming the flag. The scheduler side
(``scheduler_control``) runs on every rank for the same control call: each reports its counts
and its stage's placement, gathered over the world group.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import msgspec
from fastapi import FastAPI
from prometheus_client import Counter, Gauge
from starlette.responses import Response

from pdserve.server import http_util
from pdserve.server.errors import APIError, bad_request

OP = "expert_distribution"
ACTIONS = ("start", "stop", "dump", "load")
OFF = (
    "the expert distribution recorder is off: start the server with "
    "--expert-distribution-recorder-mode stat"
)


# ---- scheduler side -----------------------------------------------------------------------------
def scheduler_control(loop, args: dict) -> dict:
    """``action``: start | stop | dump | load (totals since start-up, for /metrics)."""
    action = args.get("action")
    if action not in ACTIONS:
        raise ValueError(f"{OP}: action must be one of {ACTIONS}, got {action!r}")
    rec = getattr(loop.scheduler.runner.model, "expert_recorder", None)
    if rec is None:  # the same answer on every rank: they run the same model and flags
        raise ValueError(
            "the model has no MoE layers to record"
            if loop.args.expert_distribution_recorder_mode
            else OFF
        )
    if action == "start":
        rec.start()
        return {"recording": True}
    if action == "stop":
        rec.stop()
        return {"recording": False}
    counts, placement = _gather(loop.world, rec.report(window=action == "dump"))
    summary = rec.summary(counts, placement)
    if action == "load":
        return {"logical_count": summary["logical_count"], "imbalance": summary["imbalance"]}
    rec.restart_window()
    info = rec.info
    rows = [
        summary["logical_count"].get(str(layer), [0] * info.num_experts)
        for layer in range(info.num_layers)
    ]
    return {
        "architecture": info.architecture,
        "num_layers": info.num_layers,
        "num_experts": info.num_experts,
        "moe_layers": list(info.moe_layers),
        "ep_size": rec.placement.ep_size,
        "num_redundant_experts": rec.placement.num_redundant,
        "recording": rec.recording,
        "logical_count": rows,
        "physical_count": summary["physical_count"],
        "last_physical_to_logical_map": summary["placement"],
        "rank_load": summary["rank_load"],
        "imbalance": summary["imbalance"],
    }


def _gather(world, mine: dict) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Slot counts summed over every rank, and the placement of every MoE layer (each stage
    reports its own layers)."""
    counts: dict[int, list[int]] = {}
    placement: dict[int, list[int]] = {}
    for raw in world.all_gather_bytes(msgspec.json.encode(mine)):
        part = msgspec.json.decode(raw)
        for layer, row in part["counts"].items():
            acc = counts.setdefault(int(layer), [0] * len(row))
            for i, c in enumerate(row):
                acc[i] += c
        placement.update({int(k): v for k, v in part["placement"].items()})
    return counts, placement


# ---- front end -----------------------------------------------------------------------------------
class ExpertLoadMetrics:
    """The Prometheus view of the scheduler's totals, refreshed at scrape time."""

    def __init__(self, registry, model_name: str):
        self.model_name = model_name
        self.tokens = Counter(
            "pdserve:moe_expert_tokens",
            "Tokens routed to each logical expert of each MoE "
            "layer since start-up (each (token, top-k slot) pair counts 1)",
            labelnames=["model_name", "layer", "expert"],
            registry=registry,
        )
        self.imbalance = Gauge(
            "pdserve:moe_expert_imbalance",
            "Max over mean tokens per expert-parallel rank of a "
            "MoE layer since start-up, under the current placement (1: balanced)",
            labelnames=["model_name", "layer"],
            registry=registry,
        )
        self._seen: dict[tuple[str, int], int] = {}

    def update(self, load: dict) -> None:
        for layer, row in load.get("logical_count", {}).items():
            for expert, total in enumerate(row):
                seen = self._seen.get((layer, expert), 0)
                child = self.tokens.labels(
                    model_name=self.model_name, layer=layer, expert=str(expert)
                )
                if total > seen:  # a running total in the scheduler
                    child.inc(total - seen)
                    self._seen[(layer, expert)] = total
        for layer, value in load.get("imbalance", {}).items():
            self.imbalance.labels(model_name=self.model_name, layer=layer).set(value)


class ExpertAPI:
    def __init__(
        self, enabled: bool, control: Callable[..., Awaitable[Any]], registry, model_name: str
    ):
        self.enabled = enabled
        self._control = control
        self.metrics = ExpertLoadMetrics(registry, model_name) if enabled else None

    async def call(self, action: str) -> Any:
        if not self.enabled:
            raise bad_request(OFF)
        try:
            return await self._control(OP, action=action)
        except RuntimeError as e:  # the scheduler's ValueError is the caller's mistake
            if str(e).startswith("ValueError: "):
                raise bad_request(str(e)[len("ValueError: ") :]) from None
            raise APIError(500, f"{OP} {action}: {e}") from None

    async def refresh_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.update(await self._control(OP, action="load"))


def add_routes(app: FastAPI, args, control: Callable[..., Awaitable[Any]], registry) -> ExpertAPI:
    """Register the record endpoints; the returned object adds the load metrics to ``registry``
    (the server's) and refreshes them at scrape time."""
    api = ExpertAPI(
        bool(args.expert_distribution_recorder_mode), control, registry, args.served_model_name
    )

    async def start() -> Response:
        await api.call("start")
        return http_util.json_response({"success": True, "recording": True})

    async def stop() -> Response:
        await api.call("stop")
        return http_util.json_response({"success": True, "recording": False})

    async def dump() -> Response:
        return http_util.json_response(await api.call("dump"))

    for path, handler in (
        ("/start_expert_distribution_record", start),
        ("/stop_expert_distribution_record", stop),
        ("/dump_expert_distribution_record", dump),
    ):
        app.add_api_route(path, handler, methods=["GET", "POST"])
    return api
