"""The server's /openapi.json: a valid OpenAPI 3.2 document that documents every route's body and
answers; real answers (streamed chunks included) validate against the published schemas, and
the request schemas accept and refuse what the routes accept and refuse."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openapi_spec_validator import validate as validate_openapi

from tests.e2e.conftest import SERVED_MODEL_NAME

SP = {"max_new_tokens": 3, "temperature": 0}
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def spec(server) -> dict:
    r = server.http.get("/openapi.json")
    assert r.status_code == 200, r.text
    return r.json()


class Schemas:
    """Validators for the document's schemas (refs resolve against its components)."""

    def __init__(self, spec: dict):
        self.spec = spec

    def validator(self, schema: dict) -> jsonschema.Draft202012Validator:
        return jsonschema.Draft202012Validator({**schema, "components": self.spec["components"]})

    def op(self, method: str, path: str) -> dict:
        return self.spec["paths"][path][method]

    def check_answer(self, method: str, path: str, r: httpx.Response) -> None:
        content = self.op(method, path)["responses"][str(r.status_code)]["content"]
        if r.headers["content-type"].startswith("text/event-stream"):
            events = [
                line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: ")
            ]
            assert events[-1] == "[DONE]" and len(events) > 1, r.text
            item = content["text/event-stream"]["itemSchema"]
            v = self.validator(item["anyOf"][1]["properties"]["data"]["contentSchema"])
            for event in events[:-1]:
                v.validate(json.loads(event))
        else:
            self.validator(content["application/json"]["schema"]).validate(r.json())

    def body_valid(self, path: str, body) -> bool:
        schema = self.op("post", path)["requestBody"]["content"]["application/json"]["schema"]
        return self.validator(schema).is_valid(body)


@pytest.fixture(scope="module")
def schemas(spec) -> Schemas:
    return Schemas(spec)


def test_document_is_valid_openapi_and_documents_every_route(spec):
    validate_openapi(spec)  # raises with the first problem
    assert spec["openapi"].startswith("3.2")  # itemSchema (event streams) is 3.2
    bodies = {
        "/generate",
        "/v1/completions",
        "/v1/chat/completions",
        "/abort_request",
        "/switch_role",
    }
    for path, methods in spec["paths"].items():
        for method, op in methods.items():
            ok = op["responses"]["200"]
            assert ok["description"] != "Successful Response", f"{method} {path} is not documented"
            for media in ok.get("content", {}).values():
                assert media.get("schema", media.get("itemSchema")) not in ({}, None), (
                    f"{method} {path}: answer without a schema"
                )
            if path in bodies:
                assert "$ref" in op["requestBody"]["content"]["application/json"]["schema"], (
                    method,
                    path,
                )
    assert bodies | {"/health", "/v1/models", "/server_info", "/get_load", "/flush_cache"} <= set(
        spec["paths"]
    )
    chunk = spec["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"][
        "text/event-stream"
    ]
    data = chunk["itemSchema"]["anyOf"][1]["properties"]["data"]
    assert data["contentMediaType"] == "application/json"
    assert data["contentSchema"]["oneOf"][0] == {"$ref": "#/components/schemas/ChatCompletionChunk"}


GENERATIONS = [
    ("/generate", {"text": "Hello", "sampling_params": SP}),
    (
        "/generate",
        {
            "text": ["a", "b"],
            "sampling_params": SP,
            "return_logprob": True,
            "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
            "logprob_start_len": 0,
        },
    ),
    ("/generate", {"input_ids": [1, 2, 3], "sampling_params": {**SP, "n": 2}, "stream": True}),
    ("/generate", {"text": "Hello", "sampling_params": SP, "stream": True, "return_logprob": True}),
    (
        "/v1/completions",
        {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "logprobs": 2, "echo": True},
    ),
    (
        "/v1/completions",
        {"prompt": ["a", "b"], "max_tokens": 3, "n": 2, "temperature": 0.5, "seed": 1},
    ),
    (
        "/v1/completions",
        {
            "prompt": "Hello",
            "max_tokens": 3,
            "stream": True,
            "logprobs": 1,
            "stream_options": {"include_usage": True},
        },
    ),
    (
        "/v1/chat/completions",
        {"messages": MSGS, "max_tokens": 3, "logprobs": True, "top_logprobs": 2},
    ),
    (
        "/v1/chat/completions",
        {
            "model": SERVED_MODEL_NAME,
            "messages": MSGS,
            "max_completion_tokens": 3,
            "stream": True,
            "n": 2,
            "stream_options": {"include_usage": True},
        },
    ),
]


@pytest.mark.parametrize(
    "path,body", GENERATIONS, ids=[f"{p} {i}" for i, (p, _) in enumerate(GENERATIONS)]
)
def test_generation_answers_match_the_published_schemas(live, schemas, path, body):
    r = live.http.post(path, json=body, headers={"X-PDServe-Timeline": "1"})
    assert r.status_code == 200, r.text
    assert schemas.body_valid(path, body)
    schemas.check_answer("post", path, r)


def test_other_answers_match_the_published_schemas(live, schemas):
    for path in (
        "/v1/models",
        "/server_info",
        "/get_server_info",
        "/model_info",
        "/get_load",
        "/debug/integrity",
    ):
        r = live.http.get(path)
        assert r.status_code == 200, (path, r.text)
        schemas.check_answer("get", path, r)
    for method in ("get", "post"):
        r = live.http.request(method, "/flush_cache")
        assert r.status_code == 200, r.text
        schemas.check_answer(method, "/flush_cache", r)
    r = live.http.post("/abort_request", json={"rid": "nobody"})
    assert r.status_code == 200 and r.json() == {"aborted": 0}
    schemas.check_answer("post", "/abort_request", r)
    assert live.http.get("/health").status_code == 200 and live.http.get("/health").content == b""
    assert live.http.get("/metrics").headers["content-type"].startswith("text/plain")
    # error answers, also inside a stream
    r = live.http.post("/v1/completions", json={"prompt": "x", "model": "other"})
    assert r.status_code == 404
    schemas.check_answer("post", "/v1/completions", r)
    r = live.http.post("/generate", json={"text": "x", "sampling_params": {"top_p": 0}})
    assert r.status_code == 400
    schemas.check_answer("post", "/generate", r)


# (path, body): the schema and the route must agree on each (valid <=> 200). Token ids out of the
# vocabulary, prompts beyond the context and model names are facts of the running server that
# no static schema can state; they are left out here.
CASES = [
    ("/generate", {"text": "hi"}),
    ("/generate", {"input_ids": [5, 6]}),
    ("/generate", {}),
    ("/generate", {"text": "hi", "input_ids": [1]}),
    ("/generate", {"text": None, "input_ids": [1]}),
    ("/generate", {"text": 3}),
    ("/generate", {"text": []}),
    ("/generate", {"input_ids": [[1], [2]]}),
    ("/generate", {"input_ids": [[1], "x"]}),
    ("/generate", {"input_ids": [1.5]}),
    ("/generate", {"text": "hi", "sampling_params": None}),
    ("/generate", {"text": "hi", "sampling_params": []}),
    ("/generate", {"text": ["a", "b"], "sampling_params": [SP, None]}),
    ("/generate", {"text": "hi", "return_logprob": 1}),
    ("/generate", {"text": ["a", "b"], "return_logprob": [True, False]}),
    ("/generate", {"text": "hi", "top_logprobs_num": -1}),
    ("/generate", {"text": "hi", "logprob_start_len": -2}),
    ("/generate", {"text": "hi", "rid": 7}),
    ("/generate", {"text": "hi", "stream": "yes"}),
    ("/generate", {"text": "hi", "bootstrap_port": 70000}),
    ("/generate", {"text": "hi", "bootstrap_room": -1}),
    ("/generate", {"text": "hi", "routed_dp_rank": -1}),
    ("/generate", {"text": "hi", "routed_dp_rank": 0}),
    ("/generate", {"text": "hi", "sampling_params": {"stop": "x"}}),
    ("/generate", {"text": "hi", "sampling_params": {"stop": ""}}),
    ("/generate", {"text": "hi", "sampling_params": {"stop": [1]}}),
    ("/generate", {"text": "hi", "sampling_params": {"top_k": 0}}),
    ("/generate", {"text": "hi", "sampling_params": {"top_k": -1}}),
    ("/generate", {"text": "hi", "sampling_params": {"seed": 1.5}}),
    ("/generate", {"text": "hi", "sampling_params": {"ignore_eos": "no"}}),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": None}}),
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/completions", {}),
    ("/v1/completions", {"prompt": []}),
    ("/v1/completions", {"prompt": [1, 2]}),
    ("/v1/completions", {"prompt": [[1], [2]]}),
    ("/v1/completions", {"prompt": [1, "a"]}),
    ("/v1/completions", {"prompt": {"text": "hi"}}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "3"}),
    ("/v1/completions", {"prompt": "hi", "n": 2.5}),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b"]}),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": 1}}),
    ("/v1/completions", {"prompt": "hi", "echo": "yes"}),
    ("/v1/completions", {"prompt": "hi", "bootstrap_room": 2**63}),
    ("/v1/chat/completions", {"messages": MSGS}),
    ("/v1/chat/completions", {}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": "hi"}),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("/v1/chat/completions", {"messages": MSGS, "logprobs": "yes"}),
    ("/abort_request", {"rid": "x"}),
    ("/abort_request", {"rid": 5}),
    ("/abort_request", {"abort_all": "yes"}),
]
# each range SamplingParams.validate enforces, just inside and just outside
for name, inside, outside in [
    ("max_new_tokens", 0, -1),
    ("min_new_tokens", 0, -1),
    ("temperature", 0, -0.5),
    ("temperature", 3.4e38, 6.4e307),  # past float32: the sampler's NaN (it crashed the scheduler)
    ("repetition_penalty", 1e6, 1.5e6),
    ("top_p", 1, 0),
    ("top_p", 0.5, 1.5),
    ("min_p", 1, 1.5),
    ("repetition_penalty", 0.5, 0),
    ("frequency_penalty", -2, -2.5),
    ("presence_penalty", 2, 2.5),
    ("n", 1, 0),
]:
    CASES += [
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1, name: v}})
        for v in (inside, outside)
    ]
# a temperature past float32 with a grammar: masked logits -inf / inf were NaN, and drawing from
# them crashed the scheduler (found by the fuzz test)
CASES.append(
    (
        "/generate",
        {
            "text": "hi",
            "sampling_params": {"temperature": 6.4e307, "json_schema": '{"type": "object"}'},
        },
    )
)


def _with_small_output(path: str, body: dict) -> dict:
    if path == "/generate" and isinstance(body.get("sampling_params"), dict):
        return {**body, "sampling_params": {"max_new_tokens": 1, **body["sampling_params"]}}
    if path == "/generate" and "sampling_params" not in body:
        return {**body, "sampling_params": {"max_new_tokens": 1}}
    return {**body, "max_tokens": body.get("max_tokens", 1)} if path != "/abort_request" else body


def test_request_schemas_accept_what_the_routes_accept(live, schemas):
    disagree = []
    for path, body in CASES:
        body = _with_small_output(path, body)
        r = live.http.post(path, json=body)
        assert r.status_code in (200, 400), (path, body, r.status_code, r.text)
        if (r.status_code == 200) != schemas.body_valid(path, body):
            disagree.append((path, body, r.status_code, r.text[:200]))
    assert not disagree, "schema and route disagree:\n" + "\n".join(map(str, disagree))
