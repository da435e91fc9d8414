"""The server's ``/openapi.json``: each route's body is the msgspec type it decodes with
(``GenerateRequest``, ``CompletionRequest``, ``ChatRequest``, ...), each answer one of the
shapes below. The handlers build their answers as plain dicts (no model instance per request);
``tests/e2e/test_openapi.py`` validates real answers, streamed chunks included, against these
shapes, and checks that the request schemas accept and refuse what the routes do.

``sampling_params`` of ``/generate`` is the engine's ``SamplingParams`` (its fields, types and
defaults); ``SAMPLING_BOUNDS`` states the ranges its ``validate`` enforces.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

import msgspec

from pdserve.engine.request import (
    INT64_MAX,
    INT64_MIN,
    MAX_TEMPERATURE,
    MAX_TOP_LOGPROBS,
    SamplingParams,
)
from pdserve.openapi import Docs, Operation
from pdserve.peers import MigrationPeers
from pdserve.server.generate_api import GenerateRequest
from pdserve.server.messages_protocol import MessagesRequest
from pdserve.server.openai_protocol import (
    EBNF_PARAM,
    GRAMMAR_KEYS,
    JSON_SCHEMA_PARAM,
    REGEX_PARAM,
    ChatRequest,
    CompletionRequest,
    at_most_one,
)
from pdserve.server.responses_protocol import ResponsesRequest
from pdserve.server.role_switch import SwitchRoleRequest
from pdserve.server.tokenizer_manager import MAX_N

Object = dict[str, Any]
Timeline = Optional[dict[str, float]]  # with the X-PDServe-Timeline: 1 header, once finished
Matched = Union[int, str, None]  # the stop token id or string that ended the choice
FinishReason = Optional[Literal["stop", "length", "abort", "tool_calls"]]


# ---- errors and shared parts ------------------------------------------------------------------
class ErrorBody(msgspec.Struct):
    message: str
    type: str
    code: int


class ErrorResponse(msgspec.Struct):
    """Every error, native or OpenAI (in a stream: one event, then [DONE])."""

    error: ErrorBody


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class SGLangExt(msgspec.Struct):
    routed_experts: str  # base64 of little-endian int32 [tokens, layers, top_k]


# ---- /v1/completions ----------------------------------------------------------------------------
class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs]
    finish_reason: Optional[str]
    matched_stop: Matched
    timeline: Timeline = None


class Completion(msgspec.Struct):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    sglext: Optional[SGLangExt] = None


class CompletionChunk(msgspec.Struct):
    """A streamed update; the last chunks may have no choices (sglext, then usage if asked)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None
    sglext: Optional[SGLangExt] = None


# ---- /v1/chat/completions -----------------------------------------------------------------------
class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob]


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text


class ToolCall(msgspec.Struct):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(msgspec.Struct):
    role: Literal["assistant"]
    content: Optional[str]
    reasoning_content: Optional[str] = None  # with --reasoning-parser
    tool_calls: Optional[list[ToolCall]] = None


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs]
    finish_reason: FinishReason
    matched_stop: Matched
    timeline: Timeline = None


class ChatCompletion(msgspec.Struct):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    sglext: Optional[SGLangExt] = None


# ---- /v1/responses and /v1/messages -------------------------------------------------------------
class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(msgspec.Struct):
    """OpenAI's Response: its output items are reasoning, message and function_call items."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[dict[str, Any]]
    usage: Optional[ResponseUsage]
    previous_response_id: Optional[str]
    incomplete_details: Optional[dict[str, str]]


class ResponseEvent(msgspec.Struct):
    """One event of a streamed Response (``event: <type>``), numbered from 0; the last is
    ``response.completed`` or ``response.incomplete`` (an ``error`` event after output began)."""

    type: str
    sequence_number: int


class ResponseDeleted(msgspec.Struct):
    id: str
    object: Literal["response.deleted"]
    deleted: bool


class AnthropicUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class AnthropicMessage(msgspec.Struct):
    """Anthropic's Message: text, thinking and tool_use content blocks."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: Optional[Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]]
    stop_sequence: Optional[str]
    usage: AnthropicUsage


class AnthropicEvent(msgspec.Struct):
    """One event of a streamed Message (``event: <type>``): message_start, the content blocks'
    start, deltas and stop, message_delta, then message_stop last (an error event instead)."""

    type: Literal[
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
        "ping",
    ]


class AnthropicErrorBody(msgspec.Struct):
    type: str
    message: str


class AnthropicError(msgspec.Struct):
    """Every error of /v1/messages, in Anthropic's shape."""

    type: Literal["error"]
    error: AnthropicErrorBody


class TokenCount(msgspec.Struct):
    input_tokens: int


class FunctionCallDelta(msgspec.Struct):
    name: Optional[str] = None  # in a call's first delta
    arguments: Optional[str] = None  # more of the JSON text


class ToolCallDelta(msgspec.Struct):
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[FunctionCallDelta] = None


class ChatDelta(msgspec.Struct):
    content: Optional[str] = None
    role: Optional[Literal["assistant"]] = None  # in a choice's first chunk
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[ToolCallDelta]] = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: Optional[ChatLogprobs]
    finish_reason: FinishReason
    matched_stop: Matched
    timeline: Timeline = None


class ChatCompletionChunk(msgspec.Struct):
    """A streamed update; the last chunks may have no choices (sglext, then usage if asked)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None
    sglext: Optional[SGLangExt] = None


# ---- /generate ----------------------------------------------------------------------------------
LogprobEntry = tuple[Optional[float], int, Optional[str]]  # (logprob, token id, its text if asked)


class FinishReasonBody(msgspec.Struct):
    type: Literal["stop", "length", "abort"]
    matched: Matched = None
    length: Optional[int] = None
    message: Optional[str] = None
    status_code: Optional[int] = None


class MetaInfo(msgspec.Struct):
    id: str
    finish_reason: Optional[FinishReasonBody]  # null until finished (streams)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    e2e_latency: float
    input_token_logprobs: Optional[list[LogprobEntry]] = None
    output_token_logprobs: Optional[list[LogprobEntry]] = None
    input_top_logprobs: Optional[list[Optional[list[LogprobEntry]]]] = None
    output_top_logprobs: Optional[list[list[LogprobEntry]]] = None
    routed_experts: Optional[str] = None
    timeline: Timeline = None


class GenerateOutput(msgspec.Struct):
    """One generation (a list of them for a batch or n > 1: item i, sample j at i * n + j)."""

    text: str
    output_ids: list[int]
    meta_info: MetaInfo


class GenerateChunk(msgspec.Struct):
    """A streamed update: the text and output ids so far; ``index`` for a batch or n > 1."""

    text: str
    output_ids: list[int]
    meta_info: MetaInfo
    index: Optional[int] = None


# ---- the other routes ---------------------------------------------------------------------------
class ModelCard(msgspec.Struct):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int
    parent: Optional[str] = None  # a LoRA adapter's base model


class ModelList(msgspec.Struct):
    object: Literal["list"]
    data: list[ModelCard]


class ModelInfo(msgspec.Struct):
    model_path: str
    tokenizer_path: Optional[str]
    is_generation: bool
    served_model_name: str
    context_length: Optional[int]
    vocab_size: Optional[int]
    model_fingerprint: Any
    eos_token_ids: Optional[list[int]]
    page_size: Optional[int]


class ServerInfo(msgspec.Struct):
    """Every server argument (secrets shown as ``***``), and these."""

    status: str
    version: str
    model_path: str
    served_model_name: str
    disaggregation_mode: str
    tp_size: int
    dp_size: int
    max_total_num_tokens: Optional[int]
    model_context_length: int
    scheduler_info: Object
    internal_states: list[Object]  # one per DP group
    calibration: Optional[Object]
    host_id: str


class DPLoad(msgspec.Struct):
    dp_rank: int
    num_reqs: int
    num_waiting_reqs: int
    num_tokens: int
    num_shed_reqs: int  # refused or shed by the full queue since start (--max-queued-requests)
    kv_transfer_bytes_per_s: Optional[int] = None
    # a PD server's queues: a prefill's requests waiting for decode's pages and being sent, a
    # decode's waiting for KV pages and for their KV
    bootstrap_queue: Optional[int] = None
    inflight_queue: Optional[int] = None
    prealloc_queue: Optional[int] = None
    transfer_queue: Optional[int] = None


class Aborted(msgspec.Struct):
    aborted: int  # how many requests


class Success(msgspec.Struct):
    success: bool


class Integrity(msgspec.Struct):
    ok: bool
    integrity: Optional[Object] = None
    front_end_requests: Optional[int] = None
    error: Optional[str] = None


INT64 = {"type": "integer", "minimum": INT64_MIN, "maximum": INT64_MAX}  # what crosses to ranks


# ---- sampling_params ----------------------------------------------------------------------------
# The ranges SamplingParams.validate enforces (tests/e2e/test_openapi.py probes each edge).
SAMPLING_BOUNDS: dict[str, dict[str, float]] = {
    "max_new_tokens": {"minimum": 0, "maximum": INT64_MAX},
    "min_new_tokens": {"minimum": 0, "maximum": INT64_MAX},
    "seed": {"minimum": INT64_MIN, "maximum": INT64_MAX},
    "temperature": {"minimum": 0, "maximum": MAX_TEMPERATURE},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "min_p": {"minimum": 0, "maximum": 1},
    "repetition_penalty": {"minimum": 1e-6, "maximum": 1e6},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "n": {"minimum": 1, "maximum": MAX_N},
}


def sampling_params_schema() -> dict[str, Any]:
    """``SamplingParams``' fields as the body gives them: each may be null (the default then),
    ``stop`` may be one string, top_k is -1 or >= 1; ``no_stop_trim`` is read by /generate."""
    (_,), components = msgspec.json.schema_components(
        [SamplingParams], ref_template="#/components/schemas/{name}"
    )
    schema = components["SamplingParams"]
    props = schema["properties"]
    text = {"type": "string", "minLength": 1}
    props["stop"] = {"anyOf": [text, {"type": "array", "items": text}]}
    props["json_schema"] = JSON_SCHEMA_PARAM
    props["regex"] = REGEX_PARAM
    props["ebnf"] = EBNF_PARAM
    props["top_k"] = {
        "anyOf": [{"const": -1}, {"type": "integer", "minimum": 1, "maximum": INT64_MAX}],
        "default": -1,
    }
    props["no_stop_trim"] = {"type": "boolean", "default": False}
    props["stop_token_ids"] = {"type": "array", "items": INT64}
    for name, prop in props.items():
        bound = {**prop, **SAMPLING_BOUNDS.get(name, {})}
        default = bound.pop("default", None)
        props[name] = {"anyOf": [bound, {"type": "null"}], "default": default}
    schema["description"] = "Sampling parameters; unknown keys are ignored."
    schema.update(at_most_one(GRAMMAR_KEYS))
    return {"SamplingParams": schema}


# the OpenAI fields SamplingParams.validate checks, under their OpenAI names
OPENAI_BOUNDS = {
    **{k: v for k, v in SAMPLING_BOUNDS.items() if k not in ("max_new_tokens", "min_new_tokens")},
    "max_tokens": SAMPLING_BOUNDS["max_new_tokens"],
    "max_completion_tokens": SAMPLING_BOUNDS["max_new_tokens"],
    "min_tokens": SAMPLING_BOUNDS["min_new_tokens"],
    "top_k": {},
}


def _openai_bounds(component: dict) -> None:
    props = component["properties"]
    for name, bound in OPENAI_BOUNDS.items():
        if name not in props:  # max_completion_tokens: chat only
            continue
        if name == "top_k":  # -1 (off) or >= 1
            props[name] = {
                "anyOf": [
                    {"type": "null"},
                    {"enum": [-1]},
                    {"type": "integer", "minimum": 1, "maximum": INT64_MAX},
                ]
            }
            continue
        for branch in props[name].get("anyOf", [props[name]]):
            if branch.get("type") in ("integer", "number"):
                branch.update(bound)
    text = {"type": "string", "minLength": 1}
    props["stop"] = {"anyOf": [{"type": "null"}, text, {"type": "array", "items": text}]}
    props["stop_token_ids"] = {"anyOf": [{"type": "null"}, {"type": "array", "items": INT64}]}
    top = {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}
    if "top_logprobs" in props:  # chat: top_logprobs needs logprobs true
        props["top_logprobs"] = {"anyOf": [{"type": "null"}, top]}
        component["if"] = _present_key("top_logprobs")
        component["then"] = {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}
    else:  # completions: logprobs is the number of alternatives
        props["logprobs"] = {"anyOf": [{"type": "null"}, top]}


def _present_key(name: str) -> dict:
    return {"required": [name], "properties": {name: {"not": {"type": "null"}}}}


def server_facts(tm) -> dict[str, dict]:
    """Components only the running server knows: its vocabulary, model name, DP groups and the
    decodes it may exchange moved requests with."""
    peers = MigrationPeers.of(tm.server_args.migration_peers)
    return {
        "MigrationTarget": {
            "description": "a decode's base URL among --migration-peers",
            **peers.target_schema(),
        },
        "MigrationPeerHost": {
            "description": "a host among --migration-peers",
            **peers.host_schema(),
        },
        "TokenId": {"type": "integer", "minimum": 0, "maximum": tm.vocab_size - 1},
        "ModelName": {"anyOf": [{"type": "null"}, {"enum": ["", tm.server_args.served_model_name]}]}
        if not tm.server_args.enable_lora  # adapters come and go: any name, 404 if not served
        else {"type": ["string", "null"]},
        "LoraName": {"type": ["string", "null"]}
        if tm.server_args.enable_lora
        else {"type": "null"},
        "RoutedDPRank": {"type": "integer", "minimum": 0, "maximum": tm.dp_size - 1},
        # images: only a vision-language model takes them (pdserve/multimodal/)
        "ImagePart": {
            "type": "object",
            "required": ["type", "image_url"],
            "properties": {
                "type": {"const": "image_url"},
                "image_url": {
                    "type": "object",
                    "required": ["url"],
                    "properties": {"url": {"type": "string", "description": "a data: URL"}},
                },
            },
        }
        if tm.takes_images
        else {"not": {}},
        "ImageData": {
            "anyOf": [
                {"type": "null"},
                {"type": "string"},
                {"type": "array", "items": {"type": ["string", "array"]}},
            ]
        }
        if tm.takes_images
        else {"type": "null"},
        "EncoderAddrs": {
            "anyOf": [
                {"type": "null"},
                {"type": "array", "items": {"type": "string", "pattern": "^tcp://"}},
            ]
        }
        if tm.takes_images and tm.server_args.disaggregation_mode != "decode"
        else {"type": "null"},
    }


# ---- the routes ---------------------------------------------------------------------------------
GENERATION_ERRORS = (400, 404, 413, 503)


def route_docs(tm) -> Docs:
    """Every route's documentation; those this server answers only with an error as it runs (a
    feature it was started without, a role it does not have now) are not offered."""
    from pdserve.server.app import AbortRequest  # app imports this module

    args = tm.server_args
    decode = args.disaggregation_mode == "decode"
    experts = bool(args.expert_distribution_recorder_mode)

    docs: Docs = {
        ("post", "/generate"): Operation(
            "Generate (SGLang's native API)",
            GenerateRequest,
            Union[GenerateOutput, list[GenerateOutput]],
            GenerateChunk,
            errors=GENERATION_ERRORS,
        ),
        ("post", "/v1/completions"): Operation(
            "OpenAI completions",
            CompletionRequest,
            Completion,
            CompletionChunk,
            errors=GENERATION_ERRORS,
        ),
        ("post", "/v1/chat/completions"): Operation(
            "OpenAI chat completions",
            ChatRequest,
            ChatCompletion,
            ChatCompletionChunk,
            errors=GENERATION_ERRORS,
        ),
        ("post", "/v1/responses"): Operation(
            "OpenAI Responses (stored for previous_response_id unless store is false)",
            ResponsesRequest,
            ResponseObject,
            ResponseEvent,
            errors=(*GENERATION_ERRORS, 429),
        ),
        ("get", "/v1/responses/{response_id}"): Operation(
            "A stored response", response=ResponseObject, errors=(404,)
        ),
        ("delete", "/v1/responses/{response_id}"): Operation(
            "Delete a stored response", response=ResponseDeleted, errors=(404,)
        ),
        ("post", "/v1/messages"): Operation(
            "Anthropic Messages",
            MessagesRequest,
            AnthropicMessage,
            AnthropicEvent,
            errors=(*GENERATION_ERRORS, 429),
            error=AnthropicError,
        ),
        ("post", "/v1/messages/count_tokens"): Operation(
            "Anthropic's token count of a Messages request",
            MessagesRequest,
            TokenCount,
            errors=(400, 404, 413),
            error=AnthropicError,
        ),
        ("post", "/abort_request"): Operation(
            "Abort a request by rid, or all", AbortRequest, Aborted
        ),
        ("get", "/health"): Operation(
            "200 once ready (warm-up passed), 503 before or once the scheduler is gone",
            errors=(503,),
        ),
        ("get", "/health_generate"): Operation(
            "Generate one token; 200 if that works", errors=(503,)
        ),
        ("get", "/v1/models"): Operation("The served model", response=ModelList, errors=()),
        ("get", "/get_load"): Operation("Load per DP group", response=list[DPLoad], errors=(503,)),
        ("get", "/kv_events/snapshot"): Operation(
            "The radix cache as KV events per DP group",
            response=Object,
            errors=(503,),
            offered=bool(args.kv_events_endpoint),
        ),
        ("get", "/metrics"): Operation("Prometheus metrics", media_type="text/plain", errors=()),
        ("get", "/debug/integrity"): Operation(
            "The pools' accounting", response=Integrity, errors=(500,)
        ),
    }
    for path in ("/server_info", "/get_server_info"):
        docs[("get", path)] = Operation(
            "Server arguments and state", response=ServerInfo, errors=()
        )
    for path in ("/model_info", "/get_model_info"):
        docs[("get", path)] = Operation("Model facts", response=ModelInfo, errors=())
    for method in ("get", "post"):
        docs[(method, "/flush_cache")] = Operation(
            "Empty the prefix cache (400 while requests run)", response=Success
        )
        for action in ("start", "stop", "dump"):
            docs[(method, f"/{action}_expert_distribution_record")] = Operation(
                f"MoE expert load record: {action}",
                response=Object,
                errors=(400, 503),
                offered=experts,
            )
    from pdserve.server.migrate_api import MigrateBody, MigrateIn

    docs[("post", "/migrate")] = Operation(
        "Move running requests to another decode, KV and all (decode only)",
        MigrateBody,
        Object,
        errors=(400, 403, 409),
        offered=decode,
    )
    docs[("post", "/migrate_in")] = Operation(
        "Take a request moved from another decode (decode to decode; JSON lines of outputs)",
        MigrateIn,
        Object,
        media_type="application/jsonl",
        errors=(400, 403, 503),
        offered=decode,
    )
    docs[("post", "/switch_role")] = Operation(
        "Switch between prefill, decode and colocated, keeping the weights",
        SwitchRoleRequest,
        Object,
        errors=(400, 403, 409, 500, 503),
    )
    from pdserve.server import lora_api

    docs.update(lora_api.docs(args))
    return docs


def install(app, tm) -> None:
    from pdserve import openapi

    def components() -> dict[str, dict]:
        return {**sampling_params_schema(), **server_facts(tm)}

    openapi.install(app, lambda: route_docs(tm), ErrorResponse, components)
    build = app.openapi

    def with_openai_bounds() -> dict:
        first = app.openapi_schema is None
        spec = build()
        if first:
            for name in ("ChatRequest", "CompletionRequest"):
                _openai_bounds(spec["components"]["schemas"][name])
        return spec

    app.openapi = with_openai_bounds
