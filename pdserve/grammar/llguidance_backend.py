"""The llguidance engine (``--grammar-backend llguidance``): compiles faster than xgrammar and
accepts Lark grammars, but computes each mask several times slower on CPU (docs/benchmarks.md
"Structured outputs")."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from llguidance.gbnf_to_lark import any_to_lark

from pdserve.grammar import GrammarError
from pdserve.grammar.base import GrammarBackend, Matcher

_JSON_OBJECT = '{"type": "object"}'
# compact JSON, as the xgrammar backend produces (no free whitespace between tokens)
_DEFAULTS = {"whitespace_flexible": False}


class LLGuidanceMatcher(Matcher):
    def __init__(self, matcher: Any):
        self._m = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self._m, bitmask, row)

    def accept(self, token_id: int) -> bool:
        return self._m.consume_token(token_id)

    def try_accept(self, tokens) -> int:
        # consume_token of a refused token stops the matcher for good: check the prefix first
        return self._m.try_consume_tokens(list(tokens)) if tokens else 0

    def rollback(self, n: int) -> None:
        if n:
            self._m.rollback(n)

    @property
    def terminated(self) -> bool:
        return self._m.is_stopped()


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]):
        super().__init__(tokenizer, vocab_size, stop_ids)
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=stop_ids or None
        )

    @staticmethod
    def _grammar(spec) -> str:
        try:
            if spec.kind == "json_schema":
                json.loads(spec.value)
                return llguidance.LLMatcher.grammar_from_json_schema(spec.value, defaults=_DEFAULTS)
            if spec.kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema(
                    _JSON_OBJECT, defaults=_DEFAULTS
                )
            if spec.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(spec.value)
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.value))
        except json.JSONDecodeError as e:
            raise GrammarError(f"json_schema: is not valid JSON ({e})") from None
        except Exception as e:  # the converters raise plain Exceptions naming the rule
            raise GrammarError(f"{spec.kind}: {e}") from None

    @classmethod
    def validate(cls, spec) -> None:
        error = llguidance.LLMatcher.validate_grammar(cls._grammar(spec))
        if error:
            raise GrammarError(f"{spec.kind}: {error.strip()}")

    def _compile(self, spec) -> Any:
        """A matcher at the start of the grammar (llguidance builds its lexer there); each
        request gets a copy."""
        self.validate(spec)
        m = llguidance.LLMatcher(self._tokenizer, self._grammar(spec))
        if m.is_error():
            raise GrammarError(f"{spec.kind}: {m.get_error()}")
        return m

    def _matcher(self, compiled: Any) -> Matcher:
        return LLGuidanceMatcher(compiled.deep_copy())
