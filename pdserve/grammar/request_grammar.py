"""A request's grammar as the scheduler drives it: the matcher, and where it starts.

With a reasoning model the grammar constrains the answer only: it starts after the output holds
the end-of-reasoning marker (``start_after``, token ids); until then the request samples freely.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from pdserve.grammar.base import Matcher


class RequestGrammar:
    def __init__(self, matcher: Matcher, start_after: Optional[list[int]] = None):
        self.matcher = matcher
        self.start_after = start_after or None
        self.active = self.start_after is None
        self.failed: Optional[str] = None  # why the output left the grammar (then no more masks)

    def wants_mask(self) -> bool:
        return self.active and self.failed is None and not self.matcher.terminated

    def fill(self, bitmask: torch.Tensor, row: int, ahead: Sequence[int] = ()) -> None:
        """The allowed next tokens into ``bitmask[row]``; ``ahead``: tokens past the output first
        (a speculative row's drafts before the position), tried and rolled back. Past a draft the
        grammar does not allow, or its end, the row stays as it is: acceptance stops at that
        draft, so nothing drawn after it is kept."""
        taken = self.matcher.try_accept(ahead)
        try:
            if taken == len(ahead) and not self.matcher.terminated:
                self.matcher.fill(bitmask, row)
        finally:
            self.matcher.rollback(taken)

    @property
    def speculable(self) -> bool:
        """Drafts can be checked against it: it constrains the output now (a grammar that waits
        for the end of the reasoning would start somewhere inside the drafts)."""
        return self.active and self.failed is None

    def advance(self, output_ids: list[int]) -> None:
        """The newest token of ``output_ids`` was sampled: advance the matcher (or, before the
        grammar starts, look for the end of the reasoning)."""
        tok = output_ids[-1]
        if not self.active:
            n = len(self.start_after)
            self.active = output_ids[-n:] == self.start_after
            return
        if self.failed is None and not self.matcher.terminated and not self.matcher.accept(tok):
            self.failed = f"token {tok} is not allowed by the grammar"

    def replay(self, output_ids: list[int]) -> None:
        """Advance over tokens sampled elsewhere (decode: the first token, sampled by prefill)."""
        for i in range(1, len(output_ids) + 1):
            self.advance(output_ids[:i])

    @property
    def terminated(self) -> bool:
        return self.active and self.matcher.terminated
