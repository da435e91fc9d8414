"""Fuzz every route from the live server's own /openapi.json (schemathesis): no answer is a 5xx,
every answer (each streamed event included) matches the published schema, and the routes take
what their request schemas allow (few schema-valid bodies answered 4xx).

The generation routes run on the session's colocated server; ``/migrate``, ``/migrate_in`` and
``/switch_role`` on a decode of their own (a valid body there changes the server: it takes a moved
request, or it switches its role), in that order."""

from __future__ import annotations

import json
import os
import time
from collections import Counter

import hypothesis
import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import response_schema_conformance

from pdserve.server.generate_api import PER_ITEM
from tests.helpers import cluster as c

# bodies per operation (PDSERVE_FUZZ_EXAMPLES=N for a longer run, as docs/testing.md records)
MAX_EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "40"))
MAX_OUTPUT = 2  # tokens a generated body may ask for: the CPU model is slow
# schema-valid bodies a route may answer 4xx (facts the schema can't know: the template's
# rules, a list's length against the prompts); measured 0.00-0.15 per operation
MAX_REJECTED = 0.2
# the decode's routes, fuzzed on a server of their own in this order (the last switches its role)
DECODE_ROUTES = [("POST", "/migrate"), ("POST", "/migrate_in"), ("POST", "/switch_role")]
PEER_ARGS = ["--migration-peers", "127.0.0.1"]
MAX_STREAM_EVENTS = 1_000_000
OUTPUT_FIELDS = ("max_tokens", "max_completion_tokens", "max_new_tokens", "max_output_tokens")
# the last event of a stream of named events
NAMED_STREAM_ENDS = ("response.completed", "response.incomplete", "error", "message_stop")


# the custom string formats the schemas name: a grammar (GBNF, start symbol root) and a JSON Schema
# as text; what a client that knows them sends (a string in neither is refused, as it should be)
_WORD = st.text(alphabet="abcxyz019 ", min_size=1, max_size=6).map(lambda w: json.dumps(w))
_ITEM = st.one_of(
    _WORD,
    st.sampled_from(["[a-z]", "[0-9]+", "[abc]*", '"x"?']),
)
GBNF = st.lists(st.lists(_ITEM, min_size=1, max_size=3).map(" ".join), min_size=1, max_size=3).map(
    lambda alts: "root ::= " + " | ".join(alts)
)
_LEAF = st.sampled_from([{"type": t} for t in ("string", "integer", "number", "boolean", "null")])
JSON_SCHEMA_TEXT = st.one_of(
    _LEAF,
    st.dictionaries(st.text(alphabet="abcdefgh", min_size=1, max_size=5), _LEAF, max_size=3).map(
        lambda props: {"type": "object", "properties": props}
    ),
    st.builds(lambda item: {"type": "array", "items": item}, _LEAF),
).map(json.dumps)
schemathesis.openapi.format("gbnf", GBNF)
schemathesis.openapi.format("json-schema", JSON_SCHEMA_TEXT)


def _ints(value):
    """``value`` with integral floats as ints: JSON Schema counts 3.0 as the integer 3, but the
    routes (msgspec, isinstance checks) take only ``3`` where an integer is due."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, list):
        return [_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: _ints(v) for k, v in value.items()}
    return value


# fields that may be a list with one entry per prompt (or per sample): JSON Schema cannot tie a
# list's length to the number of prompts, so the test gives each its first entry
PER_PROMPT_LISTS = (
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "routed_dp_rank",
    "disagg_prefill_dp_rank",
    "data_parallel_rank",
)


def _scalar_pd_fields(body, path: str):
    if isinstance(body, dict):
        for name in PER_PROMPT_LISTS:
            if isinstance(body.get(name), list):
                body[name] = body[name][0] if body[name] else None
        # refused by a server started without --enable-return-routed-experts (as this one is): a
        # fact of its flags, not of the schema
        if body.get("return_routed_experts") is True:
            body["return_routed_experts"] = False
        # refused by a server without --tool-call-parser (as this one is): tools left to the
        # model's choice ("auto", the default) need one to find the calls; "none" keeps the tools
        # in the prompt
        if body.get("tools") and body.get("tool_choice") in (None, "auto", {"type": "auto"}):
            body["tool_choice"] = {"type": "none"} if path.startswith("/v1/messages") else "none"
    return body


# minimum and maximum output lengths: a body asks for at most as many tokens as it must make
LENGTH_PAIRS = (("min_tokens", "max_tokens"), ("min_tokens", "max_completion_tokens"))


def _cross_field(body):
    """``body`` with the rules between fields JSON Schema cannot state kept, as a client keeps
    them: a minimum output length within the maximum, tool names unique, a named tool_choice
    among the tools, one rid per prompt of a /generate batch."""
    if not isinstance(body, dict):
        return body
    for low, high in LENGTH_PAIRS:
        if _is_count(body.get(low)) and _is_count(body.get(high)) and body[low] > body[high]:
            body[low] = body[high]
    sp = body.get("sampling_params")
    for params in sp if isinstance(sp, list) else [sp]:
        if isinstance(params, dict):
            lo, hi = params.get("min_new_tokens"), params.get("max_new_tokens")
            if _is_count(lo) and _is_count(hi) and lo > hi:
                params["min_new_tokens"] = hi
    tools = body.get("tools")
    names = []
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        # chat's {"function": {"name"}}, or the name at the top (Responses, Messages)
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            if fn["name"] in names:
                fn["name"] = f"{fn['name']}_{i}"
            names.append(fn["name"])
    choice = body.get("tool_choice")
    if isinstance(choice, dict):  # a named tool among the tools
        named = choice.get("function", choice)
        if isinstance(named, dict) and "name" in named and named.get("name") not in names:
            body.pop("tool_choice")
        elif choice.get("type") == "any" and not names:
            body.pop("tool_choice")
    elif choice == "required" and not names:  # a call among no tools
        body.pop("tool_choice")
    prompts = body.get("text") if body.get("text") is not None else body.get("input_ids")
    batch = isinstance(prompts, list) and prompts and not isinstance(prompts[0], int)
    if batch and isinstance(body.get("rid"), str):
        body["rid"] = [f"{body['rid']}-{i}" for i in range(len(prompts))]
    for name in PER_ITEM if prompts is not None else ():  # /generate's per-prompt lists
        value = body.get(name)
        if isinstance(value, list) and not value:
            del body[name]  # an empty list is one per prompt of no prompt: the default then
        elif batch and isinstance(value, list) and len(value) != len(prompts):
            body[name] = (value * len(prompts))[: len(prompts)]
    # logprobs from a position within the prompt (its token count is the server's to know)
    starts = body.get("logprob_start_len")
    if _is_count(starts) and starts > 0:
        body["logprob_start_len"] = 0
    elif isinstance(starts, list):
        body["logprob_start_len"] = [min(v, 0) if _is_count(v) else v for v in starts]
    return body


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _small(body):
    """``body`` asking for at most MAX_OUTPUT tokens (still schema-valid: only lowered)."""
    if not isinstance(body, dict):
        return body
    for name in OUTPUT_FIELDS:
        if isinstance(body.get(name), int) and not isinstance(body[name], bool):
            body[name] = min(body[name], MAX_OUTPUT)
    openai = "prompt" in body or "messages" in body
    if openai and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_OUTPUT  # absent or null: the model's whole context
    if "input" in body and body.get("max_output_tokens") is None:  # /v1/responses
        body["max_output_tokens"] = MAX_OUTPUT
    for name in ("min_tokens", "min_new_tokens"):
        if isinstance(body.get(name), int) and not isinstance(body[name], bool):
            body[name] = min(body[name], MAX_OUTPUT)
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool):
        body["n"] = min(body["n"], MAX_OUTPUT)  # choices per prompt: each streams its tokens
    if "text" in body or "input_ids" in body:  # /generate without sampling_params: capped too
        if body.get("sampling_params") is None:
            body["sampling_params"] = {"max_new_tokens": MAX_OUTPUT}
    sp = body.get("sampling_params")
    for params in sp if isinstance(sp, list) else [sp]:
        if isinstance(params, dict):
            _small(params)
            if params.get("max_new_tokens") is None and "min_new_tokens" not in params:
                params["max_new_tokens"] = MAX_OUTPUT
    return body


def _content_type(response) -> str:
    value = response.headers.get("content-type", "")
    return value[0] if isinstance(value, list) else value


def _check_stream(spec: dict, operation, response) -> None:
    """Each ``data:`` event against the itemSchema's contentSchema, then ``[DONE]`` last."""
    item = spec["paths"][operation.path][operation.method.lower()]["responses"][
        str(response.status_code)
    ]["content"]["text/event-stream"]["itemSchema"]
    data_schema = item["anyOf"][1]["properties"]["data"]["contentSchema"]
    validator = jsonschema.Draft202012Validator({**data_schema, "components": spec["components"]})
    lines = response.text.splitlines()
    events = [ln[6:] for ln in lines if ln.startswith("data: ")]
    if any(ln.startswith("event: ") for ln in lines) and events and events[-1] != "[DONE]":
        # named events (the Responses and Messages APIs) end with their final event, no [DONE]
        assert json.loads(events[-1]).get("type") in NAMED_STREAM_ENDS, response.text[-500:]
        events.append("[DONE]")
    assert events and events[-1] == "[DONE]", response.text[-500:]
    for event in events[:-1]:
        validator.validate(json.loads(event))


class Fuzz:
    """Runs operations of one server's published schema and keeps what they answered."""

    def __init__(self, url: str, spec: dict):
        self.url, self.spec = url, spec
        self.schema = schemathesis.openapi.from_dict(spec)
        # read every stream to its end (schemathesis stops after 20 events by default), so that
        # each is checked to end with its final event and [DONE]
        self.schema.config.max_stream_events = MAX_STREAM_EVENTS
        self.outcomes: dict[str, Counter] = {}
        self.failures: list[str] = []  # 4xx answers to schema-valid bodies
        self.broken: list[str] = []  # 5xx, or answers that do not match the published schema
        self.seconds: dict[str, float] = {}

    def operations(self) -> dict:
        ops = (result.ok() for result in self.schema.get_all_operations())
        return {(op.method.upper(), op.path): op for op in ops}

    def run(self, operation) -> None:
        label = f"{operation.method.upper()} {operation.path}"
        counts = self.outcomes.setdefault(label, Counter())
        has_body = bool(operation.body)
        spec, url, failures, broken = self.spec, self.url, self.failures, self.broken

        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
            phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
        )
        # the same bodies on every run (derandomize alone seeds from the strategy's repr, which
        # holds object ids), so the fractions below are reproducible
        @hypothesis.seed(0)
        @given(case=operation.as_strategy())
        def run(case) -> None:
            if has_body:
                body = _scalar_pd_fields(_ints(case.body), operation.path)
                case.body = _small(_cross_field(body))
            response = case.call(base_url=url, timeout=180)
            counts[response.status_code // 100] += 1
            if has_body and 400 <= response.status_code < 500 and len(failures) < 40:
                failures.append(f"{label} {response.status_code}: {response.text[:160]}")
            try:
                case.validate_response(
                    response, checks=[not_a_server_error, response_schema_conformance]
                )
                if _content_type(response).startswith("text/event-stream"):
                    _check_stream(spec, operation, response)
            except (FailureGroup, AssertionError, jsonschema.ValidationError) as e:
                broken.append(f"{label} {case.body!r}: {str(e)[:600]}")

        t0 = time.monotonic()
        run()
        self.seconds[label] = round(time.monotonic() - t0, 1)

    def check(self, labels) -> None:
        """No 5xx, no answer off its schema, and few 4xx for schema-valid bodies."""
        fractions = {
            k: round(self.outcomes[k][4] / max(1, sum(self.outcomes[k].values())), 2)
            for k in labels
        }
        print("4xx fractions:", fractions, "\nseconds:", self.seconds)
        print("\n".join(self.failures))
        assert not self.broken, "\n".join(self.broken[:10])
        too_many = {k: f for k, f in fractions.items() if f > MAX_REJECTED}
        assert not too_many, f"4xx for schema-valid bodies: {fractions}\n" + "\n".join(
            self.failures
        )


def _with_body(spec: dict, routes) -> list[str]:
    return [
        f"{m.upper()} {p}"
        for p, ops in spec["paths"].items()
        for m, op in ops.items()
        if "requestBody" in op and (m.upper(), p) in routes
    ]


def test_fuzz_every_operation_from_the_published_schema(live):
    spec = live.http.get("/openapi.json").json()
    fuzz = Fuzz(live.url, spec)
    ops = fuzz.operations()
    # a colocated server offers no decode route but /switch_role, and no route of a feature it
    # was started without (the expert records, the KV events snapshot)
    assert set(DECODE_ROUTES) & set(ops) == {("POST", "/switch_role")}
    assert ("GET", "/kv_events/snapshot") not in ops
    mine = [key for key in ops if key not in DECODE_ROUTES]
    for key in mine:
        fuzz.run(ops[key])
    # a stored response's id is the server's to know: a random one is rightly not found
    fuzz.check([f"{m} {p}" for m, p in mine if "{response_id}" not in p])


@pytest.fixture(scope="module")
def decode(tmp_path_factory, tiny_llama_path):
    """A decode of its own: moves nothing (no request runs here), takes moved requests from
    127.0.0.1, whose bootstrap servers it gives up on after half a second (the fuzzed ports have
    none), and switches to the roles the bodies name."""
    logs = tmp_path_factory.mktemp("fuzz_decode")
    D = c.decode(
        "Dfuzz",
        tiny_llama_path,
        logs,
        *c.PAGED_PD_ARGS[:4],
        "--disaggregation-waiting-timeout",
        "0.5",
        "--disaggregation-bootstrap-port",
        str(c.free_port()),
        *PEER_ARGS,
    )
    try:
        D.start()
        yield D
    finally:
        D.stop()


def test_fuzz_the_decode_routes(decode):
    spec = decode.http.get("/openapi.json").json()
    fuzz = Fuzz(decode.url, spec)
    ops = fuzz.operations()
    for key in DECODE_ROUTES:
        fuzz.run(ops[key])
    fuzz.check(_with_body(spec, DECODE_ROUTES))
    # the valid bodies switched the server for real, and it serves in the role it ended in
    info = decode.http.get("/server_info").json()
    print("role switches:", info["role_epoch"], "role:", info["role"])
    assert info["role_epoch"] >= 3, info["role_switch"]
    r = decode.http.post("/generate", json=c.greedy_body([5, 6, 7], 2))
    # (a prefill without a decode's room computes the first token only)
    assert r.status_code == 200 and len(r.json()["output_ids"]) >= 1, r.text
    decode.wait_idle()
