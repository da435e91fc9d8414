"""A chat choice's text as OpenAI returns it (server/chat_output.py): reasoning, content and tool
calls, whole and streamed in pieces, for the parser combinations a server runs."""

from __future__ import annotations

import json
import random

import pytest

from pdserve.server.chat_output import ChatSetup, ChoiceOutput, thinking_on

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
        },
    }
]


def streamed(setup: ChatSetup, text: str, seed: int) -> dict:
    """The message assembled from deltas of ``text`` cut at random points."""
    rng = random.Random(seed)
    out, content, reasoning, calls = ChoiceOutput(setup), "", "", []
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 7)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    for delta in [out.feed(p) for p in pieces] + [out.finish()]:
        content += delta.get("content", "")
        reasoning += delta.get("reasoning_content", "")
        calls += [
            (c["function"]["name"], c["function"]["arguments"]) for c in delta.get("tool_calls", [])
        ]
    return {"content": content or None, "reasoning": reasoning or None, "calls": calls}


def whole(setup: ChatSetup, text: str) -> dict:
    m = ChoiceOutput(setup).message(text)
    return {
        "content": m["content"],
        "reasoning": m.get("reasoning_content"),
        "calls": [
            (c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", [])
        ],
    }


CASES = [
    (
        ChatSetup(reasoning="qwen3", tools=TOOLS, tool_choice="auto", tool_parser="qwen25"),
        '<think>\nthe user wants the time\n</think>\n\nLet me check.<tool_call>\n{"name": '
        '"get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
        {
            "content": "Let me check.",
            "reasoning": "the user wants the time",
            "calls": [("get_time", '{"zone": "CET"}')],
        },
    ),
    (
        ChatSetup(reasoning="deepseek-r1"),
        "pondering</think>The answer is 4.",
        {"content": "The answer is 4.", "reasoning": "pondering", "calls": []},
    ),
    (
        ChatSetup(tools=TOOLS, tool_choice="required"),
        '[{"name": "get_time", "parameters": {"zone": "UTC"}}]',
        {"content": None, "reasoning": None, "calls": [("get_time", '{"zone": "UTC"}')]},
    ),
    # cut short by max_tokens: what was written is the content
    (
        ChatSetup(tools=TOOLS, tool_choice="required"),
        '[{"name": "get_time", "parame',
        {"content": '[{"name": "get_time", "parame', "reasoning": None, "calls": []},
    ),
    (
        ChatSetup(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}),
        '{"zone": "PST"}',
        {"content": None, "reasoning": None, "calls": [("get_time", '{"zone": "PST"}')]},
    ),
    # harmony: the tool parser reads the whole output (channels), the reasoning parser the analysis
    (
        ChatSetup(reasoning="gpt-oss", tools=TOOLS, tool_choice="auto", tool_parser="gpt-oss"),
        "<|channel|>analysis<|message|>Need the "
        "time.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_time <|constrain|>json<|message|>{"zone": "JST"}<|call|>',
        {
            "content": None,
            "reasoning": "Need the time.",
            "calls": [("get_time", '{"zone": "JST"}')],
        },
    ),
]


@pytest.mark.parametrize("setup,text,want", CASES)
def test_choice_output_whole_and_streamed(setup, text, want):
    assert whole(setup, text) == want
    for seed in range(5):
        assert streamed(setup, text, seed) == want, seed


def test_tool_calls_finish_reason_and_ids():
    out = ChoiceOutput(ChatSetup(tools=TOOLS, tool_choice="required"))
    msg = out.message(
        '[{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": {"zone": '
        '"X"}}]'
    )
    assert [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        {},
        {"zone": "X"},
    ]
    assert len({c["id"] for c in msg["tool_calls"]}) == 2 and msg["content"] is None
    assert out.finish_reason("stop") == "tool_calls" and out.finish_reason("length") == "length"
    assert ChoiceOutput(ChatSetup()).finish_reason("stop") == "stop"


def test_thinking_switches():
    assert thinking_on("qwen3", None) and not thinking_on("qwen3", {"enable_thinking": False})
    assert not thinking_on("deepseek-v3", None) and thinking_on("deepseek-v3", {"thinking": True})
    assert thinking_on("deepseek-r1", {"enable_thinking": False})  # R1 always thinks
