"""Speculative decoding: draft tokens proposed per request, verified by one forward of the target.

A speculating request's decode row holds its last token and up to k drafts; the forward gives the
target's logits at each of them, and the sampler draws a token at each as a plain step would
(greedy, or sampled from the request's distribution). Drafts are accepted while each equals the
draw at the position before it; the draw after the last accepted draft is one more token, so a
step yields between 1 and k + 1 tokens. For greedy requests these are exactly the tokens of
greedy decoding one token at a time. For sampled ones this is the standard rejection rule with a
deterministic proposal (every proposer here proposes deterministically: an n-gram's continuation,
a draft model's argmax): a draft d is kept with probability p(d), and on rejection the draw is
distributed as p without d, renormalised; so the tokens follow the target's distribution, and a
seeded request (whose draw at an output position depends only on its seed and that position,
``Sampler._uniforms``) gives exactly its plain seeded tokens. The KV the row wrote for accepted
drafts is kept (it was computed from the right tokens); what rejected drafts wrote lies past the
request's ``kv_len``, inside pages it already owns, and is overwritten by later steps: the prefix
cache takes pages only up to ``kv_len``, so nothing of it reaches the cache, KV events or a
transfer.

Who speculates (``speculable``): requests without routed-expert capture, and with a grammar only
once it constrains the output (not while it waits for the end of the reasoning); the others decode
one token per step in the same batch. Penalties, the ``min_new_tokens`` ban and a grammar's mask
at a verify row count the drafts before it as output (``Sampler.sample``'s ``ahead``; the mask of
the grammar advanced over them and rolled back, ``RequestGrammar.fill``), as plain decoding would
have counted them had they been drawn. A model whose cache cannot drop rejected
tokens (a recurrent state) is refused at start-up.

A row's drafts may form a tree (``--speculative-eagle-topk`` > 1, EAGLE heads): each draft has
a parent in the row (``Req.draft_parents``; the row's token is the root), siblings are different
tokens for the same position. The row's tokens sit in sequential slots but at the positions of
their depths, and each attends to the sequence and its ancestors only (``ForwardBatch.trees``,
``tree_mask``). The draw at each token is made as for a chain; acceptance walks from the root to
the child equal to the draw, as long as there is one (``accept``), so the tokens are again those
of plain decoding (greedy) or follow the target's distribution (sampled: one draw from p per
position, the drafts only say where to go next). The accepted path's KV then moves to the slots
of its positions (``ModelRunner.move_tokens``) before anything reads the pages.

How many drafts a request asks for follows what it accepts (``Speculator.observe``): up to
``--speculative-num-draft-tokens`` while drafts are kept, the last accepted count plus one after
a rejection, and none for a while (doubling) after steps that kept nothing.

Proposers (``--speculative-algorithm``, SGLang's names), behind ``Proposer`` and ``PROPOSERS``:
- ``NGRAM`` (``ngram.py``): the tokens that followed the latest earlier occurrence of the
  sequence's last n tokens in the request's own prompt and output; no model.
- ``STANDALONE`` (``draft_model.py``): a smaller model of the same vocabulary
  (``--speculative-draft-model-path``) whose KV layers live in the target's pages (same page
  ids), run over every prompt with the target and autoregressively for the drafts.
- ``EAGLE`` (``eagle.py``): an EAGLE head (``models/eagle.py``) over the target's hidden states,
  its KV in the target's pages as a draft model's; a chain of drafts (top-k 1) or a tree.
- ``EAGLE3`` (``eagle.py``): an EAGLE-3 head over three of the target's layer outputs.
- ``MTP`` (``eagle.py``): DeepSeek-V3's next-token-prediction layer of the target's checkpoint
  (``models/deepseek_mtp.py``), run as an EAGLE head.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.request import Req
from pdserve.engine.speculative.verify import Verdict, verify
from pdserve.engine.step_participant import StepParticipant

MAX_COOLDOWN = 16  # steps without drafts after rejections, at most

# algorithm -> "module:class" of its proposer, imported when a server uses it
PROPOSERS = {
    "NGRAM": "pdserve.engine.speculative.ngram:NgramProposer",
    "STANDALONE": "pdserve.engine.speculative.draft_model:DraftModelProposer",
    "EAGLE": "pdserve.engine.speculative.eagle:EagleProposer",
    "EAGLE3": "pdserve.engine.speculative.eagle:Eagle3Proposer",
    "MTP": "pdserve.engine.speculative.eagle:MtpProposer",
}


@dataclass
class SpecState:
    """One request's drafting: drafts to ask for next, and steps to wait before drafting again
    after rows whose drafts were all rejected (``Speculator.observe`` moves both). ``index``: the
    proposer's own per-request state (the n-gram index)."""

    budget: int
    misses: int = 0
    cooldown: int = 0
    index: object = None
    # a draft head's proposal for the token after the sequence, and its hidden state there
    next_draft: Optional[int] = None
    next_draft_p: float = 0.0
    hidden: Any = None
    # the head's most likely tokens there and their probabilities (a tree's first level)
    next_topk: tuple[list[int], list[float]] = ((), ())
    # the last verify row's accepted path: the row index of each kept position (a tree's)
    path: Optional[list[int]] = None

    def metadata_fields(self) -> dict:
        """What a PD metadata row carries of a draft head's state (its first draft level and
        hidden state), so that the receiving decode drafts from its first step; {} without."""
        if self.hidden is None:
            return {}
        return {
            "topk_p": self.next_topk[1],
            "topk_index": self.next_topk[0],
            "hidden_states": self.hidden.float(),
        }


class SpeculatorPort(Protocol):
    """The scheduler as the proposers see it: the KV cache manager, through which alone they
    record how far a draft's KV in the target's pages goes (``KVCacheManager.draft_computed``)."""

    kv: KVCacheManager


class Proposer:
    """Where drafts come from. ``propose`` fills ``req.drafts`` for each (request, at most n)
    pair, whose pages already hold room for the row (the request's token and n drafts); a
    proposer with a model of its own also follows the target's forwards (``follow``), the
    verification (``verified``) and a request's start on this server (``started``)."""

    #: KV of the proposer's own lives in the target's pages (transferred and cached with them)
    has_kv = False
    #: the scheduler, as far as a proposer may use it (set by ``Speculator``)
    port: Optional["SpeculatorPort"] = None

    @classmethod
    def page_riders(cls, args, par) -> list:
        """What the proposer keeps with the target's pages, for the target's memory budget
        (``kv_budget.RiderSource``s)."""
        return []

    def propose(self, items: list[tuple[Req, int]]) -> None:
        raise NotImplementedError

    def room(self, n: int) -> int:
        """Slots past the sequence's last token that proposing ``n`` drafts writes (the row's
        drafts; a head's tree writes its levels)."""
        return n

    def started(self, req: Req, transferred: bool = False) -> None:
        """``req``'s KV starts on this server: admitted, or (``transferred``) its prompt's KV and
        metadata row arrived from a PD prefill."""

    def follow(self, rows: list[tuple[Req, int, int]]) -> None:
        """The target computed ``rows`` (request, first position, tokens), in its forward's
        order; before the PD queues send their pages and before sampling."""

    def verified(
        self, req: Req, start: int, drafted: int, kept: int, path: Optional[list[int]] = None
    ) -> None:
        """``req``'s row from position ``start`` with ``drafted`` drafts kept ``kept`` tokens
        (accepted drafts and the draw after them); ``path``: a tree's accepted drafts' rows."""

    def stepped(self, rows: list[tuple[Req, int, int]]) -> None:
        """The step's rows are done (sampled and verified): (request, first position, tokens)
        in the order of the target's forward."""


def proposer_class(algorithm: str) -> type:
    module, _, name = PROPOSERS[algorithm].partition(":")
    return getattr(importlib.import_module(module), name)


def page_riders(args, par) -> list:
    """What the speculative proposer of these settings keeps with the target's pages."""
    if args.speculative_algorithm is None:
        return []
    return proposer_class(args.speculative_algorithm).page_riders(args, par)


class Speculator(StepParticipant):
    """Drafts for the scheduler's decode rows and the verification of their logits; around a
    step's forward, the proposer follows the target (``StepParticipant``)."""

    def __init__(self, args, runner=None, kv_allocator=None, par=None, port=None):
        self.algorithm = args.speculative_algorithm
        self.num_drafts = args.speculative_num_draft_tokens
        self.runner = runner
        self.proposer: Proposer = proposer_class(self.algorithm)(args, runner, kv_allocator, par)
        self.proposer.port = port

    @property
    def has_kv(self) -> bool:
        return self.proposer.has_kv

    @staticmethod
    def speculable(req: Req) -> bool:
        """Drafts for ``req``: not while its grammar waits for the end of the reasoning, nor with
        routed-expert capture (a row's rejected drafts would be captured)."""
        grammar_ok = req.grammar is None or req.grammar.speculable
        return grammar_ok and not req.return_routed_experts

    def wanted(self, req: Req, limit: int) -> int:
        """How many drafts ``req``'s next row asks for, within ``limit``; 0 when it does not
        speculate this step."""
        if limit <= 0 or not self.speculable(req):
            return 0
        if req.spec is None:
            req.spec = SpecState(budget=self.num_drafts)
        if req.spec.cooldown > 0:
            req.spec.cooldown -= 1
            return 0
        return min(req.spec.budget, limit)

    def propose(self, items: list[tuple[Req, int]]) -> None:
        """``req.drafts`` (and a tree's ``req.draft_parents``) for every (request, at most n
        drafts) pair (maybe fewer, or none)."""
        for req, _ in items:
            req.drafts, req.draft_parents = [], None
        if items:
            self.proposer.propose(items)

    def room(self, n: int) -> int:
        return self.proposer.room(n)

    def started(self, req: Req, transferred: bool = False) -> None:
        self.proposer.started(req, transferred)

    def after_forward(self, plan) -> None:
        """A draft computes what it can of the rows before the PD queues send their pages."""
        self.proposer.follow(plan.computed)

    def after_commit(self, plan) -> None:
        """A draft head reads the step's hidden states once its tokens are known."""
        self.proposer.stepped(plan.computed)

    def verify(self, sampler, logits: torch.Tensor, rows, grammar=None) -> list[Verdict]:
        """The verdicts of a step's VERIFY rows (``verify.verify``); the accepted drafts' KV moved
        to their positions' slots (a tree's branch), the drafting adapted to what each row kept
        and the proposer told."""
        verdicts = verify(sampler, logits, rows, grammar)
        for v in verdicts:
            if v.failed:
                continue
            if v.moved:
                self.runner.move_tokens(
                    v.req.kv.pages,
                    [v.start + j for j in v.path],
                    list(range(v.start + 1, v.start + 1 + len(v.path))),
                )
            self.observe(v.req, v.drafted, v.accepted, tree=v.tree)
            self.proposer.verified(v.req, v.start, v.drafted, len(v.tokens), v.path)
        return verdicts

    def check_tokenizer(self, tokenizer) -> None:
        check = getattr(self.proposer, "check_tokenizer", None)
        if check is not None:
            check(tokenizer)

    def drafts(self, req: Req, limit: int) -> list[int]:
        """One request's drafts for its next step (``wanted`` and ``propose``)."""
        n = self.wanted(req, limit)
        req.drafts = []
        self.propose([(req, n)] if n else [])
        return req.drafts

    def observe(self, req: Req, drafted: int, accepted: int, tree: bool = False) -> None:
        """Adapt ``req``'s drafting to what it accepts, so rows of rejected drafts do not keep
        costing compute: one draft more after a step that kept every draft (up to
        ``--speculative-num-draft-tokens``), the accepted count plus one after one that did not
        (a tree keeps its size: it never keeps all its drafts); after m steps in a row that kept
        none, no drafts for min(2^m, 16) steps."""
        state = req.spec
        if state is None or not drafted:
            return
        if not tree:
            full = accepted == drafted
            state.budget = min(self.num_drafts, state.budget + 1) if full else accepted + 1
        state.misses = 0 if accepted else state.misses + 1
        if state.misses:
            state.cooldown = min(2**state.misses, MAX_COOLDOWN)


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
