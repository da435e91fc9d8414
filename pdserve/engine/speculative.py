"""Speculative decoding: draft tokens proposed per request, verified by one forward of the target.

A speculating request's decode row holds its last token and up to k drafts; the forward gives the
target's logits at each of them, and the sampler draws a token at each as a plain step would
(greedy, or sampled from the request's distribution). Drafts are accepted while each equals the
draw at the position before it; the draw after the last accepted draft is one more token, so a
step yields between 1 and k + 1 tokens. For greedy requests these are exactly the tokens of
greedy decoding one token at a time. For sampled ones this is the standard rejection rule with a
deterministic proposal: a draft d is kept with probability p(d), and on rejection the draw is
distributed as p without d, renormalised; so the tokens follow the target's distribution, and a
seeded request (whose draw at an output position depends only on its seed and that position,
``Sampler._uniforms``) gives exactly its plain seeded tokens. The KV the row wrote for accepted drafts is kept (it was computed from the right
tokens); what rejected drafts wrote lies past the request's ``kv_len``, inside pages it already
owns, and is overwritten by later steps: the prefix cache takes pages only up to ``kv_len``, so
nothing of it reaches the cache, KV events or a transfer.

Who speculates (``speculable``): requests without penalties (they would change with each
accepted token), a ``min_new_tokens`` ban, a grammar or routed-expert capture; the others decode
one token per step in the same batch. A model whose cache cannot drop rejected tokens (a
recurrent state) is refused at start-up.

Proposers (``--speculative-algorithm``): ``NGRAM`` (SGLang's name) proposes the tokens that
followed the latest earlier occurrence of the sequence's last n tokens, n from
``--speculative-ngram-max-match-window-size`` down to ``...-min-match-window-size``, in the
request's own prompt and output; no model. How many it proposes follows what the request
accepts (``Speculator.observe``): up to ``--speculative-num-draft-tokens`` while drafts are kept,
the last accepted count plus one after a rejection, and none for a while (doubling) after steps
that kept nothing.
"""

from __future__ import annotations

from typing import Optional

from pdserve.engine.request import Req

MAX_COOLDOWN = 16  # steps without drafts after rejections, at most


class NgramIndex:
    """One request's n-grams: for every n in [lo, hi], the end (exclusive) of each n-gram's latest
    occurrence that has a token after it; extended as the sequence grows (it only grows)."""

    def __init__(self, lo: int, hi: int, budget: int):
        self.lo, self.hi = lo, hi
        self.ends: dict[int, dict[tuple, int]] = {n: {} for n in range(lo, hi + 1)}
        self.indexed = 0  # n-grams ending at or before this position are in ``ends``
        # drafts to propose next, and steps to wait before drafting again after rows whose
        # drafts were all rejected (``Speculator.observe`` moves both with the acceptance)
        self.budget = budget
        self.misses = 0
        self.cooldown = 0

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


class Speculator:
    """Drafts for the scheduler's decode rows and the verification of their logits."""

    def __init__(self, args):
        self.algorithm = args.speculative_algorithm
        self.num_drafts = args.speculative_num_draft_tokens
        self.window = (
            args.speculative_ngram_min_match_window_size,
            args.speculative_ngram_max_match_window_size,
        )

    @staticmethod
    def speculable(req: Req) -> bool:
        s = req.sampling
        return (
            s.repetition_penalty == 1.0
            and s.frequency_penalty == 0.0
            and s.presence_penalty == 0.0
            and len(req.output_ids) >= s.min_new_tokens
            and req.grammar is None
            and not req.return_routed_experts
        )

    def drafts(self, req: Req, limit: int) -> list[int]:
        """Up to ``limit`` (and ``--speculative-num-draft-tokens``) drafts for ``req``'s next
        step; none when it does not speculate."""
        if limit <= 0 or not self.speculable(req):
            return []
        if req.ngrams is None:
            req.ngrams = NgramIndex(*self.window, budget=self.num_drafts)
        if req.ngrams.cooldown > 0:
            req.ngrams.cooldown -= 1
            return []
        return req.ngrams.propose(req.all_ids, min(req.ngrams.budget, limit))

    def observe(self, req: Req, drafted: int, accepted: int) -> None:
        """Adapt ``req``'s drafting to what it accepts, so rows of rejected drafts do not keep
        costing compute: one draft more after a step that kept every draft (up to
        ``--speculative-num-draft-tokens``), the accepted count plus one after one that did not;
        after m steps in a row that kept none, no drafts for min(2^m, 16) steps."""
        index = req.ngrams
        if index is None or not drafted:
            return
        if accepted == drafted:
            index.budget = min(self.num_drafts, index.budget + 1)
        else:
            index.budget = max(1, accepted + 1)
        index.misses = 0 if accepted else index.misses + 1
        if index.misses:
            index.cooldown = min(2**index.misses, MAX_COOLDOWN)

    @staticmethod
    def accept(drafts: list[int], targets: list[int]) -> list[int]:
        """The tokens a row yields: each draft while it equals the draw before it, then the draw
        after the last accepted one (``targets``: one draw per row token)."""
        n = 0
        while n < len(drafts) and drafts[n] == targets[n]:
            n += 1
        return drafts[:n] + [targets[n]]


def refusal(policies, algorithm: Optional[str]) -> str:
    """Why speculative decoding cannot run with these cache policies ("" when it can)."""
    if algorithm is None:
        return ""
    for g, policy in enumerate(policies):
        if not policy.paged:
            return (
                f"speculative_algorithm: {algorithm!r} needs every cache to drop rejected tokens, "
                f"but cache group {g} keeps a recurrent state per request"
            )
    return ""
