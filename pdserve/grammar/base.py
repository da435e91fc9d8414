"""The grammar engine interface.

A backend is made once per scheduler (it holds the tokenizer's vocabulary in the engine's form)
and compiles a ``GrammarSpec`` once: compiled grammars are kept in an LRU cache keyed by the spec,
so a schema that many requests share is compiled for the first only. A ``Matcher`` is one
request's position in its grammar: the scheduler fills its row of the step's bitmask before
sampling and advances it by the sampled token. Matchers are used by one thread at a time (the
mask of a step may be filled on a worker thread while the forward runs; tokens are accepted on
the scheduler thread after it).
"""

from __future__ import annotations

import hashlib
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any

import torch

from pdserve.grammar import GrammarError  # noqa: F401 (the backends raise it)


class Matcher(ABC):
    @abstractmethod
    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 words, bit t % 32 of word
        t // 32 set when token t is allowed)."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (and no change) when the grammar does not allow it."""

    def try_accept(self, tokens) -> int:
        """Advance over the longest prefix of ``tokens`` the grammar allows (and not past its
        end); returns its length. A refused token leaves the matcher as it was before it."""
        for n, tok in enumerate(tokens):
            if self.terminated or not self.accept(tok):
                return n
        return len(tokens)

    @abstractmethod
    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (a speculative row's drafts, tried for a mask)."""

    @property
    @abstractmethod
    def terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted."""


class GrammarBackend(ABC):
    name: str = ""
    CACHE_SIZE = 256  # compiled grammars kept

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]):
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids
        self._compiled: OrderedDict[Any, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def fingerprint_of(tokenizer, vocab_size: int) -> str:
        """What must agree between a prefill and a decode server for a grammar compiled on each
        to allow the same tokens: the vocabulary (tokens and ids) and the model's vocab width."""
        vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
        h = hashlib.sha256(repr((vocab_size, vocab)).encode("utf-8"))
        return h.hexdigest()[:16]

    # ---- compiling -------------------------------------------------------------------------
    @abstractmethod
    def _compile(self, spec) -> Any:
        """The engine's compiled form of ``spec``; raises GrammarError naming the problem."""

    @abstractmethod
    def _matcher(self, compiled: Any) -> Matcher: ...

    @staticmethod
    @abstractmethod
    def validate(spec) -> None:
        """Raise GrammarError if ``spec`` cannot compile; needs no vocabulary, so the front end
        checks before sending."""

    def compiled(self, spec) -> Any:
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                self.hits += 1
                return self._compiled[spec]
        value = self._compile(spec)  # outside the lock: a long compile does not stall the others
        with self._lock:
            self.misses += 1
            self._compiled[spec] = value
            while len(self._compiled) > self.CACHE_SIZE:
                self._compiled.popitem(last=False)
        return value

    def matcher(self, spec) -> Matcher:
        return self._matcher(self.compiled(spec))

    def cache_info(self) -> dict[str, int]:
        with self._lock:
            return {
                "size": len(self._compiled),
                "capacity": self.CACHE_SIZE,
                "hits": self.hits,
                "misses": self.misses,
            }

    @property
    def bitmask_words(self) -> int:
        return (self.vocab_size + 31) // 32
