"""OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions``.

Choice ``i`` of a request with P prompts and ``n`` samples is sample ``i % n`` of prompt
``i // n``. Usage counts each prompt once. A prefill server answers with one JSON object even
for ``stream: true`` (see generate_api.handle). With ``X-PDServe-Timeline: 1`` each finished
choice carries ``"timeline"`` (server/timeline.py), as ``meta_info`` does on ``/generate``. With
``return_routed_experts`` the answer carries SGLang's ``sglext.routed_experts`` (base64 of the
first choice's ids, ``engine/routed_experts.py``); a stream sends it in a chunk without choices
before the usage chunk.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional

from starlette.requests import Request
from starlette.responses import Response

from pdserve.grammar import GrammarSpec
from pdserve.server import http_util, timeline
from pdserve.server.chat_output import ChatSetup, ChoiceOutput, merge_deltas, thinking_on
from pdserve.server.constraints import grammar_of_response_format
from pdserve.server.errors import APIError, bad_request
from pdserve.server.openai_protocol import (
    ChatRequest,
    CompletionRequest,
    finish_reason,
    matched_stop,
    usage,
)
from pdserve.server.tokenizer_manager import ReqState, TokenizerManager
from pdserve.server.tool_choice import tool_choice_schema, validate_tool_choice, validate_tools


def check_model(tm: TokenizerManager, name: Optional[str]) -> Optional[str]:
    """The LoRA adapter the request's ``model`` names (None: the base model); 404 for a name
    this server does not serve."""
    served = tm.server_args.served_model_name
    if not name or name == served:
        return None
    if name in tm.adapters:
        return name
    if tm.server_args.enable_lora and tm.server_args.disaggregation_mode != "null":
        return name  # an adapter's name, or a 400 from the scheduler (see make_spec)
    also = f" and the LoRA adapters {sorted(tm.adapters)}" if tm.adapters else ""
    raise APIError(404, f"model {name!r} does not exist; this server serves {served!r}{also}")


def model_name(tm: TokenizerManager, name: Optional[str]) -> str:
    """The ``model`` an answer names: the adapter asked for, else the served model."""
    return name if name and name in tm.adapters else tm.server_args.served_model_name


def _usage(states: list[ReqState], n: int) -> dict:
    prompt = sum(s.prompt_tokens for s in states[::n])
    return usage(
        prompt, sum(len(s.output_ids) for s in states), sum(s.cached_tokens for s in states[::n])
    )


def _with_timeline(
    tm: TokenizerManager, choice: dict[str, Any], s: ReqState, want: bool
) -> dict[str, Any]:
    """A finished choice gets the request's timeline when the client asked (server/timeline.py)."""
    if want and s.finished:
        choice["timeline"] = timeline.public(tm.server_args.disaggregation_mode, s.timeline)
    return choice


def _sglext(states: list[ReqState]) -> Optional[dict[str, Any]]:
    """SGLang's response-level extension: ``routed_experts`` (base64) of the first choice that has
    them, as SGLang fills it (per-choice ids: ``/generate``, or one choice per request)."""
    data = next(
        (s.routed_experts for s in states if s.spec.return_routed_experts and s.routed_experts),
        None,
    )
    return None if data is None else {"routed_experts": base64.b64encode(data).decode("ascii")}


def _with_sglext(body: dict[str, Any], states: list[ReqState]) -> dict[str, Any]:
    ext = _sglext(states)
    return body if ext is None else {**body, "sglext": ext}


def _tops(tops: list, j: int) -> list:
    return tops[j] if j < len(tops) and tops[j] is not None else []


# ---- completions ---------------------------------------------------------------------------
def _completion_logprobs(tm: TokenizerManager, pairs, tops, offset: int) -> dict[str, list]:
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for j, (lp, tid) in enumerate(pairs):
        text = tm.token_text(tid)
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        top = tops[j] if j < len(tops) else []
        out["top_logprobs"].append(None if top is None else {tm.token_text(t): v for v, t in top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


async def completions(request: Request, tm: TokenizerManager) -> Response:
    args = tm.server_args
    req = await http_util.read_body(request, args.max_body_bytes, CompletionRequest)
    adapter = check_model(tm, req.model)
    prompts = req.prompts()
    top = req.top_logprobs()
    echo_logprobs = req.echo and top is not None
    stream = req.stream and args.disaggregation_mode != "prefill"
    grammar = grammar_of_response_format(req.response_format)
    specs = [
        tm.make_spec(
            p,
            req.sampling_params(req.max_tokens),
            default_max_new_tokens=16,
            grammar=grammar,
            return_logprob=top is not None,
            top_logprobs_num=top or 0,
            logprob_start_len=0 if echo_logprobs else -1,
            stream=stream,
            return_routed_experts=req.return_routed_experts,
            priority=req.priority,
            lora_name=adapter,
            **boot,
        )
        for p, boot in zip(prompts, req.bootstrap(len(prompts)))
    ]
    echo = (
        [p if isinstance(p, str) else tm.tokenizer.decode(p) for p in prompts] if req.echo else None
    )
    states = tm.submit_all(specs)  # the last step that can fail before the states are owned
    n = req.n
    head = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name(tm, req.model),
    }

    def logprobs(s: ReqState, start: int, delta: str, echo_text: str) -> Optional[dict]:
        if top is None:
            return None
        pairs, tops = s.output_token_logprobs[start:], s.output_top_logprobs[start:]
        if echo_logprobs and start == 0:
            pairs, tops, offset = s.input_token_logprobs + pairs, s.input_top_logprobs + tops, 0
        else:
            offset = len(echo_text) + len(s.text) - len(delta)
        return _completion_logprobs(tm, pairs, tops, offset)

    want_timeline = timeline.requested(request.headers)

    def choice(i: int, s: ReqState, delta: str, token_start: int, first: bool) -> dict[str, Any]:
        fr = s.finish_reason
        echo_text = echo[i // n] if echo else ""
        return _with_timeline(
            tm,
            {
                "index": i,
                "text": (echo_text if first else "") + delta,
                "logprobs": logprobs(s, token_start, delta, echo_text),
                "finish_reason": finish_reason(fr),
                "matched_stop": matched_stop(fr),
            },
            s,
            want_timeline,
        )

    if stream:
        return http_util.sse_response(
            tm, states, _events(tm, states, head, choice, req.include_usage, n)
        )
    await http_util.unless_disconnected(request, http_util.wait_all(tm, states))
    return http_util.json_response(
        _with_sglext(
            {
                **head,
                "choices": [choice(i, s, s.text, 0, True) for i, s in enumerate(states)],
                "usage": _usage(states, n),
            },
            states,
        )
    )


# ---- chat ----------------------------------------------------------------------------------
def _chat_logprobs(tm: TokenizerManager, pairs, tops) -> dict[str, list]:
    def entry(lp: float, tid: int) -> dict[str, Any]:
        text = tm.token_text(tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**entry(lp, tid), "top_logprobs": [entry(v, t) for v, t in _tops(tops, j)]}
            for j, (lp, tid) in enumerate(pairs)
        ]
    }


def output_logprobs(tm: TokenizerManager, top: Optional[int], s: ReqState, start: int):
    """Chat's ``logprobs`` of ``s``'s output tokens from ``start`` on; None when not asked
    (``top`` None)."""
    if top is None:
        return None
    return _chat_logprobs(tm, s.output_token_logprobs[start:], s.output_top_logprobs[start:])


def _chat_setup(tm: TokenizerManager, req: ChatRequest) -> ChatSetup:
    """The request's tools, tool choice and reasoning split, validated (400s name the field)."""
    args = tm.server_args
    try:
        tools = validate_tools(req.tools) if req.tools is not None else None
        choice = validate_tool_choice(req.tool_choice, tools)
    except ValueError as e:
        raise bad_request(str(e)) from None
    if choice == "none" or not tools:
        tools = None
    if tools is not None and choice in (None, "auto") and not args.tool_call_parser:
        raise bad_request(
            "tools: this server has no --tool-call-parser, so tool_choice 'auto' cannot find the "
            "calls in the output; start it with one, "
            "or use tool_choice 'required' or a named function"
        )
    reasoning = args.reasoning_parser if req.separate_reasoning else None
    if reasoning and not thinking_on(reasoning, req.chat_template_kwargs):
        reasoning = None
    return ChatSetup(
        reasoning=reasoning, tools=tools, tool_choice=choice, tool_parser=args.tool_call_parser
    )


def _chat_grammar(
    tm: TokenizerManager, req: ChatRequest, setup: ChatSetup
) -> Optional[GrammarSpec]:
    grammar = grammar_of_response_format(req.response_format)
    if setup.forced:
        if grammar is not None:
            raise bad_request(
                "response_format: cannot be combined with tool_choice 'required' or a named "
                "function"
            )
        schema = tool_choice_schema(setup.tools, setup.tool_choice, req.parallel_tool_calls)
        grammar = GrammarSpec("json_schema", json.dumps(schema))
    return grammar


@dataclass
class ChatRun:
    """A chat request submitted: its states and each choice's output shaping (the chat
    completions, Responses and Messages routes render it)."""

    req: ChatRequest
    setup: ChatSetup
    states: list[ReqState]
    outputs: list[ChoiceOutput]
    stream: bool
    top: Optional[int]


def chat_prompt(tm: TokenizerManager, req: ChatRequest) -> tuple[ChatSetup, list[int], list]:
    """The request's output setup, prompt tokens and images (``multimodal.inputs.ImageInput``;
    404 for another model, 400 for a bad message, tool or image)."""
    check_model(tm, req.model)
    messages, urls = req.chat_messages(images=tm.takes_images)
    setup = _chat_setup(tm, req)
    input_ids = tm.chat_input_ids(
        messages, req.continue_final_message, setup.tools, req.chat_template_kwargs
    )
    input_ids, images = tm.image_inputs(input_ids, urls, req.encoder_addrs)
    return setup, input_ids, images


def whole_delta(run: ChatRun) -> dict[str, Any]:
    """The first choice's whole output as one delta (the run has finished)."""
    return merge_deltas(run.outputs[0].feed(run.states[0].text), run.outputs[0].finish())


async def chat_deltas(
    tm: TokenizerManager, run: ChatRun
) -> AsyncIterator[tuple[ReqState, dict[str, Any]]]:
    """The first choice's updates as chat deltas (reasoning_content, content, tool_calls; the
    last one with what finishing released); an update that ended in an error raises it."""
    choice, sent = run.outputs[0], 0
    async for _, s in http_util.stream_all(tm, run.states):
        err = http_util.error_of(s)
        if err is not None:
            raise err
        delta = choice.feed(s.text[sent:])
        sent = len(s.text)
        if s.finished:
            delta = merge_deltas(delta, choice.finish())
        yield s, delta


def start_chat(tm: TokenizerManager, req: ChatRequest) -> ChatRun:
    """Validate ``req``, build its prompt and submit it (a 400 names a bad field)."""
    args = tm.server_args
    setup, input_ids, images = chat_prompt(tm, req)
    top = req.top_logprobs_num()
    grammar = _chat_grammar(tm, req, setup)
    start_after = None
    if setup.reasoning:
        setup.force_reasoning = tm.opens_reasoning(setup.reasoning, input_ids)
        # a grammar waits for the reasoning the prompt opened; a model that may open it itself
        # (Qwen3 with thinking left to it) is constrained from the first token, so it answers
        if grammar is not None and setup.force_reasoning:
            start_after = tm.reasoning_end_ids(setup.reasoning)
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    stream = req.stream and args.disaggregation_mode != "prefill"
    sampling = req.sampling_params(max_tokens)
    if setup.keeps_special_tokens:
        sampling["skip_special_tokens"] = False
    spec = tm.make_spec(
        input_ids,
        sampling,
        default_max_new_tokens=None,
        return_logprob=top is not None,
        top_logprobs_num=top or 0,
        stream=stream,
        return_routed_experts=req.return_routed_experts,
        priority=req.priority,
        lora_name=check_model(tm, req.model),
        grammar=grammar,
        grammar_start_after=start_after,
        images=images or None,
        **req.bootstrap()[0],
    )
    states = tm.submit_all([spec])
    return ChatRun(req, setup, states, [ChoiceOutput(setup) for _ in states], stream, top)


async def chat_completions(request: Request, tm: TokenizerManager) -> Response:
    args = tm.server_args
    req = await http_util.read_body(request, args.max_body_bytes, ChatRequest)
    run = start_chat(tm, req)
    states, outputs, stream, top = run.states, run.outputs, run.stream, run.top
    n = req.n
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": model_name(tm, req.model),
    }

    want_timeline = timeline.requested(request.headers)

    def chunk_choice(
        i: int, s: ReqState, text: str, token_start: int, first: bool
    ) -> Optional[dict[str, Any]]:
        delta = outputs[i].feed(text)
        if s.finished:
            delta = merge_deltas(delta, outputs[i].finish())
        lp = output_logprobs(tm, top, s, token_start)
        if not (first or delta or lp or s.finished):
            return None  # text held back (it may be a marker)
        if first:
            delta = {"role": "assistant", "content": "", **delta}
        fr = outputs[i].finish_reason(finish_reason(s.finish_reason))
        return _with_timeline(
            tm,
            {
                "index": i,
                "delta": delta,
                "logprobs": lp,
                "finish_reason": fr,
                "matched_stop": matched_stop(s.finish_reason),
            },
            s,
            want_timeline,
        )

    if stream:
        events = _events(
            tm,
            states,
            {**head, "object": "chat.completion.chunk"},
            chunk_choice,
            req.include_usage,
            n,
        )
        return http_util.sse_response(tm, states, events)
    await http_util.unless_disconnected(request, http_util.wait_all(tm, states))
    choices = []
    for i, s in enumerate(states):
        out = outputs[i]
        message = out.message(s.text)
        choices.append(
            _with_timeline(
                tm,
                {
                    "index": i,
                    "message": message,
                    "logprobs": output_logprobs(tm, top, s, 0),
                    "finish_reason": out.finish_reason(finish_reason(s.finish_reason)),
                    "matched_stop": matched_stop(s.finish_reason),
                },
                s,
                want_timeline,
            )
        )
    return http_util.json_response(
        _with_sglext(
            {**head, "object": "chat.completion", "choices": choices, "usage": _usage(states, n)},
            states,
        )
    )


# ---- streaming -----------------------------------------------------------------------------
async def _events(
    tm: TokenizerManager,
    states: list[ReqState],
    head: dict[str, Any],
    choice: Callable[[int, ReqState, str, int, bool], Optional[dict[str, Any]]],
    include_usage: bool,
    n: int,
) -> AsyncIterator[bytes]:
    """A chunk per choice update that brings text, logprobs or the finish (the first one always);
    ``choice(i, state, new_text, first_new_token, is_first_chunk)`` shapes it (None: nothing to
    send yet). Then, as SGLang
    sends them, a chunk without choices carrying ``sglext`` (routed experts, when asked), usage
    (if asked) and [DONE]."""
    sent_chars = [0] * len(states)
    sent_tokens = [0] * len(states)
    started = [False] * len(states)
    finished = [False] * len(states)
    async for i, s in http_util.stream_all(tm, states):
        err = http_util.error_of(s)
        if err is not None:
            yield err.sse()
            return
        if finished[i]:
            continue
        delta = s.text[sent_chars[i] :]
        new_logprobs = s.spec.return_logprob and len(s.output_ids) > sent_tokens[i]
        if started[i] and not (delta or new_logprobs or s.finished):
            continue
        c = choice(i, s, delta, sent_tokens[i], not started[i])
        if c is not None:
            yield http_util.sse_event({**head, "choices": [c]})
        sent_chars[i], sent_tokens[i] = len(s.text), len(s.output_ids)
        started[i], finished[i] = True, s.finished
    ext = _sglext(states)
    if ext is not None:
        yield http_util.sse_event({**head, "choices": [], "sglext": ext})
    if include_usage:
        yield http_util.sse_event({**head, "choices": [], "usage": _usage(states, n)})
    yield http_util.SSE_DONE
