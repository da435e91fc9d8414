"""The router's part of a request's handoff timeline (the servers' part: ``server/timeline.py``).

The router records, in wall-clock time, per request: ``received`` (the request reached it),
``dispatched`` (the legs of the attempt that answered were sent), ``first_byte`` and
``last_byte`` (the answer's first and last body bytes went to the client). Its stages go to
``pdserve_router_per_stage_req_latency_seconds{stage}``.

A client that sends ``X-PDServe-Timeline: 1`` (passed on to the workers, which then add their
events to every finished output) gets one merged timeline per output: decode's events, those of
prefill's output for the same sample, and the router's ``router_received`` and
``router_dispatched``, in time order (the bytes it is still sending cannot be in them). For that
the router waits for prefill's answer before it answers, as it does to merge input logprobs.
"""

from __future__ import annotations

import json
from typing import Any, Iterator, Mapping, Optional

from pdserve.router.protocol import rewrite_event_objects

HEADER = "x-pdserve-timeline"  # the servers read the same header
SCOPE_KEY = "pdserve.timeline"  # the request's events, in its ASGI scope

STAGES = (
    ("router_dispatch", "received", "dispatched"),
    ("router_first_byte", "dispatched", "first_byte"),
    ("router_last_byte", "first_byte", "last_byte"),
)
_PUBLIC = ("received", "dispatched")


def requested(headers: Mapping[str, str]) -> bool:
    return headers.get(HEADER, "").strip().lower() in ("1", "true", "yes")


def events_of(scope: dict) -> dict[str, float]:
    """The router's events of the request of ``scope`` (created on first use)."""
    return scope.setdefault(SCOPE_KEY, {})


def stages(events: Mapping[str, float]) -> Iterator[tuple[str, float]]:
    for stage, start, end in STAGES:
        if start in events and end in events:
            yield stage, max(0.0, events[end] - events[start])


def _holders(obj: Any) -> list[dict]:
    """The dicts that hold each output's ``"timeline"``, in output order: the choices of an
    OpenAI answer or chunk, else the ``meta_info`` of each /generate item."""
    if isinstance(obj, dict) and isinstance(obj.get("choices"), list):
        choices = [c for c in obj["choices"] if isinstance(c, dict)]
        return sorted(
            choices, key=lambda c: c.get("index") if isinstance(c.get("index"), int) else 0
        )
    items = obj if isinstance(obj, list) else [obj]
    return [
        i["meta_info"]
        for i in items
        if isinstance(i, dict) and isinstance(i.get("meta_info"), dict)
    ]


def prefill_timelines(p_items: Optional[list[dict]]) -> list[dict]:
    """Prefill's timeline of each of its outputs, from its answer's items
    (``protocol.prefill_items``)."""
    if not p_items:
        return []
    holders = _holders(p_items[0]) if len(p_items) == 1 else _holders(p_items)
    return [h.get("timeline") if isinstance(h.get("timeline"), dict) else {} for h in holders]


def _prefill_for(index: int, total: int, p_timelines: list[dict]) -> dict:
    """Prefill's timeline for output ``index`` of ``total`` (the outputs of one input are
    contiguous)."""
    if not p_timelines:
        return {}
    if index < len(p_timelines) and len(p_timelines) >= total:
        return p_timelines[index]
    per_input = max(total // len(p_timelines), 1)
    return p_timelines[min(index // per_input, len(p_timelines) - 1)]


def _merge(
    holder: dict, index: int, total: int, p_timelines: list[dict], events: Mapping[str, float]
) -> bool:
    own = holder.get("timeline")
    if not isinstance(own, dict):
        return False  # not finished yet (or the worker does not record timelines)
    merged = {**own, **_prefill_for(index, total, p_timelines)}
    merged.update({f"router_{name}": round(events[name], 6) for name in _PUBLIC if name in events})
    holder["timeline"] = dict(sorted(merged.items(), key=lambda kv: kv[1]))
    return True


def merge_json(
    raw: bytes, p_items: Optional[list[dict]], total: int, events: Mapping[str, float]
) -> bytes:
    """A worker's JSON answer with every output's timeline merged (unchanged when not JSON)."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return raw
    p_timelines = prefill_timelines(p_items)
    holders = _holders(obj)
    total = max(total, len(holders))
    changed = [_merge(h, i, total, p_timelines, events) for i, h in enumerate(holders)]
    return json.dumps(obj, ensure_ascii=False).encode() if any(changed) else raw


def merge_event(
    event: bytes, p_items: Optional[list[dict]], total: int, events: Mapping[str, float]
) -> bytes:
    """One SSE event with the timeline of the output it finishes merged."""
    p_timelines = prefill_timelines(p_items)
    total = max(total, len(p_timelines))

    def edit(obj: dict) -> bool:
        done = False
        for h in _holders(obj):
            owner = h if "index" in h else obj  # a /generate event's index is on the item
            index = owner.get("index", 0) if isinstance(owner.get("index", 0), int) else 0
            done = _merge(h, index, total, p_timelines, events) or done
        return done

    return rewrite_event_objects(event, edit)
