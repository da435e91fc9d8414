"""Reasoning parsers (every --reasoning-parser format, whole and streamed) and think_end_text."""

from __future__ import annotations

import random

import pytest

from pdserve.server.reasoning_parser import (
    REASONING_PARSERS,
    GptOssReasoningParser,
    reasoning_parser,
    think_end_text,
)

ANSWER = "The answer is 4."

# (parser name, force_reasoning, model output, expected reasoning, expected content)
CASES = [
    # R1: the prompt ends with "<think>\n", so the output starts inside the reasoning
    ("deepseek-r1", False, "Two plus two.\n</think>\n\nThe answer is 4.", "Two plus two.", ANSWER),
    (
        "deepseek-r1",
        False,
        "<think>\nTwo plus two.\n</think>\n\nThe answer is 4.",
        "Two plus two.",
        ANSWER,
    ),
    ("deepseek-r1", False, "Still thinking at max_tokens", "Still thinking at max_tokens", ""),
    ("deepseek-r1", False, "</think>The answer is 4.", None, ANSWER),
    # DeepSeek-V3.1: forced only when thinking is on
    ("deepseek-v3", True, "Add.</think>The answer is 4.", "Add.", ANSWER),
    ("deepseek-v3", False, "It is 4. </think> stays", None, "It is 4. </think> stays"),
    # Qwen3 hybrid / GLM-4.5: reasoning only if the output opens it
    ("qwen3", False, "<think>\nHmm, 2+2.\n</think>\n\nThe answer is 4.", "Hmm, 2+2.", ANSWER),
    ("qwen3", False, "The answer is 4.", None, ANSWER),
    ("qwen3", False, "  Answer: <think> is a tag", None, "  Answer: <think> is a tag"),
    ("qwen3", False, "<think>\n\n</think>\n\nThe answer is 4.", None, ANSWER),
    ("qwen3", False, "<think>Cut off", "Cut off", ""),
    ("qwen3", False, "<thi", None, "<thi"),
    ("glm45", False, "<think>Sum.</think>The answer is 4.\n", "Sum.", ANSWER + "\n"),
    ("qwen3-thinking", False, "Okay, 2+2.\n</think>\n\nThe answer is 4.", "Okay, 2+2.", ANSWER),
    ("kimi", False, "◁think▷Sum it.◁/think▷The answer is 4.", "Sum it.", ANSWER),
    ("kimi", True, "Sum it.◁/think▷\nThe answer is 4.", "Sum it.", ANSWER),
    # gpt-oss harmony
    (
        "gpt-oss",
        False,
        "<|channel|>analysis<|message|>User asks 2+2.<|end|><|start|>assistant"
        "<|channel|>final<|message|>The answer is 4.<|return|>",
        "User asks 2+2.",
        ANSWER,
    ),
    (
        "gpt-oss",
        False,
        "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant"
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Tokyo"}<|call|>',
        "Need weather.",
        "",
    ),
    (
        "gpt-oss",
        False,
        "<|channel|>analysis<|message|>First. <|end|><|start|>assistant<|channel|>"
        "analysis<|message|>Second.<|end|><|start|>assistant<|channel|>final<|message|>The answer "
        "is 4.",
        "First. Second.",
        ANSWER,
    ),
    ("gpt-oss", False, "<|channel|>analysis<|message|>Cut off mid-thou", "Cut off mid-thou", ""),
    ("gpt-oss", False, "No harmony here.", None, "No harmony here."),
]


def run_stream(parser, chunks):
    stream, reasoning, content = parser.stream(), [], []
    for chunk in chunks + [None]:
        r, c = stream.feed(chunk) if chunk is not None else stream.finish()
        reasoning.append(r)
        content.append(c)
    return "".join(reasoning) or None, "".join(content)


def random_split(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("name,force,text,reasoning,content", CASES)
def test_parse(name, force, text, reasoning, content):
    assert reasoning_parser(name, force_reasoning=force).parse(text) == (reasoning, content)


@pytest.mark.parametrize("name,force,text,reasoning,content", CASES)
def test_stream_matches_parse_for_any_split(name, force, text, reasoning, content):
    parser = reasoning_parser(name, force_reasoning=force)
    splits = [list(text), [text]] + [random_split(text, random.Random(s)) for s in range(8)]
    for chunks in splits:
        assert run_stream(parser, chunks) == (reasoning, content), chunks


FRAGMENTS = {
    "qwen3": ["<think>", "</think>", "<th", "</thi", "\n", " ", "idea", "answer", "<", "/"],
    "kimi": ["◁think▷", "◁/think▷", "◁", "◁/th", "\n", " ", "idea", "answer"],
    "gpt-oss": [
        "<|start|>assistant",
        "<|channel|>",
        "analysis",
        "final",
        "commentary",
        " to=functions.f",
        "<|message|>",
        "<|end|>",
        "<|call|>",
        "<|return|>",
        "<|",
        "<|channel|>analysis<|message|>",
        "<|channel|>final<|message|>",
        "idea ",
        "{}",
        " ",
    ],
}


@pytest.mark.parametrize("name", sorted(FRAGMENTS))
@pytest.mark.parametrize("force", [False, True])
def test_stream_matches_parse_on_random_outputs(name, force):
    rng, parser = random.Random(99), reasoning_parser(name, force_reasoning=force)
    kinds = set()
    for _ in range(200):
        text = "".join(rng.choice(FRAGMENTS[name]) for _ in range(rng.randint(1, 12)))
        expected = parser.parse(text)
        kinds.add((expected[0] is not None, expected[1] != ""))
        for chunks in (list(text), random_split(text, rng) if len(text) > 1 else [text]):
            assert run_stream(parser, chunks) == expected, chunks
    assert {(True, True), (True, False), (False, True)} <= kinds  # the fuzz reaches every case


def test_stream_holds_back_partial_markers():
    stream = reasoning_parser("qwen3").stream()
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("nk>Let me see </th") == ("Let me see", "")
    assert stream.feed("ink>\n\nFour") == ("", "Four")
    assert stream.feed(".") == ("", ".")
    assert stream.finish() == ("", "")
    plain = reasoning_parser("qwen3").stream()
    assert plain.feed("Four") == ("", "Four")  # not a think marker: sent at once


def test_forcing():
    text = "Thinking.</think>Done."
    assert reasoning_parser("qwen3", force_reasoning=False).parse(text) == (None, text)
    assert reasoning_parser("qwen3", force_reasoning=True).parse(text) == ("Thinking.", "Done.")
    assert reasoning_parser("deepseek-r1").parse(text) == ("Thinking.", "Done.")  # always forced
    assert reasoning_parser("qwen3-thinking").force_reasoning is True
    assert reasoning_parser("deepseek-v3").force_reasoning is False


def test_registry_and_think_end_text():
    assert set(REASONING_PARSERS) >= {
        "deepseek-r1",
        "deepseek-v3",
        "qwen3",
        "qwen3-thinking",
        "glm45",
        "gpt-oss",
        "kimi",
    }
    assert isinstance(reasoning_parser("gpt-oss"), GptOssReasoningParser)
    with pytest.raises(
        ValueError,
        match=r"--reasoning-parser: unknown parser 'r2'; choose from "
        r"deepseek-r1, .*qwen3",
    ):
        reasoning_parser("r2")
    assert think_end_text("qwen3") == "</think>"
    assert think_end_text("deepseek-r1") == "</think>"
    assert think_end_text("kimi") == "◁/think▷"
    assert think_end_text("gpt-oss") == "<|channel|>final<|message|>"
    assert think_end_text(None) is None
    with pytest.raises(ValueError):
        think_end_text("r2")
