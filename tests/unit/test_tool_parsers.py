"""Tool-call parsers (every --tool-call-parser format, whole and streamed), tools / tool_choice
validation, and the schema that forces a tool choice."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from pdserve.server.tool_choice import (
    calls_from_forced_output,
    tool_choice_schema,
    validate_tool_choice,
    validate_tools,
)
from pdserve.server.tool_parser import (
    TOOL_PARSERS,
    DeepSeekV3ToolParser,
    GptOssToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    QwenToolParser,
    ToolCall,
    tool_parser,
)

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
}
TOOLS = validate_tools(
    [
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}},
        {"type": "function", "function": {"name": "get_time"}},
    ]
)
W_TOKYO = ("get_weather", '{"city": "Tokyo"}')
W_PARIS = ("get_weather", '{"city": "Paris", "unit": "c"}')
TIME = ("get_time", "{}")

# DeepSeek-V3's special tokens, spelled with the tokenizer's full-width bar and low line
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def ds_v3(name, args):
    return f"{DS_CALL}function{DS_SEP}{name}\n```json\n{args}\n```{DS_CALL_END}"


def ds_v31(name, args):
    return f"{DS_CALL}{name}{DS_SEP}{args}{DS_CALL_END}"


def harmony_call(name, args, recipient_first=False):
    if recipient_first:
        return (
            f"<|start|>assistant to=functions.{name}<|channel|>commentary json"
            f"<|message|>{args}<|call|>"
        )
    return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{args}<|call|>"


# (parser name, model output, expected content, expected calls as (name, arguments))
CASES = [
    # Llama 3.x JSON
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Tokyo"}}', "", [W_TOKYO]),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Tokyo"}}; '
        '{"name": "get_time", "parameters": {}}',
        "",
        [W_TOKYO, TIME],
    ),
    (
        "llama3",
        '  {"name": "get_weather", "parameters": {"city": "Tokyo"}}\n'
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}\n',
        "",
        [W_TOKYO, W_PARIS],
    ),
    ("llama3", "The weather in Tokyo is sunny.", "The weather in Tokyo is sunny.", []),
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Tokyo"}} is what I would call',
        '{"name": "get_weather", "parameters": {"city": "Tokyo"}} is what I would call',
        [],
    ),
    ("llama3", '{"name": "launch", "parameters": {}}', '{"name": "launch", "parameters": {}}', []),
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": ',
        '{"name": "get_weather", "parameters": {"city":',
        [],
    ),
    ("llama3", '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    # Qwen2.5 / Qwen3 / Hermes
    (
        "qwen25",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}'
        '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        "Let me check.",
        [W_TOKYO, TIME],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
        "\n</tool_call>",
        "",
        [W_PARIS],
    ),
    (
        "qwen",
        "No tools needed: 2 < 3 and <tool> is not a tag.",
        "No tools needed: 2 < 3 and <tool> is not a tag.",
        [],
    ),
    (
        "qwen",
        'A <tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call> B',
        'A <tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call> B',
        [],
    ),
    (
        "qwen",
        '<tool_call>{"name": ["get_time"], "arguments": {}}</tool_call>',
        '<tool_call>{"name": ["get_time"], "arguments": {}}</tool_call>',
        [],
    ),
    (
        "qwen",
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        [],
    ),
    (
        "qwen",
        'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n',
        "Sure.",
        [W_TOKYO],
    ),
    (
        "qwen",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_',
        "",
        [W_TOKYO],
    ),
    (
        "qwen",
        'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"ci',
        'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"ci',
        [],
    ),
    (
        "qwen",
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Tokyo\\"}"}</tool_call>',
        "",
        [W_TOKYO],
    ),
    # Mistral
    (
        "mistral",
        'Checking. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Tokyo"}}, '
        '{"name": "get_time", "arguments": {}}]',
        "Checking.",
        [W_TOKYO, TIME],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Tokyo"}[TOOL_CALLS]get_time[ARGS]{}',
        "",
        [W_TOKYO, TIME],
    ),
    ("mistral", "The list [1, 2] has [TOOL] in it", "The list [1, 2] has [TOOL] in it", []),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "nope", "arguments": {}}] done',
        '[TOOL_CALLS] [{"name": "nope", "arguments": {}}] done',
        [],
    ),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "To',
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "To',
        [],
    ),
    # gpt-oss harmony
    (
        "gpt-oss",
        "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant"
        + harmony_call("get_weather", '{"city": "Tokyo"}'),
        "",
        [W_TOKYO],
    ),
    (
        "openai",
        "<|channel|>analysis<|message|>Two calls.<|end|>"
        + harmony_call("get_weather", '{"city":"Tokyo"}', recipient_first=True)
        + harmony_call("get_time", "{}"),
        "",
        [W_TOKYO, TIME],
    ),
    (
        "gpt-oss",
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
        "<|message|>It is 4.<|return|>",
        "It is 4.",
        [],
    ),
    (
        "gpt-oss",
        "<|channel|>analysis<|message|>Hmm<|end|><|start|>assistant<|channel|>final"
        "<|message|>Cut off mid",
        "Cut off mid",
        [],
    ),
    ("gpt-oss", "Plain text, no harmony at all.", "Plain text, no harmony at all.", []),
    ("gpt-oss", harmony_call("delete_all", "{}"), "{}", []),
    ("gpt-oss", harmony_call("get_weather", '{"city": '), '{"city":', []),
    ("gpt-oss", '<|channel|>commentary to=browser.search<|message|>{"q": 1}<|call|>', "", []),
    # DeepSeek-V3 and V3.1
    (
        "deepseekv3",
        f"Let me look.{DS_BEGIN}{ds_v3('get_weather', json.dumps({'city': 'Tokyo'}))}\n"
        f"{ds_v3('get_time', '{}')}{DS_END}",
        "Let me look.",
        [W_TOKYO, TIME],
    ),
    ("deepseek_v3", DS_BEGIN + ds_v31("get_weather", W_PARIS[1]) + DS_END, "", [W_PARIS]),
    (
        "deepseekv31",
        DS_BEGIN
        + ds_v31("get_weather", W_TOKYO[1])
        + ds_v31("get_weather", '{"city": oops}')
        + DS_END,
        ds_v31("get_weather", '{"city": oops}'),
        [W_TOKYO],
    ),
    (
        "deepseekv3",
        f'{DS_BEGIN}{DS_CALL}function{DS_SEP}get_weather\n```json\n{{"city": "Tokyo"}}',
        "",
        [W_TOKYO],
    ),
    ("deepseekv3", "Answer without tools.", "Answer without tools.", []),
]


def as_pairs(calls):
    return [(c.name, c.arguments) for c in calls]


def run_stream(parser, chunks):
    stream, content, calls = parser.stream(), [], []
    for chunk in chunks:
        c, new = stream.feed(chunk)
        content.append(c)
        calls += new
    c, new = stream.finish()
    return "".join(content) + c, calls + new


def random_split(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_parse(name, text, content, calls):
    got_content, got_calls = tool_parser(name, TOOLS).parse(text)
    assert (got_content, as_pairs(got_calls)) == (content, calls)


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_stream_matches_parse_for_any_split(name, text, content, calls):
    parser = tool_parser(name, TOOLS)
    assert parser.parse(text)[0] == content
    splits = [list(text), [text]] + [random_split(text, random.Random(s)) for s in range(8)]
    for chunks in splits:
        got_content, got_calls = run_stream(parser, chunks)
        assert (got_content, as_pairs(got_calls)) == (content, calls), chunks


# pieces of every format, glued at random into well- and ill-formed outputs for the fuzz test
FRAGMENTS = {
    "llama3": ["<|python_tag|>", "<|python", '{"name": "x"}', "hi", "{"]
    + [
        " ",
        ";",
        "\n",
        '{"name": "get_time", "parameters": {}}',
        '{"name": "get_weather", "arguments": {"city": "Tokyo"}}',
    ]
    * 6,
    "qwen": [
        "<tool_call>",
        "</tool_call>",
        "<tool_",
        "</tool",
        "\n",
        " ",
        "text",
        "<",
        '{"name": "get_time", "arguments": {}}',
        '{"name": "get_weather", "arguments": {"city"',
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n',
    ]
    * 2,
    "mistral": [
        "[TOOL_CALLS]",
        "[TOOL_",
        "[ARGS]",
        "get_time",
        " ",
        "[",
        "]",
        "{}",
        "words",
        '[{"name": "get_time", "arguments": {}}]',
        '{"city": "Tokyo"}',
        "get_weather",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Tokyo"}',
        "[TOOL_CALLS]get_time[ARGS]{}",
    ],
    "gpt-oss": [
        "<|start|>assistant",
        "<|channel|>",
        "analysis",
        "final",
        "commentary",
        " to=functions.get_time",
        " to=functions.get_weather",
        "<|constrain|>json",
        "<|message|>",
        "<|end|>",
        "<|call|>",
        "<|return|>",
        "<|",
        "{}",
        '{"city": "Paris"}',
        "Hi ",
        " ",
        harmony_call("get_time", "{}"),
        harmony_call("get_weather", "{}", True),
        "<|channel|>final<|message|>Done.<|return|>",
    ],
    "deepseekv3": [
        DS_BEGIN,
        DS_END,
        DS_CALL,
        DS_CALL_END,
        DS_SEP,
        "function",
        "get_time",
        "\n```json\n",
        "```",
        "{}",
        "<｜tool",
        " ",
        "ok",
        '{"city": "Tokyo"}',
        ds_v3("get_time", "{}"),
        ds_v31("get_weather", '{"city": "Tokyo"}'),
    ]
    * 2,
}


@pytest.mark.parametrize("name", sorted(FRAGMENTS))
def test_stream_matches_parse_on_random_outputs(name):
    rng, parser = random.Random(1234), tool_parser(name, TOOLS)
    for _ in range(150):
        text = "".join(rng.choice(FRAGMENTS[name]) for _ in range(rng.randint(1, 12)))
        content, calls = parser.parse(text)
        for chunks in (list(text), random_split(text, rng) if len(text) > 1 else [text]):
            got_content, got_calls = run_stream(parser, chunks)
            assert (got_content, as_pairs(got_calls)) == (content, as_pairs(calls)), chunks


def test_stream_holds_back_a_partial_marker_and_sends_calls_when_complete():
    stream = QwenToolParser(TOOLS).stream()
    assert stream.feed("Hello <tool_") == ("Hello", [])
    assert stream.feed('call>{"name": "get_time", "arguments": {}}') == ("", [])
    content, calls = stream.feed("</tool_call>")
    assert content == "" and as_pairs(calls) == [TIME]
    assert stream.feed(" and <tooling> too ") == ("  and <tooling> too", [])  # held space first
    assert stream.finish() == ("", [])


def test_stream_sends_content_early_for_plain_text():
    stream = tool_parser("gpt-oss", TOOLS).stream()
    assert stream.feed("<|channel|>final<|message|>Hel") == ("Hel", [])
    assert stream.feed("lo<|ret") == ("lo", [])
    assert stream.feed("urn|>") == ("", [])
    llama = tool_parser("llama3", TOOLS).stream()
    assert llama.feed("Sunny") == ("Sunny", [])
    assert tool_parser("llama3", TOOLS).stream().feed('{"name"') == ("", [])


def test_registry_aliases_and_unknown_name():
    assert TOOL_PARSERS["qwen"] is TOOL_PARSERS["hermes"] is QwenToolParser
    assert TOOL_PARSERS["qwen25"] is QwenToolParser
    assert TOOL_PARSERS["llama3_json"] is Llama3JsonToolParser
    assert TOOL_PARSERS["openai"] is GptOssToolParser
    assert TOOL_PARSERS["deepseek_v3"] is DeepSeekV3ToolParser
    assert TOOL_PARSERS["mistral"] is MistralToolParser
    with pytest.raises(
        ValueError,
        match=r"--tool-call-parser: unknown parser 'qwen9'; choose from "
        r".*hermes.*llama3",
    ):
        tool_parser("qwen9", TOOLS)


def test_tool_call_openai_shape_and_unique_ids():
    a, b = ToolCall("f", "{}"), ToolCall("f", "{}")
    assert a.id != b.id and a.id.startswith("call_") and len(a.id) == 29
    assert a.to_openai() == {
        "id": a.id,
        "type": "function",
        "function": {"name": "f", "arguments": "{}"},
    }


def test_arguments_are_normalised_json():
    _, calls = tool_parser("qwen", TOOLS).parse(
        '<tool_call>{"name":"get_weather","arguments":{ "city" :"東京"}}</tool_call>'
    )
    assert calls[0].arguments == '{"city": "東京"}'


@pytest.mark.parametrize(
    "tools,message",
    [
        ("f", "tools: must be a list of objects, got str"),
        ([3], "tools[0]: must be an object, got int"),
        ([{"function": {"name": "f"}}], "tools[0].type: is required"),
        ([{"type": "x", "function": {"name": "f"}}], "tools[0].type: must be 'function', got 'x'"),
        ([{"type": "function"}], "tools[0].function: is required"),
        (
            [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {}}],
            "tools[1].function.name: is required",
        ),
        (
            [{"type": "function", "function": {"name": "a b"}}],
            "tools[0].function.name: must match ^[a-zA-Z0-9_.-]{1,64}$, got 'a b'",
        ),
        (
            [{"type": "function", "function": {"name": "x" * 65}}],
            "tools[0].function.name: must match",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": []}}],
            "tools[0].function.parameters: must be an object",
        ),
        (
            [{"type": "function", "function": {"name": "f"}}] * 2,
            "tools[1].function.name: duplicate name 'f'",
        ),
    ],
)
def test_validate_tools_errors(tools, message):
    with pytest.raises(ValueError) as err:
        validate_tools(tools)
    assert str(err.value).startswith(message)


def test_validate_tools_fills_in_parameters_without_touching_the_input():
    raw = [{"type": "function", "function": {"name": "f.g-1", "description": "d"}}]
    empty = {"type": "object", "properties": {}}
    assert validate_tools(raw)[0]["function"] == {
        "name": "f.g-1",
        "description": "d",
        "parameters": empty,
    }
    assert "parameters" not in raw[0]["function"]
    assert validate_tools(None) == []


def test_validate_tool_choice():
    named = {"type": "function", "function": {"name": "get_time"}}
    assert validate_tool_choice(None, TOOLS) == "auto"
    assert validate_tool_choice(None, []) == "none"
    assert validate_tool_choice("required", TOOLS) == "required"
    assert validate_tool_choice(dict(named, extra=1), TOOLS) == named
    with pytest.raises(
        ValueError,
        match=r"^tool_choice: function 'g' is not among the tools "
        r"\(get_weather, get_time\)$",
    ):
        validate_tool_choice({"type": "function", "function": {"name": "g"}}, TOOLS)
    for choice in ("required", named):
        with pytest.raises(ValueError, match="^tool_choice"):
            validate_tool_choice(choice, [])
    with pytest.raises(ValueError, match="^tool_choice: must be 'none', 'auto', 'required'"):
        validate_tool_choice("always", TOOLS)
    with pytest.raises(ValueError, match="^tool_choice.function.name: is required"):
        validate_tool_choice({"type": "function", "function": {}}, TOOLS)


def test_tool_choice_schema_named_and_none():
    named = {"type": "function", "function": {"name": "get_weather"}}
    schema = tool_choice_schema(TOOLS, named, True)
    jsonschema.validate({"city": "Tokyo", "unit": "f"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"unit": "f"}, schema)
    assert tool_choice_schema(TOOLS, "auto", True) is None
    assert tool_choice_schema(TOOLS, "none", False) is None


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_schema_required(parallel):
    schema = tool_choice_schema(TOOLS, "required", parallel)
    jsonschema.Draft202012Validator.check_schema(schema)
    one = [{"name": "get_weather", "parameters": {"city": "Tokyo"}}]
    two = one + [{"name": "get_time", "parameters": {}}]
    jsonschema.validate(one, schema)
    if parallel:
        jsonschema.validate(two, schema)
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(two, schema)
    for wrong in (
        [],
        [{"name": "get_weather", "parameters": {}}],
        [{"name": "nope", "parameters": {}}],
        [{"name": "get_time"}],
        [{"name": "get_time", "parameters": {}, "extra": 1}],
        {"name": "get_time"},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


def test_calls_from_forced_output_round_trip():
    named = {"type": "function", "function": {"name": "get_weather"}}
    calls = calls_from_forced_output(' {"city":"Paris","unit":"c"} ', TOOLS, named)
    assert as_pairs(calls) == [W_PARIS]
    instance = [
        {"name": "get_weather", "parameters": {"city": "Tokyo"}},
        {"name": "get_time", "parameters": {}},
    ]
    jsonschema.validate(instance, tool_choice_schema(TOOLS, "required", True))
    calls = calls_from_forced_output(json.dumps(instance), TOOLS, "required")
    assert as_pairs(calls) == [W_TOKYO, TIME]
    broken = [
        ('{"city": "Par', named),
        ("[1]", named),
        ('[{"name": "get_time", "param', "required"),
        ("[]", "required"),
        ('[{"name": "nope", "parameters": {}}]', "required"),
        ("{}", "auto"),
    ]
    for text, choice in broken:
        with pytest.raises(ValueError):
            calls_from_forced_output(text, TOOLS, choice)
