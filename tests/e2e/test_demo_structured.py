"""Structured outputs and forced tool calls on the real demo model (SmolLM2-135M-Instruct) with
the official ``openai`` client, colocated and through PD: every answer validates against its
schema, and PD's greedy answers equal the colocated server's."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.models.demo import ensure_demo_model
from tests.e2e.test_structured_api import chat
from tests.helpers import cluster as c

FLAGS = [
    "--served-model-name",
    "tiny",
    "--dtype",
    "float32",
    "--tool-call-parser",
    "qwen25",
    "--max-total-tokens",
    "8192",
]
COUNTRY = {
    "type": "object",
    "additionalProperties": False,
    "required": ["country", "capital", "continent", "cities"],
    "properties": {
        "country": {"type": "string", "maxLength": 30},
        "capital": {"type": "string", "maxLength": 30},
        "continent": {"enum": ["Europe", "Asia", "Africa", "America", "Oceania"]},
        "cities": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city"],
            "properties": {"city": {"type": "string", "maxLength": 30}},
        },
    },
}
ASK = [{"role": "user", "content": "Describe France as JSON."}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CASES = {
    "json_schema": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "country", "schema": COUNTRY, "strict": True},
            }
        },
        ASK,
    ),
    "json_object": ({"response_format": {"type": "json_object"}}, ASK),
    "tool_named": (
        {
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
        WEATHER_ASK,
    ),
    "tool_required": ({"tools": [WEATHER], "tool_choice": "required"}, WEATHER_ASK),
}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    path = ensure_demo_model()
    logs = tmp_path_factory.mktemp("demo-structured")
    colo = c.server("demo-colo", path, logs, *FLAGS)
    P, _ = c.prefill("demo-P", path, logs, *FLAGS)
    D = c.decode("demo-D", path, logs, *FLAGS)
    procs = [colo, P, D]
    try:
        c.start_all(procs)
        R = c.router("demo-R", [P], [D], logs)
        procs.append(R)
        R.start()
        yield {"colocated": colo, "pd": R, "P": P, "D": D}
    finally:
        c.stop_all(reversed(procs))


def test_demo_model_structured_answers_validate_colocated_and_through_pd(demo):
    for name, (case, messages) in CASES.items():
        whole = chat(demo["colocated"].url, case, False, messages=messages)
        if name == "json_schema":
            data = json.loads(whole["content"])
            jsonschema.validate(data, COUNTRY)
            assert whole["finish"] == "stop", whole
        elif name == "json_object":
            assert isinstance(json.loads(whole["content"]), dict), whole
        else:
            assert whole["finish"] == "tool_calls" and whole["calls"], whole
            for fn, args in whole["calls"]:
                assert fn == "get_weather"
                jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])
        for url in (demo["colocated"].url, demo["pd"].url):
            for stream in (False, True):
                assert chat(url, case, stream, messages=messages) == whole, (name, url, stream)
    for key in ("colocated", "P", "D"):
        demo[key].wait_idle()
