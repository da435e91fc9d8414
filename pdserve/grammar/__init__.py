"""Constrained decoding: a request's grammar (JSON schema, regex, EBNF), compiled by a grammar
engine, turns into a token mask per step that the sampler applies.

``GrammarSpec`` is what a request carries (front end -> scheduler, and the same on prefill and
decode); a backend (``base.GrammarBackend``, chosen by ``--grammar-backend``) compiles it once per
distinct spec and makes a ``base.Matcher`` per request; ``RequestGrammar`` is a request's matcher
plus the rule that it starts after the reasoning ends; ``mask.apply_bitmask`` applies the masks.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from typing import TYPE_CHECKING, Any, Optional

import msgspec

if TYPE_CHECKING:  # the engines and torch are imported only by the scheduler that uses them
    from pdserve.grammar.base import GrammarBackend

__all__ = ["BACKENDS", "GrammarError", "GrammarSpec", "make_backend", "spec_from_sampling"]


class GrammarError(ValueError):
    """A grammar the engine refuses; the message names the problem (the request gets a 400)."""


# kind -> what ``value`` holds
KINDS = {
    "json_schema": "a JSON Schema, as JSON text",
    "json_object": "any JSON object (value unused)",
    "regex": "a regular expression the whole output matches",
    "ebnf": "a grammar in EBNF (GBNF), start symbol root",
}


class GrammarSpec(msgspec.Struct, frozen=True):
    """What constrains one request's output (hashable: the compile cache's key)."""

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")


SAMPLING_KEYS = ("json_schema", "regex", "ebnf")  # SGLang's sampling parameters that constrain


def spec_from_sampling(
    sampling: dict[str, Any], given: Optional[GrammarSpec] = None
) -> Optional[GrammarSpec]:
    """Take ``json_schema`` / ``regex`` / ``ebnf`` out of a sampling dict (in place) as a spec
    (ValueError naming the problem). ``given``: a constraint the request already has (OpenAI's
    response_format, a tool choice that forces calls); at most one is allowed."""
    found = [(k, sampling.pop(k)) for k in SAMPLING_KEYS if sampling.get(k) is not None]
    for k in SAMPLING_KEYS:
        sampling.pop(k, None)
    names = [k for k, _ in found] + (
        ["response_format or tool_choice"] if given is not None else []
    )
    if len(names) > 1:
        raise ValueError(f"{' and '.join(names)}: give at most one constraint on the output")
    if not found:
        return given
    key, value = found[0]
    if key == "json_schema":
        if isinstance(value, (dict, bool)):
            value = json.dumps(value)
        if not isinstance(value, str):
            raise ValueError(
                f"json_schema: must be a JSON Schema (an object, or its JSON text), "
                f"got {type(value).__name__}"
            )
    elif not isinstance(value, str) or not value:
        raise ValueError(f"{key}: must be a non-empty string")
    return GrammarSpec(key, value)


# --grammar-backend -> "module:class", imported only when chosen
BACKENDS = {
    "xgrammar": "pdserve.grammar.xgrammar_backend:XGrammarBackend",
    "llguidance": "pdserve.grammar.llguidance_backend:LLGuidanceBackend",
}


# --grammar-backend -> the package it imports; llguidance is a declared dependency of pdserve,
# xgrammar (the default, as in SGLang) is not: its own dependencies pull a CUDA torch and triton
PACKAGES = {"xgrammar": "xgrammar", "llguidance": "llguidance"}
FALLBACK = "llguidance"


def resolve_backend(name: str) -> tuple[str, str]:
    """The engine a server uses for ``--grammar-backend name``, and why it is not ``name`` ("" when
    it is): an engine whose package is missing gives way to llguidance when that is installed."""
    package = PACKAGES.get(name)
    if package is None or importlib.util.find_spec(package) is not None:
        return name, ""
    if name != FALLBACK and importlib.util.find_spec(PACKAGES[FALLBACK]) is not None:
        return FALLBACK, (
            f"--grammar-backend {name}: the package {package!r} is not installed; structured "
            f"outputs use {FALLBACK} (pip install {package} to use {name})"
        )
    return name, ""


def backend_class(name: str) -> "type[GrammarBackend]":
    if name not in BACKENDS:
        raise ValueError(
            f"--grammar-backend: unknown backend {name!r}; choose from {', '.join(BACKENDS)}, none"
        )
    module, cls = BACKENDS[name].split(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise ValueError(f"--grammar-backend {name}: the package is not installed ({e})") from None


def make_backend(
    name: Optional[str], tokenizer, vocab_size: int, stop_ids: set[int]
) -> "Optional[GrammarBackend]":
    """The backend a server compiles with; None for ``none``."""
    if name in (None, "none"):
        return None
    from pdserve.tokenizer import transformers_tokenizer

    # the engines read transformers' tokenizer's internals (its class, backend and vocabulary)
    return backend_class(name)(transformers_tokenizer(tokenizer), vocab_size, sorted(stop_ids))
