"""A request's handoff timeline on one server: its events, its stages, and the public view.

Events are wall-clock times (``time.time()``), recorded where they happen: the front end records
``received`` (the request was parsed and submitted), ``first_token`` and ``finished`` (outputs
reached the front end); the scheduler records, in ``Req.timeline``, ``queued`` (it took the
request), and by role:

- prefill: ``bootstrapped`` (decode's pages are known; the request joins the waiting queue),
  ``forward_start`` (admitted into a batch), ``forward_end`` (first token sampled; the last KV
  chunk goes out), ``kv_first_write`` (the room's first KV write completed: with the layer
  pipeline, before the last chunk's forward ended), ``kv_sent`` (every write of the room
  completed);
- decode: ``preallocated`` (pages and a metadata slot taken, their indices on the way to
  prefill), ``kv_received`` (the KV and the first token arrived; the request joins the running
  batch);
- colocated: ``forward_start``.

A stage is the time between two events of the same server (``STAGES``); every finished request
adds its stages to ``pdserve:per_stage_req_latency_seconds{stage}``. A client that sends the
header ``X-PDServe-Timeline: 1`` gets the events in the answer, named ``<role>_<event>`` with
role ``prefill``, ``decode`` or ``server``; through the router they are merged with the router's
own and the prefill's (see ``router/timeline.py``).
"""

from __future__ import annotations

from typing import Iterator, Mapping

HEADER = "x-pdserve-timeline"

ROLE_PREFIX = {"prefill": "prefill", "decode": "decode", "null": "server"}

# disaggregation mode -> (stage, from event, to event)
STAGES: dict[str, tuple[tuple[str, str, str], ...]] = {
    "prefill": (
        ("to_scheduler", "received", "queued"),
        ("prefill_bootstrap", "queued", "bootstrapped"),
        ("prefill_waiting", "bootstrapped", "forward_start"),
        ("prefill_forward", "forward_start", "forward_end"),
        ("prefill_transfer", "forward_end", "kv_sent"),
    ),
    "decode": (
        ("to_scheduler", "received", "queued"),
        ("decode_prealloc", "queued", "preallocated"),
        ("decode_transfer", "preallocated", "kv_received"),
        ("decode_first_token", "kv_received", "first_token"),
        ("decode_generate", "first_token", "finished"),
    ),
    "null": (
        ("to_scheduler", "received", "queued"),
        ("waiting", "queued", "forward_start"),
        ("prefill_forward", "forward_start", "first_token"),
        ("decode_generate", "first_token", "finished"),
    ),
}


def requested(headers: Mapping[str, str]) -> bool:
    """Whether the client asked for the timeline (``X-PDServe-Timeline: 1`` or ``true``)."""
    return headers.get(HEADER, "").strip().lower() in ("1", "true", "yes")


def spans(mode: str, events: Mapping[str, float]) -> Iterator[tuple[str, float, float]]:
    """(stage, start, end) of every stage whose two events happened (never ending before it
    starts: the events of one server share its clock, but the scheduler and the front end may
    read it a hair apart)."""
    for stage, start, end in STAGES[mode]:
        if start in events and end in events:
            yield stage, events[start], max(events[start], events[end])


def stages(mode: str, events: Mapping[str, float]) -> Iterator[tuple[str, float]]:
    """(stage, seconds) of every stage whose two events happened."""
    for stage, start, end in spans(mode, events):
        yield stage, end - start


def public(mode: str, events: Mapping[str, float]) -> dict[str, float]:
    """The events as the answer shows them: role-prefixed, in time order, to the microsecond."""
    prefix = ROLE_PREFIX[mode]
    return {
        f"{prefix}_{name}": round(t, 6) for name, t in sorted(events.items(), key=lambda kv: kv[1])
    }
