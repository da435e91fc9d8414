"""OpenAI request bodies (typed; unknown fields ignored) and their mapping to our parameters.

A field whose rule is checked here by hand (typed ``Any`` for msgspec) carries that rule's JSON
Schema next to the check, for /openapi.json (``server/api_schema.py``); ``REQUIRED`` names the
fields a body must have."""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Optional, Union

import msgspec

from pdserve.engine.request import INT64_MAX, MAX_TOP_LOGPROBS
from pdserve.multimodal.images import image_url_of
from pdserve.server.errors import bad_request

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}
ROOM_MOD = 2**63
DP_RANK_LIMIT = 2**31


def _one_or_list(item: dict[str, Any]) -> dict[str, Any]:
    """A value for every prompt, or a list: one per prompt, or one per sample (``_for_prompt``)."""
    return {"anyOf": [item, {"type": "array", "items": item}]}


# what split_bootstrap and split_dp_ranks accept
BOOTSTRAP_SCHEMAS = {
    "bootstrap_host": _one_or_list({"type": ["string", "null"]}),
    "bootstrap_port": _one_or_list({"type": ["integer", "null"], "minimum": 0, "maximum": 65535}),
    "bootstrap_room": _one_or_list(
        {"type": ["integer", "null"], "minimum": 0, "exclusiveMaximum": ROOM_MOD}
    ),
}
DPRank = Annotated[
    Any,
    msgspec.Meta(
        description="attention-DP group (null: the server chooses)",
        extra_json_schema=_one_or_list(
            {"type": ["integer", "null"], "minimum": 0, "exclusiveMaximum": DP_RANK_LIMIT}
        ),
    ),
]
# routed_dp_rank must also name one of the server's DP groups (its count: a server fact)
RoutedDPRank = Annotated[
    Any,
    msgspec.Meta(
        description="attention-DP group to run in (null: the server chooses)",
        extra_json_schema=_one_or_list(
            {"anyOf": [{"type": "null"}, {"$ref": "#/components/schemas/RoutedDPRank"}]}
        ),
    ),
]
TOKEN_ID = {"$ref": "#/components/schemas/TokenId"}  # [0, vocab size), published by the server
GRAMMAR_KEYS = ("json_schema", "regex", "ebnf")


def _given(name: str) -> dict[str, Any]:
    return {"required": [name], "properties": {name: {"not": {"type": "null"}}}}


def at_most_one(names: tuple[str, ...], also: Optional[str] = None) -> dict[str, Any]:
    """No two of ``names`` given (null counts as absent), nor one of them with ``also``, a
    response_format other than text: ``spec_from_sampling``'s rule."""
    pairs = [{"allOf": [_given(a), _given(b)]} for i, a in enumerate(names) for b in names[i + 1 :]]
    if also:
        constraining = {
            "required": [also],
            "properties": {
                also: {"type": "object", "not": {"properties": {"type": {"const": "text"}}}}
            },
        }
        pairs += [{"allOf": [_given(a), constraining]} for a in names]
    return {"not": {"anyOf": pairs}}


RESPONSE_FORMAT = {
    "anyOf": [
        {"type": "null"},
        {
            "type": "object",
            "required": ["type"],
            "properties": {"type": {"enum": ["text", "json_object"]}},
        },
        {
            "type": "object",
            "required": ["type", "json_schema"],
            "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "minLength": 1},
                        "description": {"type": "string"},
                        "schema": {"type": ["object", "boolean"]},
                        "strict": {"type": ["boolean", "null"]},
                    },
                },
            },
        },
    ]
}


# the grammar parameters as spec_from_sampling takes them (the grammar engine may still refuse
# a grammar it cannot compile: that is no schema's to say)
# a JSON Schema as JSON text, and a grammar in GBNF (the EBNF of llama.cpp and xgrammar, start
# symbol root): "format" names what the string must parse as (an OpenAPI custom format)
JSON_SCHEMA_TEXT = {
    "type": "string",
    "contentMediaType": "application/json",
    "format": "json-schema",
}
EBNF_TEXT = {"type": "string", "minLength": 1, "format": "gbnf"}
# (the schema false accepts no value: refused)
JSON_SCHEMA_PARAM = {"anyOf": [{"type": ["object", "null"]}, {"const": True}, JSON_SCHEMA_TEXT]}
REGEX_PARAM = {"anyOf": [{"type": "null"}, {"type": "string", "minLength": 1, "format": "regex"}]}
EBNF_PARAM = {"anyOf": [{"type": "null"}, EBNF_TEXT]}


# the body's ``model`` (every generation route)
ModelName = Annotated[
    Any,
    msgspec.Meta(
        description="the served model's name (null or empty: that model)",
        extra_json_schema={"$ref": "#/components/schemas/ModelName"},
    ),
]
# -1 (off) or at least 1 (the Responses and Messages bodies; chat's is set in api_schema.py)
TopK = Annotated[
    Any,
    msgspec.Meta(
        extra_json_schema={
            "anyOf": [
                {"type": "null"},
                {"enum": [-1]},
                {"type": "integer", "minimum": 1, "maximum": INT64_MAX},
            ]
        }
    ),
]


class PDBody(msgspec.Struct):
    """The disaggregation fields a router adds to a request body (/generate and the OpenAI
    routes alike): scalars, or lists with one entry per prompt or per sample (checked by
    ``split_bootstrap`` and ``split_dp_ranks``)."""

    bootstrap_host: Annotated[
        Any, msgspec.Meta(extra_json_schema=BOOTSTRAP_SCHEMAS["bootstrap_host"])
    ] = None
    bootstrap_port: Annotated[
        Any, msgspec.Meta(extra_json_schema=BOOTSTRAP_SCHEMAS["bootstrap_port"])
    ] = None
    bootstrap_room: Annotated[
        Any, msgspec.Meta(extra_json_schema=BOOTSTRAP_SCHEMAS["bootstrap_room"])
    ] = None
    routed_dp_rank: RoutedDPRank = None
    disagg_prefill_dp_rank: DPRank = None
    data_parallel_rank: RoutedDPRank = None  # deprecated alias of routed_dp_rank
    # EPD: the encoder servers (tcp://host:port) that compute this request's image embeddings,
    # its images spread over them in turn (a router with --encoder adds it)
    encoder_addrs: Annotated[
        Any, msgspec.Meta(extra_json_schema={"$ref": "#/components/schemas/EncoderAddrs"})
    ] = None

    def pd_fields(self, num_prompts: int, n: int) -> list[dict[str, Any]]:
        """Each prompt's bootstrap and DP rank fields (``ReqSpec``'s PD fields)."""
        boots = split_bootstrap(
            self.bootstrap_host, self.bootstrap_port, self.bootstrap_room, num_prompts, n
        )
        ranks = split_dp_ranks(
            self.routed_dp_rank,
            self.disagg_prefill_dp_rank,
            self.data_parallel_rank,
            num_prompts,
            n,
        )
        return [{**b, **r} for b, r in zip(boots, ranks, strict=True)]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Sampling(PDBody):
    # at most one output constraint (a response_format other than text counts as one)
    JSON_SCHEMA: ClassVar[dict[str, Any]] = at_most_one(GRAMMAR_KEYS, also="response_format")

    model: ModelName = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None
    n: int = 1
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    return_routed_experts: bool = False  # SGLang's extension: the answer's sglext.routed_experts
    # vLLM's and SGLang's extension: the waiting queue's order under --enable-priority-scheduling
    priority: Optional[Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]] = None
    # structured outputs (server/constraints.py): OpenAI's response_format, or SGLang's extensions
    response_format: Annotated[
        Any,
        msgspec.Meta(
            description="text, json_object, or json_schema with its schema",
            extra_json_schema=RESPONSE_FORMAT,
        ),
    ] = None
    json_schema: Annotated[Any, msgspec.Meta(extra_json_schema=JSON_SCHEMA_PARAM)] = None
    regex: Annotated[Any, msgspec.Meta(extra_json_schema=REGEX_PARAM)] = None
    ebnf: Annotated[Any, msgspec.Meta(extra_json_schema=EBNF_PARAM)] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None

    def sampling_params(self, max_new_tokens: Optional[int]) -> dict[str, Any]:
        d = {
            "max_new_tokens": max_new_tokens,
            "min_new_tokens": self.min_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "n": self.n,
            "json_schema": self.json_schema,
            "regex": self.regex,
            "ebnf": self.ebnf,
        }
        return {k: v for k, v in d.items() if v is not None}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def bootstrap(self, num_prompts: int = 1) -> list[dict[str, Any]]:
        return self.pd_fields(num_prompts, self.n)


def _for_prompt(name: str, value: Any, j: int, num_prompts: int, n: int, per_sample: bool) -> Any:
    """Prompt ``j``'s share of a field sent as a scalar (all prompts), a list with one entry per
    prompt, or a list with one entry per sample (``per_sample``: prompt j's n entries; else the
    first of them)."""
    if not isinstance(value, list):
        return value
    if len(value) == num_prompts:
        return value[j]
    if len(value) == num_prompts * n:
        return value[j * n : (j + 1) * n] if per_sample else value[j * n]
    raise bad_request(
        f"{name}: the list has {len(value)} entries for {num_prompts} prompt(s) x n={n}"
    )


def split_bootstrap(
    host: Any, port: Any, room: Any, num_prompts: int, n: int
) -> list[dict[str, Any]]:
    """Per prompt: ``bootstrap_host/port`` and ``bootstrap_room``, where the room is an int
    (sample i of the prompt uses room + i) or a list with one room per sample.

    Accepted shapes, as routers send them: a scalar (prompt j gets room + j * n), a list with one
    entry per prompt, or a list with one entry per sample (num_prompts * n). Prefill and decode
    get the same body, so both derive the same room for every sample."""
    n = max(1, n) if isinstance(n, int) else 1
    kinds = {"bootstrap_host": str, "bootstrap_port": int, "bootstrap_room": int}
    for name, value in (
        ("bootstrap_host", host),
        ("bootstrap_port", port),
        ("bootstrap_room", room),
    ):
        for v in value if isinstance(value, list) else [value]:
            if v is not None and (isinstance(v, bool) or not isinstance(v, kinds[name])):
                raise bad_request(
                    f"{name}: must be {'a string' if name == 'bootstrap_host' else 'an integer'}, "
                    f"got {v!r}"
                )
            if name == "bootstrap_room" and v is not None and not 0 <= v < ROOM_MOD:
                raise bad_request(f"bootstrap_room: must be in [0, 2^63), got {v}")
            if name == "bootstrap_port" and v is not None and not 0 <= v < 65536:
                raise bad_request(f"bootstrap_port: must be a TCP port in [0, 65536), got {v}")

    def room_of(j: int) -> Any:
        if isinstance(room, int):
            return (room + j * n) % ROOM_MOD
        return _for_prompt("bootstrap_room", room, j, num_prompts, n, per_sample=True)

    return [
        {
            "bootstrap_host": _for_prompt(
                "bootstrap_host", host, j, num_prompts, n, per_sample=False
            ),
            "bootstrap_port": _for_prompt(
                "bootstrap_port", port, j, num_prompts, n, per_sample=False
            ),
            "bootstrap_room": room_of(j),
        }
        for j in range(num_prompts)
    ]


def split_dp_ranks(
    routed: Any, prefill: Any, alias: Any, num_prompts: int, n: int
) -> list[dict[str, Any]]:
    """Per prompt: ``routed_dp_rank`` (the DP group to run in; ``alias`` is its deprecated name
    ``data_parallel_rank``) and ``disagg_prefill_dp_rank`` (decode: the prefill DP group that
    holds the KV). Each is null (the server chooses) or an int >= 0, given as a scalar for every
    sample, or a list shaped like ``bootstrap_room``'s: one entry per prompt or per sample (a
    prompt then gets its samples' list)."""
    n = max(1, n) if isinstance(n, int) else 1
    for name, value in (
        ("routed_dp_rank", routed),
        ("disagg_prefill_dp_rank", prefill),
        ("data_parallel_rank", alias),
    ):
        for v in value if isinstance(value, list) else [value]:
            if v is not None and not (_is_int(v) and 0 <= v < DP_RANK_LIMIT):
                raise bad_request(f"{name}: must be null or an integer in [0, 2^31), got {v!r}")
    routed_name = "routed_dp_rank"
    if alias is not None:
        if routed is not None and routed != alias:
            raise bad_request(
                f"data_parallel_rank: is the deprecated alias of routed_dp_rank and disagrees with "
                f"it ({alias!r} vs {routed!r}); give only routed_dp_rank"
            )
        routed, routed_name = alias, "data_parallel_rank"
    return [
        {
            "routed_dp_rank": _for_prompt(routed_name, routed, j, num_prompts, n, per_sample=True),
            "disagg_prefill_dp_rank": _for_prompt(
                "disagg_prefill_dp_rank", prefill, j, num_prompts, n, per_sample=True
            ),
        }
        for j in range(num_prompts)
    ]


class CompletionRequest(_Sampling):
    REQUIRED: ClassVar[tuple[str, ...]] = ("prompt",)

    prompt: Annotated[
        Any,
        msgspec.Meta(
            description="a string, a list of strings, a list of token ids or a list of such lists",
            extra_json_schema={
                "anyOf": [
                    {"type": "string", "minLength": 1},
                    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                    {"type": "array", "items": TOKEN_ID, "minItems": 1},
                    {
                        "type": "array",
                        "items": {"type": "array", "items": TOKEN_ID, "minItems": 1},
                        "minItems": 1,
                    },
                ]
            },
        ),
    ] = None
    logprobs: Optional[int] = None
    echo: bool = False

    def prompts(self) -> list[Union[str, list[int]]]:
        """string | list of strings | token list | list of token lists -> list of prompts."""
        p = self.prompt
        if p is None:
            raise bad_request("prompt: is required")
        if isinstance(p, str):
            return [p]
        if isinstance(p, list) and p:
            if all(isinstance(x, str) for x in p):
                return list(p)
            if all(_is_int(x) for x in p):
                return [p]
            if all(isinstance(x, list) and all(_is_int(t) for t in x) for x in p):
                return list(p)
        if isinstance(p, list) and not p:
            raise bad_request("prompt: is empty")
        raise bad_request(
            "prompt: must be a string, a list of strings, "
            "a list of token ids or a list of such lists"
        )

    def top_logprobs(self) -> Optional[int]:
        if self.logprobs is None:
            return None
        if not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"logprobs: must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        return self.logprobs


_TEXT_PART = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
}
_TOOL_CALL = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string"},
                # JSON text (blank: no arguments), or the arguments
                "arguments": {
                    "anyOf": [
                        {"type": "object"},
                        {"type": "string", "pattern": "^\\s*$"},
                        {"type": "string", "contentMediaType": "application/json"},
                    ]
                },
            },
        },
    },
}
_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string"},
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "null"},
                {
                    "type": "array",
                    "items": {"anyOf": [_TEXT_PART, {"$ref": "#/components/schemas/ImagePart"}]},
                },
            ]
        },
        "tool_calls": {"type": ["array", "null"], "items": _TOOL_CALL},
        "tool_call_id": {"type": ["string", "null"]},
    },
}
_TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": "^[a-zA-Z0-9_.-]{1,64}$"},
                "description": {"type": "string"},
                "parameters": {"type": "object"},
                "strict": {"type": ["boolean", "null"]},
            },
        },
    },
}
_TOOL_CHOICE = {
    "anyOf": [
        {"type": "null"},
        {"enum": ["auto", "none", "required"]},
        {
            "type": "object",
            "required": ["type", "function"],
            "properties": {
                "type": {"const": "function"},
                "function": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {"name": {"type": "string", "minLength": 1}},
                },
            },
        },
    ]
}


class ChatRequest(_Sampling):
    REQUIRED: ClassVar[tuple[str, ...]] = ("messages",)

    messages: Annotated[
        Any,
        msgspec.Meta(
            description="the conversation; a content is a string, null or a list of text parts",
            extra_json_schema={"type": "array", "items": _MESSAGE, "minItems": 1},
        ),
    ] = None
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    continue_final_message: bool = False
    # tool calls (server/tool_parser.py) and reasoning (server/reasoning_parser.py)
    tools: Annotated[
        Any, msgspec.Meta(extra_json_schema={"type": ["array", "null"], "items": _TOOL})
    ] = None
    tool_choice: Annotated[Any, msgspec.Meta(extra_json_schema=_TOOL_CHOICE)] = None
    parallel_tool_calls: bool = True
    separate_reasoning: bool = (
        True  # SGLang: reasoning_content apart from content (with --reasoning-parser)
    )
    chat_template_kwargs: Optional[dict[str, Any]] = None  # e.g. {"enable_thinking": false}

    def top_logprobs_num(self) -> Optional[int]:
        """None when logprobs are off; else how many alternatives per token."""
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise bad_request(
                    f"top_logprobs: must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
                )
            if not self.logprobs:
                raise bad_request("top_logprobs: requires logprobs to be true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat_messages(self, images: bool = False) -> tuple[list[dict[str, Any]], list]:
        """Validated messages, and the (url, field) of each ``image_url`` part in order. A content
        of parts is flattened to its text, or, where it holds an image (``images``: the model
        takes them), kept as text parts and ``{"type": "image"}`` placeholders for the chat
        template to place."""
        msgs = self.messages
        if msgs is None:
            raise bad_request("messages: is required")
        if not isinstance(msgs, list) or not msgs:
            raise bad_request("messages: must be a non-empty list")
        out, urls = [], []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise bad_request(f"messages[{i}]: must be an object with a string 'role'")
            content = m.get("content")
            if isinstance(content, list):
                parts = []
                for j, part in enumerate(content):
                    kind = part.get("type") if isinstance(part, dict) else None
                    if kind == "image_url":
                        where = f"messages[{i}].content[{j}]"
                        if not images:
                            raise bad_request(
                                f"{where}: this model takes no images (image_url parts need a "
                                "vision-language model)"
                            )
                        try:
                            urls.append((image_url_of(part, where), where))
                        except ValueError as e:
                            raise bad_request(str(e)) from None
                        parts.append({"type": "image"})
                    elif kind == "text" and isinstance(part.get("text"), str):
                        parts.append({"type": "text", "text": part["text"]})
                    else:
                        allowed = "text and image_url" if images else "text"
                        raise bad_request(
                            f"messages[{i}].content: only {allowed} parts are supported"
                        )
                if any(p["type"] == "image" for p in parts):
                    content = parts
                else:
                    content = "".join(p["text"] for p in parts)
            elif content is not None and not isinstance(content, str):
                raise bad_request(
                    f"messages[{i}].content: must be a string, a list of text parts or null"
                )
            # null content (an assistant turn that only called tools) reaches the template as "":
            # templates read it as text
            text = "" if content is None else content
            out.append({**m, "content": text, **_tool_calls_for_template(i, m.get("tool_calls"))})
        return out, urls


def _tool_calls_for_template(i: int, calls: Any) -> dict[str, Any]:
    """An assistant message's earlier ``tool_calls``, their JSON ``arguments`` as objects (what
    chat templates render)."""
    if calls is None:
        return {}
    if not isinstance(calls, list):
        raise bad_request(f"messages[{i}].tool_calls: must be a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"messages[{i}].tool_calls[{j}].function.name: is required")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass  # (a model's malformed call, sent back as it was: the template shows the text)
        out.append({**call, "type": "function", "function": {**fn, "arguments": args}})
    return {"tool_calls": out}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def finish_reason(fr: Optional[dict[str, Any]]) -> Optional[str]:
    return None if fr is None else FINISH_REASONS.get(fr.get("type"), fr.get("type"))


def matched_stop(fr: Optional[dict[str, Any]]) -> Any:
    return None if fr is None else fr.get("matched")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: prompt tokens served from the
    prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
