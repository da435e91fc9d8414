"""Structured outputs, tool calls and reasoning through the HTTP API with the official ``openai``
client: colocated, through PD (local and Mooncake transfer, pdserve's router) and behind the real
sglang-router; every output parses and validates against its schema, and PD's greedy outputs equal
the colocated server's, streamed and not. The same through OpenAI's Responses API and Anthropic's
Messages API (with the ``anthropic`` client), and a PD request's OpenTelemetry trace."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import jsonschema
import openai
import pytest

from pdserve.disagg.transfer import get_backend
from tests.e2e.conftest import sse_events
from tests.helpers import cluster as c
from tests.helpers import localhttp
from tests.helpers.otlp_collector import Collector
from tests.helpers.sglang_router import sglang_router_available, start_sglang_router

# A Qwen-style template: tools in the system turn, <tool_call> blocks, <think> opened by the
# generation prompt when enable_thinking is set.
TEMPLATE = (Path(__file__).parent / "data" / "tools_think_template.jinja").read_text()
FLAGS = [
    "--served-model-name",
    "tiny",
    "--tool-call-parser",
    "qwen25",
    "--reasoning-parser",
    "qwen3",
    "--page-size",
    "16",
    "--max-total-tokens",
    "8192",
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "unit", "days", "source"],
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "maxItems": 3,
        },
        "source": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "live"],
            "properties": {"name": {"type": "string", "maxLength": 8}, "live": {"type": "boolean"}},
        },
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city", "unit"],
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["c", "f"]},
            },
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["zone"],
            "properties": {"zone": {"type": "string", "maxLength": 6}},
        },
    },
}
TOOLS = [WEATHER, TIME]
# tool_choice auto: the parser finds a call in the model's own format (here forced by a grammar)
HERMES_CALL = (
    'root ::= "<tool_call>\\n{\\"name\\": \\"get_time\\", \\"arguments\\": {\\"zone\\": \\"" [a-z] '
    '[a-z]? [a-z]? "\\"}}\\n</tool_call>"'
)
CASES = {
    "json_schema": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True},
        }
    },
    "json_object": {"response_format": {"type": "json_object"}},
    "tools_required_parallel": {"tools": TOOLS, "tool_choice": "required"},
    "tools_required_one": {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
    "tools_named": {
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    },
    "tools_auto": {"tools": TOOLS, "tool_choice": "auto", "extra_body": {"ebnf": HERMES_CALL}},
}
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return str(path)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_llama_path, template_file):
    logs = tmp_path_factory.mktemp("structured")
    flags = [*FLAGS, "--chat-template", template_file]
    collector = Collector()  # the local cluster sends its spans here (test_one_pd_request_...)
    traced = ["--otlp-traces-endpoint", collector.url]
    colo = c.server("colo", tiny_llama_path, logs, *flags, *traced)
    P, _ = c.prefill("P", tiny_llama_path, logs, *flags, *traced)
    D = c.decode("D", tiny_llama_path, logs, *flags, *traced)
    procs = [colo, P, D]
    try:
        get_backend("mooncake")
        mooncake = ["--disaggregation-transfer-backend", "mooncake"]
        Pm, _ = c.prefill("P-mooncake", tiny_llama_path, logs, *flags, *mooncake)
        Dm = c.decode("D-mooncake", tiny_llama_path, logs, *flags, *mooncake)
        procs += [Pm, Dm]
    except ValueError:
        Pm = Dm = None
    try:
        c.start_all(procs)
        R = c.router("R", [P], [D], logs, *traced)
        procs.append(R)
        R.start()
        out = {"colocated": colo, "pd": R, "P": P, "D": D, "logs": logs, "traces": collector}
        if Pm is not None:
            Rm = c.router("R-mooncake", [Pm], [Dm], logs)
            procs.append(Rm)
            Rm.start()
            out.update({"pd-mooncake": Rm, "Pm": Pm, "Dm": Dm})
        yield out
    finally:
        c.stop_all(reversed(procs))
        collector.stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(url: str, case: dict, stream: bool, messages=MESSAGES, **extra) -> dict:
    """The choice as (content, reasoning, tool calls without ids, finish reason), assembled from
    the stream's deltas when streamed."""
    kw = {**case, **extra}
    with _client(url) as cl:
        r = cl.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=stream,
            **kw,
        )
        if not stream:
            m = r.choices[0].message
            calls = [(t.function.name, t.function.arguments) for t in (m.tool_calls or [])]
            assert all(t.id and t.type == "function" for t in (m.tool_calls or []))
            return {
                "content": m.content,
                "reasoning": getattr(m, "reasoning_content", None),
                "calls": calls,
                "finish": r.choices[0].finish_reason,
            }
        content, reasoning, calls, finish = "", "", {}, None
        for chunk in r:
            if not chunk.choices:
                continue
            ch = chunk.choices[0]
            d = ch.delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
            for t in d.tool_calls or []:
                entry = calls.setdefault(t.index, ["", ""])
                if t.function.name:
                    entry[0] += t.function.name
                entry[1] += t.function.arguments or ""
            finish = ch.finish_reason or finish
        return {
            "content": content or None,
            "reasoning": reasoning or None,
            "calls": [tuple(calls[k]) for k in sorted(calls)],
            "finish": finish,
        }


def check_valid(name: str, out: dict) -> None:
    if name == "json_schema":
        jsonschema.validate(json.loads(out["content"]), SCHEMA)
    elif name == "json_object":  # a random model may write one string until max_tokens
        if out["finish"] == "stop":
            assert isinstance(json.loads(out["content"]), dict)
        else:
            assert out["finish"] == "length" and out["content"].startswith('{"'), out
    else:
        params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        assert out["calls"] and out["finish"] == "tool_calls", out
        for fn, args in out["calls"]:
            jsonschema.validate(json.loads(args), params[fn])
        if name == "tools_named":
            assert [fn for fn, _ in out["calls"]] == ["get_weather"]
        if name in ("tools_required_one", "tools_named", "tools_auto"):
            assert len(out["calls"]) == 1
        if name == "tools_auto":
            assert out["calls"][0][0] == "get_time" and not out["content"]


@pytest.fixture(scope="module")
def colocated_outputs(servers):
    url = servers["colocated"].url
    outs = {}
    for name, case in CASES.items():
        whole, streamed = chat(url, case, False), chat(url, case, True)
        assert streamed == whole, (name, streamed, whole)
        check_valid(name, whole)
        outs[name] = whole
    return outs


def test_colocated_outputs_validate_streamed_and_not(colocated_outputs, servers):
    assert set(colocated_outputs) == set(CASES)
    servers["colocated"].wait_idle()


@pytest.mark.parametrize("target", ["pd", "pd-mooncake", "sglang-router"])
def test_pd_matches_colocated(servers, colocated_outputs, target):
    if target == "pd-mooncake" and target not in servers:
        pytest.skip("the mooncake transfer engine is not installed")
    if target == "sglang-router":
        if not sglang_router_available():
            pytest.skip("sglang-router is not installed")
        port = c.free_port()
        proc = start_sglang_router(
            [(servers["P"].url, servers["P"].bootstrap_port)],
            [servers["D"].url],
            port,
            log_path=str(servers["logs"] / "sglang-router.log"),
        )
        url = f"http://127.0.0.1:{port}"
    else:
        proc, url = None, servers[target].url
    try:
        for name, case in CASES.items():
            for stream in (False, True):
                assert chat(url, case, stream) == colocated_outputs[name], (target, name, stream)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
    for key in ("Pm", "Dm") if target == "pd-mooncake" else ("P", "D"):
        servers[key].wait_idle()


def test_completions_and_generate_take_grammars(servers):
    url = servers["colocated"].url
    regex = r"(yes|no), [0-9]{1,3} (apples|pears)"
    with _client(url) as cl:
        r = cl.completions.create(
            model="tiny",
            prompt="Answer:",
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "w", "schema": SCHEMA},
                }
            },
        )
        jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
        r = cl.completions.create(
            model="tiny",
            prompt="Answer:",
            max_tokens=40,
            temperature=0,
            extra_body={"regex": regex},
        )
        assert re.fullmatch(regex, r.choices[0].text)
        text = "".join(
            ch.choices[0].text
            for ch in cl.completions.create(
                model="tiny",
                prompt="Answer:",
                max_tokens=40,
                temperature=0,
                stream=True,
                extra_body={"regex": regex},
            )
        )
        assert text == r.choices[0].text
    with localhttp.Client(base_url=url, timeout=120) as h:
        for params in (
            {"json_schema": json.dumps(SCHEMA)},
            {"regex": regex},
            {"ebnf": 'root ::= "x=" [0-9] [0-9]? ";"'},
        ):
            body = {
                "text": "Answer:",
                "sampling_params": {"max_new_tokens": 80, "temperature": 0, **params},
            }
            whole = h.post("/generate", json=body).json()
            with h.stream("POST", "/generate", json={**body, "stream": True}) as r:
                events = sse_events(r.iter_lines())
            assert events[-1] == "[DONE]" and events[-2]["text"] == whole["text"], params
            if "json_schema" in params:
                jsonschema.validate(json.loads(whole["text"]), SCHEMA)
            elif "regex" in params:
                assert re.fullmatch(regex, whole["text"])
            else:
                assert re.fullmatch(r"x=[0-9]{1,2};", whole["text"])
    servers["colocated"].wait_idle()


BAD = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "objekt"}},
            }
        },
        "objekt",
    ),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (
        {"tools": [{"type": "function", "function": {"parameters": {}}}]},
        r"tools\[0\].function.name",
    ),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}},
        "launch",
    ),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
    ),
    ({"extra_body": {"regex": "a(b"}}, "regex"),
    ({"extra_body": {"regex": "a", "ebnf": 'root ::= "a"'}}, "at most one"),
    ({"extra_body": {"chat_template_kwargs": {"tokenize": True}}}, "chat_template_kwargs"),
]


@pytest.mark.parametrize("target", ["colocated", "pd"])
def test_bad_input_is_a_400_naming_the_problem(servers, target):
    with _client(servers[target].url) as cl:
        for case, needle in BAD:
            for stream in (False, True):
                with pytest.raises(openai.BadRequestError) as e:
                    r = cl.chat.completions.create(
                        model="tiny", messages=MESSAGES, max_tokens=8, stream=stream, **case
                    )
                    list(r) if stream else None
                assert re.search(needle, str(e.value)), (case, str(e.value))
    for key in ("colocated",) if target == "colocated" else ("P", "D"):
        servers[key].wait_idle()
        info = servers[key].http.get("/server_info").json()["internal_states"][0]
        cache = info["grammar_cache"]
        assert cache["size"] <= cache["capacity"] and cache["size"] <= cache["misses"], cache


def test_reasoning_is_returned_apart_from_the_answer(servers):
    """The template opens <think> when thinking is on, so the tiny model's whole answer (it never
    closes the reasoning) is reasoning; with thinking off it is all content."""
    url = servers["colocated"].url
    think = {"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}
    plain = chat(
        url,
        {
            "extra_body": {
                "chat_template_kwargs": {"enable_thinking": True},
                "separate_reasoning": False,
            }
        },
        False,
    )
    for stream in (False, True):
        out = chat(url, think, stream)
        assert out["reasoning"] == plain["content"].strip() and not out["content"], out
    off = chat(url, {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}, False)
    assert off["reasoning"] is None and off["content"]


def test_the_template_receives_the_tools(servers, tiny_llama_path, template_file):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_path)
    with _client(servers["colocated"].url) as cl:
        for tools, choice in ((TOOLS, "required"), (TOOLS, "none")):
            r = cl.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=1, tools=tools, tool_choice=choice
            )
            shown = tools if choice != "none" else None
            want = tok.apply_chat_template(
                MESSAGES,
                tools=shown,
                chat_template=TEMPLATE,
                tokenize=False,
                add_generation_prompt=True,
            )
            assert r.usage.prompt_tokens == len(tok(want, add_special_tokens=False)["input_ids"]), (
                choice
            )
    assert "get_weather" in tok.apply_chat_template(
        MESSAGES, tools=TOOLS, chat_template=TEMPLATE, tokenize=False
    )


# ---- OpenAI's Responses API and Anthropic's Messages API ---------------------------------------
# Each is a chat request in another shape: greedy outputs must equal chat completions' for the
# equivalent messages (so the prompt is the same token for token), streamed or not, colocated or
# through PD; a second turn that names the first by previous_response_id, or that repeats it as
# Anthropic's blocks, must equal chat given the whole conversation.
QUESTION = "What is the weather in Paris and in Rome?"
TIME_TOOL = {"type": "function", **TIME["function"]}  # the Responses API's flat function tool


def _strip_ids(items: list) -> list:
    return [
        {k: v for k, v in item.items() if k not in ("id", "call_id")}
        for item in (i.model_dump(exclude_none=True) for i in items)
    ]


def _response(cl: openai.OpenAI, stream: bool, **kw):
    """The response object, from the stream's response.completed/incomplete event if streamed;
    checks that the streamed deltas add up to the final items."""
    if not stream:
        return cl.responses.create(model="tiny", temperature=0, **kw)
    text, args, final, seqs = {}, {}, None, []
    for ev in cl.responses.create(model="tiny", temperature=0, stream=True, **kw):
        seqs.append(ev.sequence_number)
        if ev.type in ("response.output_text.delta", "response.reasoning_text.delta"):
            text[ev.output_index] = text.get(ev.output_index, "") + ev.delta
        elif ev.type == "response.function_call_arguments.delta":
            args[ev.output_index] = args.get(ev.output_index, "") + ev.delta
        elif ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert seqs == list(range(len(seqs))) and final is not None
    for i, item in enumerate(final.output):
        if item.type == "function_call":
            assert args[i] == item.arguments
        else:
            assert text[i] == item.content[0].text
    return final


def _chat_content(url: str, messages: list, **kw) -> dict:
    with _client(url) as cl:
        r = cl.chat.completions.create(model="tiny", messages=messages, temperature=0, **kw)
    m = r.choices[0].message
    return {
        "content": m.content,
        "reasoning": getattr(m, "reasoning_content", None),
        "calls": [(t.function.name, t.function.arguments) for t in m.tool_calls or []],
        "finish": r.choices[0].finish_reason,
        "prompt_tokens": r.usage.prompt_tokens,
    }


@pytest.mark.parametrize("target", ["colocated", "pd"])
def test_responses_api_equals_chat(servers, target):
    url, colo = servers[target].url, servers["colocated"].url
    want = _chat_content(colo, MESSAGES, max_tokens=12)
    think = _chat_content(
        colo,
        MESSAGES,
        max_tokens=12,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    with _client(url) as cl:
        for stream in (False, True):
            r = _response(cl, stream, input=QUESTION, max_output_tokens=12)
            assert r.output_text == want["content"], (stream, r.output_text)
            assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
            assert r.usage.input_tokens == want["prompt_tokens"] and r.usage.output_tokens == 12
            # developer instructions are the system turn
            sys_msgs = [{"role": "system", "content": "Be brief."}, *MESSAGES]
            r = _response(
                cl,
                stream,
                instructions="Be brief.",
                input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
                max_output_tokens=6,
            )
            assert r.output_text == _chat_content(colo, sys_msgs, max_tokens=6)["content"]
            # reasoning: the template opens <think>, so all of it is a reasoning item
            r = _response(
                cl,
                stream,
                input=QUESTION,
                max_output_tokens=12,
                extra_body={"chat_template_kwargs": {"enable_thinking": True}},
            )
            assert [o.type for o in r.output] == ["reasoning"], r.output
            assert r.output[0].content[0].text == think["reasoning"]
            assert r.usage.output_tokens_details.reasoning_tokens > 0


@pytest.mark.parametrize("target", ["colocated", "pd"])
def test_responses_api_logprobs_equal_chat(servers, target):
    """``include: ["message.output_text.logprobs"]`` with ``top_logprobs`` puts chat's logprobs
    of the same messages on the output_text part, token for token; streamed, the deltas' logprobs
    add up to the done event's and the part's; without the include, none."""
    url, colo = servers[target].url, servers["colocated"].url
    with _client(colo) as cl:
        chat = cl.chat.completions.create(
            model="tiny", messages=MESSAGES, temperature=0, max_tokens=8, logprobs=True,
            top_logprobs=3,
        )  # fmt: skip
    want = [
        (e.token, e.logprob, e.bytes, [(t.token, t.logprob) for t in e.top_logprobs])
        for e in chat.choices[0].logprobs.content
    ]
    assert len(want) == 8

    def same(got) -> None:
        assert [(e.token, e.bytes) for e in got] == [(w[0], w[2]) for w in want]
        for e, w in zip(got, want):
            assert abs(e.logprob - w[1]) < 1e-4
            assert [t.token for t in e.top_logprobs] == [t[0] for t in w[3]]
            assert all(abs(t.logprob - v) < 1e-4 for t, (_, v) in zip(e.top_logprobs, w[3]))

    kw = dict(
        model="tiny", temperature=0, input=QUESTION, max_output_tokens=8, top_logprobs=3,
        include=["message.output_text.logprobs"],
    )  # fmt: skip
    with _client(url) as cl:
        r = cl.responses.create(**kw)
        same(r.output[0].content[0].logprobs)
        deltas, done, final = [], None, None
        for ev in cl.responses.create(stream=True, **kw):
            if ev.type == "response.output_text.delta":
                deltas += ev.logprobs
            elif ev.type == "response.output_text.done":
                done = ev.logprobs
            elif ev.type in ("response.completed", "response.incomplete"):
                final = ev.response
        same(deltas)
        same(done)
        same(final.output[0].content[0].logprobs)
        plain = cl.responses.create(
            model="tiny", temperature=0, input=QUESTION, max_output_tokens=4
        )
        assert plain.output[0].content[0].logprobs == []


@pytest.mark.parametrize("target", ["colocated", "pd"])
def test_responses_api_tool_turns_and_stored_responses(servers, target):
    """A function call forced by tool_choice, its result sent back in a second turn that names
    the first by previous_response_id (through PD the router expands it: prefill never saw the
    first turn's output), then retrieved and deleted."""
    url, colo = servers[target].url, servers["colocated"].url
    with _client(url) as cl:
        for stream in (False, True):
            first = _response(
                cl,
                stream,
                input=QUESTION,
                tools=[TIME_TOOL],
                tool_choice="required",
                max_output_tokens=MAX_TOKENS,
            )
            assert first.status == "completed" and [o.type for o in first.output] == [
                "function_call"
            ]
            call = first.output[0]
            jsonschema.validate(json.loads(call.arguments), TIME["function"]["parameters"])
            chat_first = _chat_content(
                colo, MESSAGES, tools=[TIME], tool_choice="required", max_tokens=MAX_TOKENS
            )
            assert chat_first["calls"] == [(call.name, call.arguments)]
            second = _response(
                cl,
                stream,
                previous_response_id=first.id,
                input=[{"type": "function_call_output", "call_id": call.call_id, "output": "noon"}],
                tools=[TIME_TOOL],
                max_output_tokens=10,
            )
            history = [
                *MESSAGES,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call.call_id,
                            "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": call.call_id, "content": "noon"},
            ]
            want = _chat_content(colo, history, tools=[TIME], max_tokens=10)
            assert second.previous_response_id == first.id
            assert second.output_text == want["content"] and second.output_text
            assert second.usage.input_tokens == want["prompt_tokens"]
            got = cl.responses.retrieve(second.id)
            assert _strip_ids(got.output) == _strip_ids(second.output)
            cl.responses.delete(first.id)
            with pytest.raises(openai.NotFoundError, match="previous_response_id"):
                cl.responses.create(model="tiny", previous_response_id=first.id, input="and?")
            with pytest.raises(openai.NotFoundError):
                cl.responses.retrieve(first.id)
    for key in ("colocated",) if target == "colocated" else ("P", "D"):
        servers[key].wait_idle()


def _anthropic(url: str):
    import anthropic

    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)


def _message(client, stream: bool, **kw):
    kw.setdefault("extra_body", {"temperature": 0})
    if not stream:
        return client.messages.create(model="tiny", **kw)
    with client.messages.stream(model="tiny", **kw) as s:
        for _ in s:
            pass
        return s.get_final_message()


@pytest.mark.parametrize("target", ["colocated", "pd"])
def test_messages_api_equals_chat(servers, target):
    import anthropic

    url, colo = servers[target].url, servers["colocated"].url
    want = _chat_content(colo, MESSAGES, max_tokens=12)
    tool = {"name": "get_time", "input_schema": TIME["function"]["parameters"]}
    client = _anthropic(url)
    for stream in (False, True):
        m = _message(client, stream, max_tokens=12, messages=MESSAGES)
        assert [b.type for b in m.content] == ["text"] and m.content[0].text == want["content"]
        assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 12
        # Anthropic counts the prompt's cached part apart
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == want["prompt_tokens"]
        # a stop sequence the greedy output reaches
        word = want["content"].split()[2]
        m = _message(client, stream, max_tokens=12, messages=MESSAGES, stop_sequences=[word])
        assert m.stop_reason == "stop_sequence" and m.stop_sequence == word, m
        assert want["content"].startswith(m.content[0].text)
        # a system prompt
        sys_msgs = [{"role": "system", "content": "Be brief."}, *MESSAGES]
        m = _message(client, stream, max_tokens=6, system="Be brief.", messages=MESSAGES)
        assert m.content[0].text == _chat_content(colo, sys_msgs, max_tokens=6)["content"]
        # tool use forced by tool_choice any, then its result
        m = _message(
            client,
            stream,
            max_tokens=MAX_TOKENS,
            messages=MESSAGES,
            tools=[tool],
            tool_choice={"type": "any"},
        )
        assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"], m
        use = m.content[0]
        jsonschema.validate(use.input, TIME["function"]["parameters"])
        chat_first = _chat_content(
            colo, MESSAGES, tools=[TIME], tool_choice="required", max_tokens=MAX_TOKENS
        )
        assert [(n, json.loads(a)) for n, a in chat_first["calls"]] == [(use.name, use.input)]
        turn2 = [
            *MESSAGES,
            {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "noon"}],
            },
        ]
        history = [
            *MESSAGES,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": use.id,
                        "type": "function",
                        "function": {
                            "name": use.name,
                            "arguments": json.dumps(use.input, ensure_ascii=False),
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": use.id, "content": "noon"},
        ]
        m = _message(client, stream, max_tokens=10, messages=turn2, tools=[tool])
        assert (
            m.content[0].text
            == _chat_content(colo, history, tools=[TIME], max_tokens=10)["content"]
        )
    counted = client.messages.count_tokens(model="tiny", messages=MESSAGES)
    assert counted.input_tokens == want["prompt_tokens"]
    # errors in Anthropic's shape, naming the problem
    bad = [
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": "x",
                                },
                            }
                        ],
                    }
                ]
            },
            r"messages\[0\]\.content\[0\]: this model takes no images",
        ),
        ({"messages": [{"role": "robot", "content": "hi"}]}, r"messages\[0\]\.role"),
        ({"messages": MESSAGES, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ]
    for kw, needle in bad:
        with pytest.raises(anthropic.BadRequestError, match=needle) as e:
            client.messages.create(model="tiny", max_tokens=4, **kw)
        assert e.value.body["type"] == "error"
    r = localhttp.post(url + "/v1/messages", json={"messages": MESSAGES}, timeout=30)
    assert r.status_code == 400 and "max_tokens" in r.text
    for key in ("colocated",) if target == "colocated" else ("P", "D"):
        servers[key].wait_idle()


@pytest.mark.parametrize("target", ["colocated", "pd"])
def test_responses_api_refuses_bad_input_naming_it(servers, target):
    with _client(servers[target].url) as cl:
        bad = [
            ({"input": [{"type": "computer_call"}]}, r"input\[0\]\.type"),
            ({"input": [{"role": "robot", "content": "x"}]}, r"input\[0\]\.role"),
            (
                {
                    "input": [
                        {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}
                    ]
                },
                r"messages\[0\]\.content\[0\]: this model takes no images",
            ),
            ({"input": QUESTION, "tools": [{"type": "web_search"}]}, "only function tools"),
            ({"input": QUESTION, "background": True}, "background"),
            ({"input": QUESTION, "truncation": "auto"}, "truncation"),
        ]
        for kw, needle in bad:
            for stream in (False, True):
                with pytest.raises(openai.BadRequestError, match=needle):
                    r = cl.responses.create(model="tiny", max_output_tokens=4, stream=stream, **kw)
                    list(r) if stream else None
        with pytest.raises(openai.NotFoundError, match="no stored response"):
            cl.responses.create(model="tiny", previous_response_id="resp_nope", input="x")


def test_one_pd_request_is_one_trace(servers):
    """A client's traceparent through the router: the router's span is its child, prefill's and
    decode's spans the router's, each with its stages (forward, KV transfer, generation) inside
    its own span, all received by the OTLP collector."""
    trace_id, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    headers = {"traceparent": f"00-{trace_id}-{client_span}-01"}
    r = localhttp.post(
        servers["pd"].url + "/v1/chat/completions",
        json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "stream": True},
        headers=headers,
        timeout=120,
    )
    assert r.status_code == 200 and "[DONE]" in r.text
    want = {"router", "prefill", "decode", "prefill_forward", "prefill_transfer", "decode_transfer"}
    spans = servers["traces"].trace(trace_id, want | {"decode_generate"})
    by_name = {s["name"]: s for s in spans}
    assert want <= set(by_name), sorted(by_name)
    router, prefill, decode = by_name["router"], by_name["prefill"], by_name["decode"]
    assert router["parent_span_id"] == client_span and router["service"] == "pdserve-router"
    assert prefill["parent_span_id"] == decode["parent_span_id"] == router["span_id"]
    assert (prefill["service"], decode["service"]) == ("pdserve-prefill", "pdserve-decode")
    for parent, child in (
        (prefill, "prefill_forward"),
        (prefill, "prefill_transfer"),
        (decode, "decode_transfer"),
        (decode, "decode_generate"),
    ):
        s = by_name[child]
        assert s["parent_span_id"] == parent["span_id"], child
        assert parent["start"] <= s["start"] <= s["end"] <= parent["end"] + 1e-3, child
    assert router["start"] <= prefill["start"] and decode["end"] <= router["end"] + 1e-3
    assert decode["attributes"]["gen_ai.usage.output_tokens"] == 4
    assert (
        prefill["attributes"]["pdserve.bootstrap_room"]
        == decode["attributes"]["pdserve.bootstrap_room"]
    )
    # colocated: one span with its stages, a root without a traceparent
    localhttp.post(
        servers["colocated"].url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        roots = [s for s in servers["traces"].spans if s["name"] == "generate"]
        if roots:
            break
        time.sleep(0.1)
    assert roots and roots[0]["parent_span_id"] == "" and roots[0]["service"] == "pdserve-generate"
