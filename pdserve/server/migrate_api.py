"""``POST /migrate`` and ``POST /migrate_in``: moving running requests between decode servers.

``POST /migrate`` on a decode: ``{"rid": "all" | RID | [RID, ...], "target": URL | [URL, ...]}``.
Each named request (every running one for ``"all"``) is paused after its current step and its
KV pages, tokens and sampling state move to a target decode over the PD transfer path
(``disagg/migration.py``); with several targets each request goes to the least loaded one
(``GET /get_load``, plus the requests already given to it). The client's stream goes on through
this server (``server/migration_relay.py``). Answers ``{"moved": [{rid, target, room}],
"refused": {rid: why}}``; a named request that does not run here (it ended, or never ran) is
among the refused.
Every target is checked before any connection: 400 for one that is not a server's base URL, 403
for one that is not among ``--migration-peers`` (``pdserve/peers.py``). The targets are
contacted only when something is to move: 400 for a target that is not a decode, this server
itself, one serving another model or KV layout, or one that cannot be reached. Other errors: 400
for a body of the wrong shape or a server that is not a decode; 409 when no request named by its
id that runs here could move (the reasons).

``POST /migrate_in`` (decode to decode): the moved request, with ``bootstrap_*`` naming the
source's migration bootstrap server (403 unless its host is among ``--migration-peers``); answers
the scheduler's ``TokenOut`` messages as JSON lines until the request ends.
"""

from __future__ import annotations

import asyncio
import random
import urllib.parse
from typing import Annotated, Any, ClassVar, Optional, Union

import httpx
import msgspec
from fastapi import Request
from starlette.responses import Response, StreamingResponse

from pdserve.engine.request import INT64_MAX, MAX_TOP_LOGPROBS, Generation, SamplingParams
from pdserve.host import host_identity, route_ip
from pdserve.peers import MigrationPeers, check_host, parse_target
from pdserve.server import http_util
from pdserve.server.errors import APIError, bad_request
from pdserve.server.migration_relay import Relay
from pdserve.server.openai_protocol import EBNF_TEXT, JSON_SCHEMA_TEXT
from pdserve.server.tokenizer_manager import ReqSpec, TokenizerManager

INFO_TIMEOUT_S = 5.0
# what two decodes must agree on for pages to move between them
LAYOUT_KEYS = ("model_fingerprint", "page_size", "vocab_size")


def _schema(schema: dict) -> Any:
    return msgspec.Meta(extra_json_schema=schema)


# /openapi.json components of the running server (server/api_schema.py, server_facts)
TARGET = {"$ref": "#/components/schemas/MigrationTarget"}  # a URL among --migration-peers
PEER_HOST = {"$ref": "#/components/schemas/MigrationPeerHost"}
TOKEN_IDS = {"type": "array", "items": {"$ref": "#/components/schemas/TokenId"}, "minItems": 1}
MAX_PORT = 65535
# a moved request's grammar, as the source decode compiled it: its value as the kind needs
GRAMMAR_SCHEMA = {
    "anyOf": [
        {"type": "null"},
        *(
            {
                "type": "object",
                "properties": {"kind": {"const": kind}, "value": value},
                "required": ["kind"] if kind == "json_object" else ["kind", "value"],
            }
            for kind, value in (
                ("json_schema", JSON_SCHEMA_TEXT),
                ("json_object", {"type": "string"}),
                ("regex", {"type": "string", "minLength": 1, "format": "regex"}),
                ("ebnf", EBNF_TEXT),
            )
        ),
    ]
}


class MigrateBody(msgspec.Struct, forbid_unknown_fields=True):
    JSON_SCHEMA: ClassVar[dict[str, Any]] = {
        "properties": {
            "target": {"anyOf": [TARGET, {"type": "array", "items": TARGET, "minItems": 1}]}
        }
    }

    target: Union[str, list[str]]
    rid: Union[str, list[str]] = "all"


class MigrateIn(Generation, kw_only=True):
    """A moved request: every field of its ``Generation`` (``move`` builds it from the source
    scheduler's answer, ``MigrationOut.start``), what it produced, and where its KV waits."""

    # what the handler checks beyond the types (openapi.build merges it into the fields)
    JSON_SCHEMA: ClassVar[dict[str, Any]] = {
        "properties": {
            "input_ids": TOKEN_IDS,
            "output_ids": TOKEN_IDS,
            "grammar": GRAMMAR_SCHEMA,
            "grammar_start_after": {"anyOf": [{"type": "null"}, {**TOKEN_IDS, "minItems": 0}]},
        }
    }

    rid: str
    output_ids: list[int]
    bootstrap_host: Annotated[str, _schema(PEER_HOST)]
    bootstrap_port: Annotated[int, msgspec.Meta(ge=1, le=MAX_PORT)]
    bootstrap_room: Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
    # the inherited fields with the bounds this endpoint checks
    sampling_params: Annotated[
        dict[str, Any], _schema({"$ref": "#/components/schemas/SamplingParams"})
    ]
    top_logprobs_num: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] = 0
    logprob_start_len: Annotated[int, msgspec.Meta(ge=-1, le=INT64_MAX)] = -1
    routed_experts_start_len: Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)] = 0
    priority: Optional[Annotated[int, msgspec.Meta(ge=-INT64_MAX - 1, le=INT64_MAX)]] = None


def reachable_host(host: str, target: str) -> str:
    """The address ``target`` reaches this server at: its ``--host``, or for a wildcard the
    local address on the route to the target."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    return route_ip(urllib.parse.urlsplit(target).hostname or "127.0.0.1")


def allowed_targets(tm: TokenizerManager, targets: list[str], field: str = "target") -> list[str]:
    """The targets' base URLs; 400 for one that is no server URL, 403 for one that is not a
    migration peer. Nothing is resolved or connected."""
    if not targets:
        raise bad_request(f"{field}: name at least one decode server")
    peers = MigrationPeers.of(tm.server_args.migration_peers)
    urls = []
    for text in targets:
        try:
            target = parse_target(text)
        except ValueError as e:
            raise bad_request(f"{field}: {e}") from None
        if not peers.allows(target):
            raise APIError(403, peers.refusal(field, target.url))
        urls.append(target.url)
    return urls


def _groups(info: dict) -> list:
    return [{k: v for k, v in g.items() if k != "num_pages"} for g in info.get("cache_groups", [])]


async def _check_target(tm: TokenizerManager, client: httpx.AsyncClient, url: str) -> int:
    """The target's load (requests it holds); 400 naming the problem when it cannot take any."""
    try:
        info = (await client.get(f"{url}/server_info")).json()
        load = (await client.get(f"{url}/get_load")).json()
    except (httpx.HTTPError, ValueError) as e:
        raise bad_request(f"target: cannot reach {url}: {type(e).__name__}: {e}") from None
    args = tm.server_args
    if info.get("host_id") == host_identity() and info.get("port") == args.port:
        raise bad_request(f"target: {url} is this server; name another decode")
    if info.get("disaggregation_mode") != "decode":
        raise bad_request(
            f"target: {url} is a {info.get('disaggregation_mode')!r} server, not a decode"
        )
    mine, theirs = tm.client.info, info.get("scheduler_info") or {}
    for key in LAYOUT_KEYS:
        if mine.get(key) != theirs.get(key):
            raise bad_request(
                f"target: {url} has {key} {theirs.get(key)!r}, this server {mine.get(key)!r}"
            )
    if _groups(mine) != _groups(theirs):
        raise bad_request(f"target: {url} has another KV layout: {_groups(theirs)}")
    if info.get("disaggregation_transfer_backend") != args.disaggregation_transfer_backend:
        raise bad_request(
            f"target: {url} uses the {info.get('disaggregation_transfer_backend')!r} transfer "
            f"backend, this server {args.disaggregation_transfer_backend!r}"
        )
    return sum(int(g.get("num_reqs", 0)) for g in load if isinstance(g, dict))


async def check_targets(tm: TokenizerManager, urls: list[str]) -> tuple[list[str], list[int]]:
    """The targets' loads (``urls`` as ``allowed_targets`` gives them); 400 naming the first that
    cannot take requests."""
    async with httpx.AsyncClient(timeout=INFO_TIMEOUT_S) as client:
        loads = await asyncio.gather(*(_check_target(tm, client, u) for u in urls))
    return urls, list(loads)


async def move(tm: TokenizerManager, rids: list[str], urls: list[str], loads: list[int]) -> dict:
    """Move ``rids`` to the targets (each to the least loaded, counting what it gets here) and
    start their relays: ``{"moved": [...], "refused": {rid: why}}``."""
    if not rids:
        return {"moved": [], "refused": {}}
    moves = []
    for rid in rids:
        i = min(range(len(urls)), key=lambda k: loads[k])
        loads[i] += 1
        moves.append([rid, random.randrange(1, 2**63), urls[i]])
    try:
        out = await tm.client.control("migrate_out", {"moves": moves})
    except RuntimeError as e:
        raise APIError(409, f"cannot migrate: {e}") from None
    for m in out["moved"]:
        state = tm.states.get(m["rid"])
        if state is None:  # ended in the meantime (its scheduler abort follows it)
            continue
        relay_body = {
            **{k: m[k] for k in MigrateIn.__struct_fields__ if k in m},
            "bootstrap_host": reachable_host(tm.server_args.host, m["target"]),
            "bootstrap_port": out["bootstrap_port"],
            "bootstrap_room": m["room"],
        }
        state.relay = Relay(tm, state, m["target"], relay_body)
    return out


def movable_rids(tm: TokenizerManager) -> list[str]:
    """Requests here that run and have not moved."""
    return [rid for rid, st in tm.states.items() if not st.finished and st.relay is None]


async def migrate(request: Request, tm: TokenizerManager) -> Response:
    args = tm.server_args
    body = await http_util.read_body(request, args.max_body_bytes, MigrateBody)
    if args.disaggregation_mode != "decode":
        raise bad_request(
            f"this server is a {args.disaggregation_mode!r} server; only a decode moves requests"
        )
    urls = allowed_targets(tm, [body.target] if isinstance(body.target, str) else body.target)
    refused: dict[str, str] = {}
    if body.rid == "all":
        rids = movable_rids(tm)
    else:
        rids = []
        for rid in dict.fromkeys([body.rid] if isinstance(body.rid, str) else body.rid):
            state = tm.states.get(rid)
            if state is None or state.finished:
                refused[rid] = "no request with this id runs on this server"
            elif state.relay is not None:
                refused[rid] = f"it moved to {state.relay.target} already"
            else:
                rids.append(rid)
    out = {"moved": [], "refused": {}}
    if rids:  # the targets are asked only when something is to move
        out = await move(tm, rids, *await check_targets(tm, urls))
        # "all" is asked again by a drain while requests wait for their KV: no error then
        if body.rid != "all" and not out["moved"]:
            raise APIError(409, f"nothing could move: {out['refused']}")
    moved = [{"rid": m["rid"], "target": m["target"], "room": m["room"]} for m in out["moved"]]
    return http_util.json_response({"moved": moved, "refused": {**refused, **out["refused"]}})


async def migrate_in(request: Request, tm: TokenizerManager) -> Response:
    args = tm.server_args
    body = await http_util.read_body(request, args.max_body_bytes, MigrateIn)
    if args.disaggregation_mode != "decode":
        raise bad_request(f"this server is a {args.disaggregation_mode!r} server, not a decode")
    peers = MigrationPeers.of(args.migration_peers)
    try:
        source = check_host(body.bootstrap_host)
    except ValueError as e:
        raise bad_request(f"bootstrap_host: {e}") from None
    if not peers.allows_host(source):
        raise APIError(403, peers.refusal("bootstrap_host", source))
    if not body.output_ids or not body.input_ids:
        raise bad_request("input_ids and output_ids: a moved request has both")
    ids = body.input_ids + body.output_ids
    bad = next(
        (t for t in ids + (body.grammar_start_after or []) if not 0 <= t < tm.vocab_size), None
    )
    if bad is not None:
        raise bad_request(f"token id {bad} is out of range [0, {tm.vocab_size})")
    if len(ids) >= tm.context_length:
        raise bad_request(f"{len(ids)} tokens: the context length is {tm.context_length}")
    try:
        sampling = SamplingParams.from_dict(body.sampling_params)
    except (ValueError, TypeError) as e:
        raise bad_request(f"sampling_params: {e}") from None
    if body.grammar is not None:
        tm.check_grammar(body.grammar)
    spec = ReqSpec(
        **{f: getattr(body, f) for f in Generation.__struct_fields__ if f != "sampling_params"},
        sampling=sampling,
        stream=True,
        rid=body.rid,
        bootstrap_host=body.bootstrap_host,
        bootstrap_port=body.bootstrap_port,
        bootstrap_room=body.bootstrap_room,
        resume_output_ids=body.output_ids[:-1],
    )
    state = tm.submit(spec)

    async def lines():
        try:
            while True:
                await state.event.wait()
                state.event.clear()
                outs, state.pending = state.pending, []
                for out in outs:
                    yield msgspec.json.encode(out) + b"\n"
                    if out.finish_reason is not None:
                        state.finish_reason = dict(out.finish_reason)
                        return
        finally:
            tm.release([state], "the source decode's relay went away")

    return StreamingResponse(lines(), media_type="application/jsonl")
