"""Verification of a step's speculative rows against the target's logits.

Each row's tokens are drawn as plain decoding would draw them (greedy, or sampled: a seeded
request's draw depends on its output position only, and the drafts before a position count as
output for penalties, ``Sampler.sample``'s ``offsets`` and ``ahead``); the drafts are accepted
while they equal those draws (``tree.accept``). A ``Verdict`` per row carries the tokens to
commit, each with the logprobs of the position it was drawn at; the row's drafts are taken off the
request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.engine.commit import Drawn
from pdserve.engine.request import Req
from pdserve.engine.speculative.tree import accept, drafts_before


@dataclass
class Verdict:
    req: Req
    start: int  # the slot of the row's token
    drafted: int  # drafts the row carried
    tree: bool  # they formed a tree
    tokens: list[Drawn] = field(default_factory=list)  # accepted drafts and the draw after them
    path: list[int] = field(default_factory=list)  # the row indices of the accepted drafts
    failed: bool = False  # a draw failed (logits not finite): nothing to commit

    @property
    def accepted(self) -> int:
        return len(self.tokens) - 1

    @property
    def moved(self) -> bool:
        """The accepted drafts do not sit in the slots right after the row's token (a tree's
        branch): their KV moves to the positions' slots."""
        return self.path != list(range(1, len(self.path) + 1))


def row_tokens(rows) -> tuple[list[Req], list[list[int]]]:
    """Per token of ``rows`` (``step.Row``s of kind VERIFY), in order: its request and the drafts
    before it (whose count is its depth past the output)."""
    reqs, ahead = [], []
    for row in rows:
        for j in range(row.ext):
            reqs.append(row.req)
            ahead.append(drafts_before(row.req, j))
    return reqs, ahead


def verify(sampler, logits: torch.Tensor, rows, grammar=None) -> list[Verdict]:
    """Verdicts of ``rows`` (``step.Row``s of kind VERIFY), whose logits start at each row's
    ``logits_at``; ``grammar``: the masks of their tokens' positions (``GrammarMasks.start`` of
    ``row_tokens``), as for sampling."""
    if not rows:
        return []
    picked = torch.cat([logits[row.logits_at : row.logits_at + row.ext] for row in rows])
    reqs, ahead = row_tokens(rows)
    offsets = [len(a) for a in ahead]
    out = sampler.sample(picked, reqs, grammar, offsets=offsets, ahead=ahead)
    failed = set(out.failed)
    verdicts, at = [], 0
    for row in rows:
        req = row.req
        drafts, req.drafts = req.drafts, []
        parents, req.draft_parents = req.draft_parents, None
        first, at = at, at + row.ext
        v = Verdict(req, row.start, len(drafts), parents is not None)
        verdicts.append(v)
        if any(first + j in failed for j in range(row.ext)):
            v.failed = True
            continue
        tokens, v.path = accept(drafts, out.next_ids[first : first + row.ext], parents)
        for tok, k in zip(tokens, [first] + [first + j for j in v.path]):  # k: where it was drawn
            v.tokens.append(Drawn(tok, out.logprobs[k], out.top_logprobs[k]))
    return verdicts
