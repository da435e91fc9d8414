"""The request side of the OpenAI ``tools`` API: validating ``tools`` and ``tool_choice``, the JSON
schema that forces ``required`` or a named function through the grammar engine (as vLLM does), and
the calls in an output generated under it."""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from pdserve.server.tool_parser import ToolCall, _whole_json

TOOL_NAME_RE = re.compile(r"^[a-zA-Z0-9_.-]{1,64}$")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def _require(ok: Any, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _kind(value: Any) -> str:
    return type(value).__name__


def validate_tools(tools: Any) -> list[dict]:
    """Check an OpenAI ``tools`` value (None means []); returns copies with ``parameters`` filled
    in. A ValueError names the offending path, e.g. ``tools[1].function.name: is required``."""
    if tools is None:
        return []
    _require(isinstance(tools, list), f"tools: must be a list of objects, got {_kind(tools)}")
    out, seen = [], set()
    for k, tool in enumerate(tools):
        at = f"tools[{k}]"
        _require(isinstance(tool, dict), f"{at}: must be an object, got {_kind(tool)}")
        _require("type" in tool, f"{at}.type: is required")
        _require(tool["type"] == "function", f"{at}.type: must be 'function', got {tool['type']!r}")
        fn = tool.get("function")
        _require(fn is not None, f"{at}.function: is required")
        _require(isinstance(fn, dict), f"{at}.function: must be an object, got {_kind(fn)}")
        name = fn.get("name")
        _require(name is not None, f"{at}.function.name: is required")
        _require(
            isinstance(name, str) and TOOL_NAME_RE.match(name),
            f"{at}.function.name: must match {TOOL_NAME_RE.pattern}, got {name!r}",
        )
        _require(name not in seen, f"{at}.function.name: duplicate name {name!r}")
        seen.add(name)
        params = fn.get("parameters")
        _require(
            params is None or isinstance(params, dict),
            f"{at}.function.parameters: must be an object (a JSON schema), got {_kind(params)}",
        )
        _require(
            isinstance(fn.get("description", ""), (str, type(None))),
            f"{at}.function.description: must be a string",
        )
        params = dict(EMPTY_PARAMETERS) if params is None else params
        out.append({**tool, "function": {**fn, "parameters": params}})
    return out


def _parameters_by_name(tools: Optional[list[dict]]) -> dict[str, dict]:
    return {
        t["function"]["name"]: t["function"].get("parameters") or dict(EMPTY_PARAMETERS)
        for t in tools or ()
    }


def validate_tool_choice(tool_choice: Any, tools: Optional[list[dict]]) -> Any:
    """Check ``tool_choice`` against validated tools. Returns "none", "auto", "required" or
    ``{"type": "function", "function": {"name": NAME}}``; None becomes "auto" with tools, else
    "none" (OpenAI's default)."""
    names = list(_parameters_by_name(tools))
    if tool_choice is None:
        return "auto" if names else "none"
    if tool_choice in ("none", "auto", "required"):
        _require(
            names or tool_choice != "required",
            "tool_choice: 'required' needs a non-empty tools list",
        )
        return tool_choice
    _require(
        isinstance(tool_choice, dict),
        "tool_choice: must be 'none', 'auto', 'required' or "
        f'{{"type": "function", "function": {{"name": ...}}}}, got {tool_choice!r}',
    )
    kind = tool_choice.get("type")
    _require(kind == "function", f"tool_choice.type: must be 'function', got {kind!r}")
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    _require(isinstance(name, str) and name, "tool_choice.function.name: is required")
    _require(
        name in names, f"tool_choice: function {name!r} is not among the tools ({', '.join(names)})"
    )
    return {"type": "function", "function": {"name": name}}


def tool_choice_schema(
    tools: Optional[list[dict]], tool_choice: Any, parallel_tool_calls: bool = True
) -> Optional[dict]:
    """JSON schema forcing a validated tool choice through a grammar engine: a named function's
    parameters (the output is its arguments object); for "required" an array of
    ``{"name", "parameters"}`` objects; None when nothing is forced ("auto", "none")."""
    params = _parameters_by_name(tools)
    if isinstance(tool_choice, dict):
        return params[tool_choice["function"]["name"]]
    if tool_choice != "required":
        return None
    items = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": schema},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, schema in params.items()
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def calls_from_forced_output(
    text: str, tools: Optional[list[dict]], tool_choice: Any
) -> list[ToolCall]:
    """The calls in an output generated under ``tool_choice_schema``. Raises ValueError when it does
    not parse as such (e.g. cut off by max_tokens); the caller then returns it as content."""
    value = _whole_json(text)
    if isinstance(tool_choice, dict):
        _require(isinstance(value, dict), "forced tool call: the output is not a JSON object")
        return [ToolCall(tool_choice["function"]["name"], json.dumps(value, ensure_ascii=False))]
    _require(tool_choice == "required", f"forced tool call: {tool_choice!r} forces no call")
    _require(
        isinstance(value, list) and value,
        "forced tool call: the output is not a non-empty JSON array",
    )
    names = _parameters_by_name(tools)
    for item in value:
        _require(
            isinstance(item, dict)
            and item.get("name") in names
            and isinstance(item.get("parameters"), dict),
            f"forced tool call: not a call of one of the tools: {item!r}",
        )
    return [
        ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in value
    ]
