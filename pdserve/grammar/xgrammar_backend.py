"""The xgrammar engine (the default): its masks are the fastest of the engines measured on CPU
(docs/benchmarks.md "Structured outputs")."""

from __future__ import annotations

import json
import re
from typing import Any

import torch
import xgrammar as xgr

from pdserve.grammar import GrammarError
from pdserve.grammar.base import GrammarBackend, Matcher

# compact JSON, as llguidance and vLLM write it: no whitespace after "," and ":"
_COMPACT = {"any_whitespace": False, "separators": (",", ":")}
# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:line: "
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _message(e: Exception) -> str:
    return _LOCATION.sub("", str(e).strip()).strip()


class XGrammarMatcher(Matcher):
    def __init__(self, compiled: Any):
        self._m = xgr.GrammarMatcher(compiled)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        return self._m.accept_token(token_id)

    def rollback(self, n: int) -> None:
        if n:
            self._m.rollback(n)

    @property
    def terminated(self) -> bool:
        return self._m.is_terminated()


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]):
        super().__init__(tokenizer, vocab_size, stop_ids)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids
        )
        # one compile thread: the scheduler's compiles are few and cached, the cores run the model
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    @staticmethod
    def validate(spec) -> None:
        try:
            if spec.kind == "json_schema":
                xgr.Grammar.from_json_schema(_schema_text(spec.value), **_COMPACT)
            elif spec.kind == "regex":
                xgr.Grammar.from_regex(spec.value)
            elif spec.kind == "ebnf":
                xgr.Grammar.from_ebnf(spec.value)
        except GrammarError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(f"{spec.kind}: {_message(e)}") from None

    def _compile(self, spec) -> Any:
        c = self._compiler
        try:
            if spec.kind == "json_schema":
                return c.compile_json_schema(_schema_text(spec.value), **_COMPACT)
            if spec.kind == "json_object":  # compact, as json_schema (no free whitespace)
                return c.compile_json_schema('{"type": "object"}', strict_mode=False, **_COMPACT)
            if spec.kind == "regex":
                return c.compile_regex(spec.value)
            return c.compile_grammar(spec.value)
        except GrammarError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(f"{spec.kind}: {_message(e)}") from None

    def _matcher(self, compiled: Any) -> Matcher:
        return XGrammarMatcher(compiled)


def _schema_text(value: str) -> str:
    """The schema as JSON text; a value that is not JSON is named as such."""
    try:
        schema = json.loads(value)
    except json.JSONDecodeError as e:
        raise GrammarError(f"json_schema: is not valid JSON ({e})") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"json_schema: must be a JSON object, got {type(schema).__name__}")
    return value
