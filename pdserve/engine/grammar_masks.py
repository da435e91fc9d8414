"""The scheduler's side of constrained decoding: the grammar engine, each request's matcher, and
the step's masks, filled on a worker thread while the forward runs (a mask depends only on the
tokens accepted so far, all known before the forward starts)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import torch

from pdserve.engine.request import Req


class GrammarMasks:
    def __init__(self, backend_name: str, tokenizer, vocab_size: int, eos_ids: set[int]):
        self.backend_name = backend_name
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self._backend = None  # made at the first constrained request (it indexes the vocabulary)
        self._pool: Optional[ThreadPoolExecutor] = None
        self._fingerprint: Optional[str] = None

    @property
    def backend(self):
        if self._backend is None:
            from pdserve.grammar import make_backend

            if self.backend_name == "none" or self.tokenizer is None:
                raise ValueError(
                    "this server has no grammar engine (--grammar-backend none, or no tokenizer): "
                    "response_format, json_schema, regex and ebnf are not available"
                )
            self._backend = make_backend(
                self.backend_name, self.tokenizer, self.vocab_size, self.eos_ids
            )
        return self._backend

    @property
    def fingerprint(self) -> str:
        """The engine and the vocabulary its masks index ("" without a tokenizer): prefill and
        decode must agree."""
        if self._fingerprint is None:
            from pdserve.grammar.base import GrammarBackend

            self._fingerprint = (
                ""
                if self.tokenizer is None
                else (
                    f"{self.backend_name}:"
                    f"{GrammarBackend.fingerprint_of(self.tokenizer, self.vocab_size)}"
                )
            )
        return self._fingerprint

    def for_request(self, spec: Any, start_after: Optional[list[int]] = None):
        """The request's ``RequestGrammar``; a grammar the engine refuses raises GrammarError."""
        from pdserve.grammar.request_grammar import RequestGrammar

        return RequestGrammar(self.backend.matcher(spec), start_after)

    def cache_info(self) -> dict[str, int]:
        if self._backend is None:
            return {"size": 0, "capacity": 0, "hits": 0, "misses": 0}
        return self._backend.cache_info()

    def start(self, reqs: list[Req], ahead: Optional[list[list[int]]] = None) -> Optional[Future]:
        """Start filling the masks of the constrained ``reqs`` (the rows about to be sampled, in
        order; ``ahead``: per row, the drafts before it, for a speculative row's tokens). Returns
        a future of (bitmask [G, words], the G rows) or None."""
        rows = [k for k, r in enumerate(reqs) if r.grammar is not None and r.grammar.wants_mask()]
        if not rows:
            return None
        from pdserve.grammar.mask import allocate

        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        bitmask = allocate(len(rows), self.vocab_size)

        def fill() -> tuple[torch.Tensor, list[int]]:
            for i, k in enumerate(rows):
                reqs[k].grammar.fill(bitmask, i, ahead[k] if ahead else ())
            return bitmask, rows

        return self._pool.submit(fill)
