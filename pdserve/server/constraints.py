"""What a request asks its output to match, as a ``GrammarSpec``: SGLang's sampling parameters
``json_schema`` / ``regex`` / ``ebnf`` and OpenAI's ``response_format``. At most one may be given
(a tool choice that forces calls counts as one too); the grammar engine checks it
(``TokenizerManager.check_grammar``)."""

from __future__ import annotations

import json
from typing import Any, Optional

from pdserve.grammar import GrammarSpec, spec_from_sampling
from pdserve.server.errors import bad_request

RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def grammar_of_sampling(
    sampling: dict[str, Any], given: Optional[GrammarSpec]
) -> Optional[GrammarSpec]:
    """``spec_from_sampling`` with its errors as 400s."""
    try:
        return spec_from_sampling(sampling, given)
    except ValueError as e:
        raise bad_request(str(e)) from None


def grammar_of_response_format(rf: Any) -> Optional[GrammarSpec]:
    """OpenAI's ``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise bad_request("response_format: must be an object with a 'type'")
    kind = rf.get("type")
    if kind not in RESPONSE_FORMATS:
        raise bad_request(
            f"response_format.type: must be one of {', '.join(RESPONSE_FORMATS)}, got {kind!r}"
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise bad_request(
            "response_format.json_schema: is required for type json_schema (an object with "
            "'name' and 'schema')"
        )
    name = js.get("name")
    if name is not None and not (isinstance(name, str) and name):
        raise bad_request("response_format.json_schema.name: must be a non-empty string")
    schema = js.get("schema", {"type": "object"})  # OpenAI: absent means any object
    if not isinstance(schema, (dict, bool)):
        raise bad_request("response_format.json_schema.schema: must be an object (a JSON Schema)")
    if "strict" in js and not isinstance(js["strict"], (bool, type(None))):
        raise bad_request("response_format.json_schema.strict: must be a boolean")
    return GrammarSpec("json_schema", json.dumps(schema))
