"""SGLang's native ``POST /generate``: request parsing and the offline-API-shaped output.

Output of one generation: ``{"text", "output_ids", "meta_info": {"id", "finish_reason",
"prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency", [logprobs], [routed_experts],
[timeline]}}`` (``routed_experts`` once finished, when asked: base64, ``engine/routed_experts.py``;
the timeline once finished, when the request has ``X-PDServe-Timeline: 1``); a list for
a batch or ``n > 1`` (item i, sample j at ``i * n + j``). A stream sends the cumulative text and
output_ids in every ``data:`` event (as SGLang does), ``"index"`` added for lists, then
``data: [DONE]``.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, AsyncIterator, Callable, ClassVar, NamedTuple

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from pdserve.disagg.fake import fake_bootstrap
from pdserve.engine.request import INT64_MAX, MAX_TOP_LOGPROBS
from pdserve.server import http_util, timeline
from pdserve.server.errors import bad_request
from pdserve.server.openai_protocol import PDBody
from pdserve.server.tokenizer_manager import MAX_N, ReqSpec, ReqState, TokenizerManager


class Check(NamedTuple):
    """One rule for a field, stated once: ``ok`` validates, ``what`` names it in the 400 message,
    ``schema`` is its JSON Schema in /openapi.json."""

    ok: Callable[[Any], bool]
    what: str
    schema: dict[str, Any]

    def per_item(self, description: str) -> msgspec.Meta:
        """The field's schema where a batch may give one value per prompt."""
        return msgspec.Meta(
            description=description + " (a batch may give a list: one per prompt)",
            extra_json_schema={"anyOf": [self.schema, {"type": "array", "items": self.schema}]},
        )


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


BOOL = Check(lambda v: isinstance(v, bool), "a boolean", {"type": "boolean"})
SAMPLING = Check(
    lambda v: v is None or isinstance(v, dict),
    "an object",
    {"anyOf": [{"$ref": "#/components/schemas/SamplingParams"}, {"type": "null"}]},
)
# a LoRA adapter's name: any string where LoRA is on (adapters come and go), else only null
LORA = Check(
    lambda v: v is None or isinstance(v, str),
    "a string",
    {"$ref": "#/components/schemas/LoraName"},
)
RID = Check(lambda v: v is None or isinstance(v, str), "a string", {"type": ["string", "null"]})
LOGPROB_START = Check(
    lambda v: _is_int(v) and -1 <= v <= INT64_MAX,
    "an integer >= -1",
    {"type": "integer", "minimum": -1, "maximum": INT64_MAX},
)
TOP_LOGPROBS = Check(
    lambda v: _is_int(v) and 0 <= v <= MAX_TOP_LOGPROBS,
    f"an integer in [0, {MAX_TOP_LOGPROBS}]",
    {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS},
)
PRIORITY = Check(
    lambda v: v is None or (_is_int(v) and -INT64_MAX - 1 <= v <= INT64_MAX),
    "an integer or null",
    {"type": ["integer", "null"], "minimum": -INT64_MAX - 1, "maximum": INT64_MAX},
)
NON_NEGATIVE = Check(
    lambda v: _is_int(v) and v >= 0, "an integer >= 0", {"type": "integer", "minimum": 0}
)
# a token id: an integer in [0, vocab size), the bound published by the running server
TOKEN_ID = {"$ref": "#/components/schemas/TokenId"}
TEXT = {"type": "string", "minLength": 1}  # "" tokenizes to no tokens: "prompt is empty"
TEXT_SCHEMA = {
    "description": "the prompt, or a batch of prompts; exactly one of text and input_ids",
    "anyOf": [
        TEXT,
        {"type": "array", "items": TEXT, "minItems": 1},
        {"type": "null"},
    ],
}
IDS_SCHEMA = {
    "description": "the prompt's token ids, or a batch of such lists; "
    "exactly one of text and input_ids",
    "anyOf": [
        {"type": "array", "items": TOKEN_ID, "minItems": 1},
        {
            "type": "array",
            "items": {"type": "array", "items": TOKEN_ID, "minItems": 1},
            "minItems": 1,
        },
        {"type": "null"},
    ],
}


def _present(name: str) -> dict[str, Any]:
    return {"required": [name], "properties": {name: {"not": {"type": "null"}}}}


# fields that a batch may give per prompt (``_per_item``); a single prompt takes no list there
PER_ITEM = (
    "sampling_params",
    "rid",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_routed_experts",
    "routed_experts_start_len",
    "priority",
    "lora_path",
)
_SINGLE_PROMPT = {
    "anyOf": [
        {"required": ["text"], "properties": {"text": {"type": "string"}}},
        {"required": ["input_ids"], "properties": {"input_ids": {"items": {"type": "integer"}}}},
    ]
}


class GenerateRequest(PDBody):
    """A native generation request; unknown fields are ignored."""

    # (unknown fields: the router adds many.) Fields typed ``Any`` are checked by ``parse`` with
    # the ``Check`` their schema comes from. Across fields (as ``_prompts`` and ``parse`` check):
    # exactly one of text and input_ids (null counts as absent); a single prompt takes no
    # per-prompt list; a batch takes no single rid.
    JSON_SCHEMA: ClassVar[dict[str, Any]] = {
        "oneOf": [_present("text"), _present("input_ids")],
        "if": _SINGLE_PROMPT,
        "then": {"properties": {name: {"not": {"type": "array"}} for name in PER_ITEM}},
        "else": {"properties": {"rid": {"not": {"type": "string"}}}},
    }

    text: Annotated[Any, msgspec.Meta(extra_json_schema=TEXT_SCHEMA)] = None
    input_ids: Annotated[Any, msgspec.Meta(extra_json_schema=IDS_SCHEMA)] = None
    sampling_params: Annotated[Any, SAMPLING.per_item("sampling parameters")] = None
    rid: Annotated[Any, RID.per_item("request id")] = None
    stream: bool = False
    return_logprob: Annotated[Any, BOOL.per_item("return token logprobs")] = False
    logprob_start_len: Annotated[
        Any, LOGPROB_START.per_item("first prompt position with logprobs; -1: none")
    ] = -1
    top_logprobs_num: Annotated[Any, TOP_LOGPROBS.per_item("alternatives per token")] = 0
    return_text_in_logprobs: bool = False
    return_routed_experts: Annotated[Any, BOOL.per_item("return the routed experts' ids")] = False
    routed_experts_start_len: Annotated[
        Any, NON_NEGATIVE.per_item("first position with routed experts")
    ] = 0
    priority: Annotated[
        Any, PRIORITY.per_item("its place in the queue under priority scheduling")
    ] = None
    lora_path: Annotated[Any, LORA.per_item("the LoRA adapter's name (null: the base model)")] = (
        None
    )
    # SGLang's: a prompt's images for its image placeholders in order (data: or file: URLs, or
    # base64), one list per prompt of a batch
    image_data: Annotated[
        Any,
        msgspec.Meta(
            extra_json_schema={
                "$ref": "#/components/schemas/ImageData",
                "description": "images (data: URLs or base64), one list per prompt of a batch",
            }
        ),
    ] = None
    # (bootstrap_host/port/room, routed_dp_rank, disagg_prefill_dp_rank: PDBody's)


def _prompts(req: GenerateRequest) -> tuple[list[Any], bool]:
    """The prompts (strings or token lists) and whether the request is a batch."""
    if (req.text is None) == (req.input_ids is None):
        raise bad_request("exactly one of 'text' or 'input_ids' is required")
    if req.text is not None:
        if isinstance(req.text, str):
            return [req.text], False
        if isinstance(req.text, list) and req.text and all(isinstance(t, str) for t in req.text):
            return list(req.text), True
        raise bad_request("text: must be a string or a non-empty list of strings")
    ids = req.input_ids
    if isinstance(ids, list) and all(_is_int(t) for t in ids):
        return [ids], False
    if (
        isinstance(ids, list)
        and ids
        and all(isinstance(x, list) and all(_is_int(t) for t in x) for x in ids)
    ):
        return list(ids), True
    raise bad_request("input_ids: must be a list of token ids or a non-empty list of such lists")


def _per_item(name: str, value: Any, size: int, batch: bool, check: Check) -> list[Any]:
    """One value per prompt: a scalar applies to all, a list (batches only) gives each its own."""
    if batch and isinstance(value, list):
        if len(value) != size:
            raise bad_request(f"{name}: the list has {len(value)} entries for a batch of {size}")
        values = value
    else:
        values = [value] * size
    for v in values:
        if not check.ok(v):
            raise bad_request(f"{name}: must be {check.what}, got {v!r}")
    return values


def _image_urls(image_data: Any, size: int, batch: bool) -> list[list[tuple[str, str]]]:
    """Each prompt's images as (url, field) pairs; bare base64 is read as a data URL."""
    if image_data is None:
        return [[] for _ in range(size)]
    if isinstance(image_data, str):
        image_data = [image_data]
    if not isinstance(image_data, list):
        raise bad_request("image_data: must be a string or a list")
    nested = batch or (image_data and all(isinstance(x, list) for x in image_data))
    lists = image_data if nested else [image_data]
    if len(lists) != size:
        raise bad_request(f"image_data: {len(lists)} list(s) of images for {size} prompt(s)")
    out = []
    for i, items in enumerate(lists):
        items = [items] if isinstance(items, str) else items
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise bad_request(f"image_data[{i}]: must be a string or a list of strings")
        at = (lambda j: f"image_data[{i}][{j}]") if nested else (lambda j: f"image_data[{j}]")
        out.append(
            [
                (
                    u
                    if u.startswith(("data:", "file:", "http:", "https:"))
                    else "data:;base64," + u,
                    at(j),
                )
                for j, u in enumerate(items)
            ]
        )
    return out


def _sample_count(sampling: Any) -> int:
    """``n`` of a sampling dict for laying out bootstrap rooms: 1 unless it is a valid count
    (an invalid one is reported by ``make_spec``)."""
    n = sampling.get("n", 1) if isinstance(sampling, dict) else 1
    return n if _is_int(n) and 1 <= n <= MAX_N else 1


def parse(tm: TokenizerManager, req: GenerateRequest, stream: bool) -> tuple[list[ReqSpec], bool]:
    prompts, batch = _prompts(req)
    size = len(prompts)
    sampling = _per_item("sampling_params", req.sampling_params, size, batch, SAMPLING)
    rids = _per_item("rid", req.rid, size, batch, RID)
    if batch and isinstance(req.rid, str):
        raise bad_request("rid: a batch needs a list of request ids, one per prompt")
    want_lp = _per_item("return_logprob", req.return_logprob, size, batch, BOOL)
    starts = _per_item("logprob_start_len", req.logprob_start_len, size, batch, LOGPROB_START)
    tops = _per_item("top_logprobs_num", req.top_logprobs_num, size, batch, TOP_LOGPROBS)
    want_re = _per_item("return_routed_experts", req.return_routed_experts, size, batch, BOOL)
    re_starts = _per_item(
        "routed_experts_start_len", req.routed_experts_start_len, size, batch, NON_NEGATIVE
    )
    priorities = _per_item("priority", req.priority, size, batch, PRIORITY)
    adapters = _per_item("lora_path", req.lora_path, size, batch, LORA)
    image_urls = _image_urls(req.image_data, size, batch)
    if any(image_urls) and not tm.takes_images:
        raise bad_request("image_data: this model takes no images")
    n = max(_sample_count(sp) for sp in sampling)
    pd = req.pd_fields(size, n)
    specs = []
    for i, prompt in enumerate(prompts):
        sp = sampling[i] or {}
        images = None
        if image_urls[i] or tm.takes_images:  # placeholders expanded for the images' sizes
            ids = tm.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
            prompt, images = tm.image_inputs(ids, image_urls[i], req.encoder_addrs)
        specs.append(
            tm.make_spec(
                prompt,
                sp,
                default_max_new_tokens=128,
                return_logprob=want_lp[i],
                top_logprobs_num=tops[i],
                logprob_start_len=starts[i],
                stream=stream,
                rid=rids[i],
                no_stop_trim=bool(sp.get("no_stop_trim")),
                return_routed_experts=want_re[i],
                routed_experts_start_len=re_starts[i],
                priority=priorities[i],
                lora_name=adapters[i],
                images=images or None,
                **pd[i],
            )
        )
    return specs, batch or specs[0].sampling.n > 1


def _entries(tm: TokenizerManager, pairs, with_text: bool) -> list[list[Any]]:
    return [[lp, tid, tm.token_text(tid) if with_text else None] for lp, tid in pairs]


def output_dict(
    tm: TokenizerManager, state: ReqState, with_text: bool, with_timeline: bool = False
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": state.rid,
        "finish_reason": state.finish_reason,
        "prompt_tokens": state.prompt_tokens,
        "completion_tokens": len(state.output_ids),
        "cached_tokens": state.cached_tokens,
        "e2e_latency": round(state.e2e_latency, 6),
    }
    if state.spec_verify_ct:  # speculative decoding (SGLang's field, and the mean tokens a step)
        meta["spec_verify_ct"] = state.spec_verify_ct
        meta["spec_accept_length"] = (
            state.spec_verify_ct + state.spec_accepted
        ) / state.spec_verify_ct
    spec = state.spec
    if spec.return_logprob:
        meta["input_token_logprobs"] = _entries(tm, state.input_token_logprobs, with_text)
        meta["output_token_logprobs"] = _entries(tm, state.output_token_logprobs, with_text)
        if spec.top_logprobs_num > 0:
            meta["input_top_logprobs"] = [
                None if top is None else _entries(tm, top, with_text)
                for top in state.input_top_logprobs
            ]
            meta["output_top_logprobs"] = [
                _entries(tm, top, with_text) for top in state.output_top_logprobs
            ]
    if spec.return_routed_experts and state.routed_experts is not None:
        meta["routed_experts"] = base64.b64encode(state.routed_experts).decode("ascii")
    if with_timeline and state.finished:
        meta["timeline"] = timeline.public(tm.server_args.disaggregation_mode, state.timeline)
    return {"text": state.text, "output_ids": list(state.output_ids), "meta_info": meta}


async def handle(request: Request, tm: TokenizerManager) -> Response:
    args = tm.server_args
    req = await http_util.read_body(request, args.max_body_bytes, GenerateRequest)
    # A prefill server answers with one JSON object even for stream=true: the router reads it
    # whole (and merges its input logprobs) before passing decode's stream on.
    stream = req.stream and args.disaggregation_mode != "prefill"
    specs, many = parse(tm, req, stream)
    states = tm.submit_all(specs)
    if stream:
        return http_util.sse_response(
            tm,
            states,
            _events(
                tm, states, many, req.return_text_in_logprobs, timeline.requested(request.headers)
            ),
        )
    await http_util.unless_disconnected(request, http_util.wait_all(tm, states))
    outs = [
        output_dict(tm, s, req.return_text_in_logprobs, timeline.requested(request.headers))
        for s in states
    ]
    return http_util.json_response(outs if many else outs[0])


async def _events(
    tm: TokenizerManager, states: list[ReqState], many: bool, with_text: bool, with_timeline: bool
) -> AsyncIterator[bytes]:
    sent: dict[int, tuple[int, bool]] = {}
    async for i, state in http_util.stream_all(tm, states):
        err = http_util.error_of(state)
        if err is not None:
            yield err.sse()
            return
        progress = (len(state.output_ids), state.finished)
        if sent.get(i) == progress:
            continue  # a second notification for output already sent
        sent[i] = progress
        out = output_dict(tm, state, with_text, with_timeline)
        if many:
            out["index"] = i
        yield http_util.sse_event(out)
    yield http_util.SSE_DONE


def health_request(tm: TokenizerManager) -> ReqSpec:
    """A one-token generation for warm-up and /health_generate. In a PD server it carries the
    fake bootstrap host, for which the scheduler contacts no peer and moves no KV."""
    return tm.make_spec(
        "Hello",
        {"max_new_tokens": 1, "temperature": 0.0},
        default_max_new_tokens=1,
        **fake_bootstrap(tm.server_args.disaggregation_mode),
    )
