"""What the router changes in the bodies it forwards (router <-> servers wire format).

Requests get ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room``: scalars for a single
input, lists with one fresh room per input for a batch. The item count matches the sglang
router (0.3.2, checked on the wire): /generate batches by ``text`` list or ``input_ids`` list of
lists, /v1/completions by ``prompt`` list, /v1/chat/completions by ``n > 1``. ``n`` is *not*
multiplied in for /generate and /v1/completions: the server repeats a batch-sized room list
``n`` times itself (and turns a scalar room R into R, R+1, ... for a single input with ``n > 1``).

With ``--dp-aware``, each leg also gets ``routed_dp_rank``, the data-parallel group chosen for it,
and decode ``disagg_prefill_dp_rank``, prefill's group (``with_dp_ranks``): one scalar per
request, which the servers apply to every item of a batch.

Responses: prefill's input logprobs are prepended to decode's, for JSON bodies and SSE events.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from typing import Any

from pdserve import json_body

ROOM_LIMIT = 2**63
MAX_SAMPLES = 1024  # chat's n that gets one room per sample (pdserve servers allow 64)
INPUT_LOGPROB_KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")
DONE_EVENT = b"data: [DONE]\n\n"

_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "invalid_request_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_timeout",
}


class BadRequest(ValueError):
    """A client error found before contacting any worker; becomes a 4xx answer."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def new_room() -> int:
    return secrets.randbelow(ROOM_LIMIT)


def error_body(status: int, message: str, type_: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": type_ or _ERROR_TYPES.get(status, "server_error"),
            "code": status,
        }
    }


def sse_error_event(status: int, message: str) -> bytes:
    return f"data: {json.dumps(error_body(status, message))}\n\n".encode() + DONE_EVENT


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_body(raw: bytes) -> dict:
    """The request body as a JSON object, or ``BadRequest``."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    problem = json_body.problem(body)  # what could not be re-encoded for the workers
    if problem:
        raise BadRequest(problem)
    return body


def _is_list_of_lists(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, list) for v in value)


def item_count(path: str, body: dict) -> int | None:
    """Number of inputs in a batched request, or None for a single input (scalar fields)."""
    if path == "/generate":
        if isinstance(body.get("text"), list):
            return len(body["text"]) or None
        if _is_list_of_lists(body.get("input_ids")):
            return len(body["input_ids"])
        return None
    if path == "/v1/completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
            return len(prompt)  # list of strings or of token-id lists; a flat id list is one prompt
        return None
    if path == "/v1/chat/completions":
        # beyond MAX_SAMPLES the servers refuse n anyway: no list of that many rooms is built
        n = body.get("n")
        return (
            n if isinstance(n, int) and not isinstance(n, bool) and 1 < n <= MAX_SAMPLES else None
        )
    return None


def with_bootstrap(body: dict, host: str, port: int | None, count: int | None) -> dict:
    out = dict(body)
    if count is None:
        out.update(bootstrap_host=host, bootstrap_port=port, bootstrap_room=new_room())
    else:
        out.update(
            bootstrap_host=[host] * count,
            bootstrap_port=[port] * count,
            bootstrap_room=[new_room() for _ in range(count)],
        )
    return out


def client_routed_rank(body: dict) -> Any:
    """The ``routed_dp_rank`` the client set (or its deprecated alias ``data_parallel_rank``)."""
    routed = body.get("routed_dp_rank")
    return routed if routed is not None else body.get("data_parallel_rank")


def with_dp_ranks(
    body: dict, choose_prefill: Callable[[], int] | None, choose_main: Callable[[], int]
) -> tuple[dict | None, dict]:
    """The bodies of the prefill leg (None without ``choose_prefill``: colocated) and of the
    decode or colocated leg, with the DP groups the choosers pick: ``routed_dp_rank`` on each
    leg, and on decode ``disagg_prefill_dp_rank``, the group that prefill's body names.

    Fields the client set win, as if it had sent the body to the servers itself: its
    ``routed_dp_rank`` (or ``data_parallel_rank``) pins both legs, its ``disagg_prefill_dp_rank``
    pins the prefill leg. A chooser is called only for a group left open."""
    routed, prefill_hint = client_routed_rank(body), body.get("disagg_prefill_dp_rank")

    def leg(chosen: Callable[[], int], prefill_rank: Any = None) -> dict:
        out = dict(body)
        if routed is None:
            out["routed_dp_rank"] = chosen()
        if prefill_rank is not None and prefill_hint is None:
            out["disagg_prefill_dp_rank"] = prefill_rank
        return out

    if choose_prefill is None:
        return None, leg(choose_main)
    p_body = leg(choose_prefill if prefill_hint is None else lambda: prefill_hint)
    return p_body, leg(choose_main, client_routed_rank(p_body))


def sample_count(body: dict) -> int:
    """``sampling_params.n`` of a /generate request (outputs per input)."""
    params = body.get("sampling_params")
    n = params.get("n", 1) if isinstance(params, dict) else 1
    return n if isinstance(n, int) and n > 0 else 1


# ---------------------------------------------------------------------- input logprob merging
def prefill_items(raw: bytes) -> list[dict]:
    """Prefill's per-input outputs from its answer: one JSON object/list, or SSE events
    (the first event that carries input logprobs wins)."""
    text = raw.strip()
    if text.startswith(b"data:"):
        found: list[dict] = []
        for line in text.splitlines():
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            try:
                items = _as_items(json.loads(line[5:]))
            except ValueError:
                continue
            if any(_meta(i).get("input_token_logprobs") for i in items):
                return items
            found = found or items
        return found
    try:
        return _as_items(json.loads(text))
    except ValueError:
        return []


def _as_items(value: Any) -> list[dict]:
    items = value if isinstance(value, list) else [value]
    return [i for i in items if isinstance(i, dict)]


def _meta(item: dict) -> dict:
    meta = item.get("meta_info")
    return meta if isinstance(meta, dict) else {}


def _merge_item(decode_item: dict, prefill_item: dict | None) -> bool:
    if prefill_item is None or not isinstance(decode_item.get("meta_info"), dict):
        return False
    p_meta, d_meta = _meta(prefill_item), decode_item["meta_info"]
    changed = False
    for key in INPUT_LOGPROB_KEYS:
        if p_meta.get(key):
            d_meta[key] = list(p_meta[key]) + list(d_meta.get(key) or [])
            changed = True
    return changed


def _prefill_for(index: int, total: int, p_items: list[dict]) -> dict | None:
    """Prefill item for decode output ``index`` of ``total``; outputs of one input are
    contiguous."""
    if not p_items:
        return None
    if index < len(p_items) and len(p_items) >= total:
        return p_items[index]
    per_input = max(total // len(p_items), 1)
    return p_items[min(index // per_input, len(p_items) - 1)]


def merge_logprobs_json(decode_raw: bytes, p_items: list[dict]) -> bytes | None:
    """Decode's JSON answer with prefill's input logprobs prepended, or None if not mergeable."""
    try:
        out = json.loads(decode_raw)
    except ValueError:
        return None
    items = _as_items(out)
    for i, item in enumerate(items):
        _merge_item(item, _prefill_for(i, len(items), p_items))
    return json.dumps(out, ensure_ascii=False).encode()


def rewrite_event_objects(event: bytes, edit: Callable[[dict], bool]) -> bytes:
    """One SSE event with ``edit`` applied to each JSON object of its ``data:`` lines; a line is
    re-serialised only when ``edit`` returns True (the event is returned as it was otherwise)."""
    lines = event.split(b"\n")
    changed = False
    for k, line in enumerate(lines):
        if not line.startswith(b"data:") or line[5:].strip() in (b"", b"[DONE]"):
            continue
        try:
            obj = json.loads(line[5:])
        except ValueError:
            continue
        if isinstance(obj, dict) and edit(obj):
            lines[k] = b"data: " + json.dumps(obj, ensure_ascii=False).encode()
            changed = True
    return b"\n".join(lines) if changed else event


def merge_logprobs_event(event: bytes, p_items: list[dict], total: int) -> bytes:
    """One SSE event (ending in a blank line) with prefill's input logprobs merged in."""

    def edit(obj: dict) -> bool:
        index = obj.get("index", 0)
        return _merge_item(
            obj, _prefill_for(index if isinstance(index, int) else 0, total, p_items)
        )

    return rewrite_event_objects(event, edit)


def first_event_error(chunk: bytes) -> tuple[int, bytes] | None:
    """(status, JSON error body) when the first SSE event of ``chunk`` is an error event."""
    events = split_events(chunk)
    if not events:
        return None
    for line in events[0].splitlines():
        if not line.startswith(b"data:"):
            continue
        try:
            obj = json.loads(line[5:])
        except ValueError:
            return None
        err = obj.get("error") if isinstance(obj, dict) else None
        if not isinstance(err, dict):
            return None
        code = err.get("code")
        status = code if isinstance(code, int) and 400 <= code < 600 else 500
        return status, json.dumps({"error": err}).encode()
    return None


def event_boundary(buf: bytes | bytearray) -> int:
    """Length of the prefix of ``buf`` made of whole SSE events (0 if none is complete)."""
    lf, crlf = buf.rfind(b"\n\n"), buf.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def split_events(buf: bytes) -> list[bytes]:
    """Whole SSE events in ``buf`` (a prefix cut at ``event_boundary``), each with its blank
    line."""
    events, start = [], 0
    while start < len(buf):
        end = buf.find(b"\n\n", start)
        end = len(buf) if end < 0 else end + 2
        events.append(buf[start:end])
        start = end
    return events
