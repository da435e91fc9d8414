"""``NGRAM`` drafts: what followed the latest earlier occurrence of the sequence's last n tokens,
n from ``--speculative-ngram-max-match-window-size`` down to ``...-min-match-window-size``, in
the request's own prompt and output."""

from __future__ import annotations

from pdserve.engine.request import Req
from pdserve.engine.speculative import Proposer


class NgramIndex:
    """One request's n-grams: for every n in [lo, hi], the end (exclusive) of each n-gram's latest
    occurrence that has a token after it; extended as the sequence grows (it only grows)."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.ends: dict[int, dict[tuple, int]] = {n: {} for n in range(lo, hi + 1)}
        self.indexed = 0  # n-grams ending at or before this position are in ``ends``

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest suffix of ``tokens`` seen before."""
        length = len(tokens)
        for end in range(self.indexed + 1, length):  # each such end has a token after it
            for n in range(self.lo, min(self.hi, end) + 1):
                self.ends[n][tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, length - 1)
        for n in range(min(self.hi, length), self.lo - 1, -1):
            end = self.ends[n].get(tuple(tokens[length - n :]))
            if end is not None:
                return tokens[end : end + k]
        return []


class NgramProposer(Proposer):
    def __init__(self, args, runner=None, kv_allocator=None, par=None):
        self.window = (
            args.speculative_ngram_min_match_window_size,
            args.speculative_ngram_max_match_window_size,
        )

    def propose(self, items: list[tuple[Req, int]]) -> None:
        for req, n in items:
            if req.spec.index is None:
                req.spec.index = NgramIndex(*self.window)
            req.drafts = req.spec.index.propose(req.all_ids, n)
