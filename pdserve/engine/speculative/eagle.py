"""``EAGLE`` drafts: an EAGLE head (``models/eagle.py``) proposes a chain of tokens from the
target's final hidden states.

The head's position p holds the pair (token p + 1, target hidden state at p); its KV lives in the
target's pages as a draft model's does (``draft_model.py``), and ``KVSlots.draft_len`` counts the
pairs written. After every step (``stepped``), once the step's tokens are sampled and verified,
the head computes the pairs of the positions the target computed in it (their hidden states are
the target's forward's, ``ModelRunner.last_hidden``), so it never lags; the pair of the
sequence's last computed position gives the next step's first draft and the head's hidden state
there (``SpecState.next_draft`` / ``hidden``). Drafting (``propose``) continues the chain: the
draft d_j at the next position, with the head's own previous hidden state standing in for the
target's, for each further draft; the pairs it writes past the sequence are computed again from
the target's hidden states after the verification.

In PD the prefill computes the prompt's pairs (the last one after sampling the first token, before
the last pages go: ``PDQueues.takes_over`` runs after ``stepped``), sends the head's KV with the
pages and puts the first draft, its probability and the head's hidden state in the metadata row
(``output_topk_index`` / ``output_topk_p`` / ``output_hidden_states``); decode speculates from its
first step with them.

With ``--speculative-eagle-topk`` k > 1 the drafts form a tree, built as EAGLE's and SGLang's
drafters build it: the head's k most likely tokens at the sequence's end are the first level;
each further level runs the head once over the k best tokens of the level before (the batch's
frontiers in one forward, each token attending to the sequence and its ancestors:
``ForwardBatch.trees``, in slots past the sequence's end, ``room``) and takes the k most likely
children of each; a token's score is the product of the head's probabilities along its path,
the next frontier the k best children, and the row's drafts the ``speculative_num_draft_tokens``
best tokens of all levels (a parent scores at least its child, so they form a tree). The
verification's path moves the kept hidden states' rows as it moves their KV (``SpecState.path``).
The first level travels in PD's metadata row ``MAX_EAGLE_TOPK`` wide, so prefill and decode
need not agree on k.

A prefix-cache hit's last pair was computed with the token that followed the prefix when it
was cached (the hidden state of the next position is not kept): where the new sequence goes on
differently, the head's first drafts may differ from a cold run's; the tokens never do.
"""

from __future__ import annotations

import math

import torch

from pdserve.config import MAX_EAGLE_TOPK
from pdserve.engine.request import Req
from pdserve.engine.speculative import SpecState
from pdserve.engine.speculative.draft_model import DraftModelProposer
from pdserve.engine.speculative.tree import tree_mask


class EagleProposer(DraftModelProposer):
    def __init__(self, args, runner, kv_allocator, par):
        super().__init__(args, runner, kv_allocator, par, model_cls=self.head_class())
        self.runner.model.share_target(runner.model)
        runner.capture_hidden = True
        self.runner.capture_hidden = True
        self.topk = args.speculative_eagle_topk or 1
        self.depth = args.speculative_num_steps or self.num_drafts  # a tree's levels, at most
        if self.topk > 1:
            for side in (runner, self.runner):
                kinds = {g.kind for g in side.cache_groups}
                if "index_keys" in kinds:
                    raise ValueError(
                        f"speculative_eagle_topk: {self.topk} needs tree attention, and the "
                        f"sparse attention of {side.args.model_path!r} (its indexer) attends "
                        "causally only; use 1 (a chain of drafts)"
                    )

    def room(self, n: int) -> int:
        if self.topk == 1:
            return n
        # a tree's levels but the last run the head over k tokens each, from the row's slot
        return max(n, (min(self.depth, n) - 1) * self.topk - 1)

    def head_class(self) -> type:
        from pdserve.models.eagle import EagleLlamaForCausalLM

        return EagleLlamaForCausalLM

    def started(self, req: Req, transferred: bool = False) -> None:
        self.port.kv.draft_computed(req, req.kv_len)
        if req.spec is not None and not transferred:  # a transferred one keeps prefill's draft
            req.spec.next_draft = req.spec.hidden = None

    def follow(self, rows: list[tuple[Req, int, int]]) -> None:
        """The pairs whose next token is known before sampling (a prompt chunk's, but for the
        prompt's last position): computed before the PD queues send the chunk's pages."""
        self._pairs(rows, lambda req, end: min(end, req.seq_len - 1), drafts=False)

    def verified(self, req: Req, start: int, drafted: int, kept: int, path=None) -> None:
        if req.spec is not None:  # ``stepped`` computes the kept positions' pairs
            req.spec.path = [0] + list(path or [])

    @torch.inference_mode()
    def stepped(self, rows: list[tuple[Req, int, int]]) -> None:
        """The rest, once the step's tokens are sampled and verified; the pair of a request's last
        computed position gives its next draft."""
        self._pairs(rows, lambda req, end: min(end, req.kv_len))
        for req, _, _ in rows:
            if req.spec is not None:
                req.spec.path = None

    @torch.inference_mode()
    def _pairs(self, rows: list[tuple[Req, int, int]], upto, drafts: bool = True) -> None:
        """The head's pairs from each row's ``draft_len`` to ``upto(req, row end)``; with
        ``drafts``, the next draft of each request whose last computed position is among them."""
        target_hidden = self.target.last_hidden
        todo, ids, positions, feats, last = [], [], [], [], []
        offset = 0
        for req, start, ext in rows:
            first, offset = offset, offset + ext
            if req.finished or req.kv is None:
                continue
            begin, end = req.kv.draft_len, upto(req, start + ext)
            if begin < start or begin >= end:
                continue  # nothing new (a pair needs the target's hidden state of its position)
            todo.append((req, begin, end - begin))
            ids += req.all_ids[begin + 1 : end + 1]
            positions += range(begin, end)
            path = req.spec.path if req.spec is not None else None  # a tree's kept rows
            feats += (first + (path[p - start] if path else p - start) for p in range(begin, end))
            if drafts and end == req.seq_len - 1:  # the last computed position: the next draft
                last.append((req, len(ids) - 1))
        if not todo:
            return
        logits = self._run(todo, ids, positions, [row for _, row in last], target_hidden[feats])
        hidden = self.runner.last_hidden
        for req, begin, n in todo:
            self.port.kv.draft_computed(req, begin + n)
        if not last:
            return
        width = min(MAX_EAGLE_TOPK, logits.shape[-1])
        best = torch.softmax(logits, dim=-1).topk(width, dim=-1)
        probs = best.values.clamp_min(1e-30)  # > 0: PD's metadata row counts them by that
        for k, (req, row) in enumerate(last):
            if req.spec is None:
                req.spec = SpecState(budget=self.num_drafts)
            req.spec.next_topk = (best.indices[k].tolist(), probs[k].tolist())
            req.spec.next_draft = req.spec.next_topk[0][0]
            req.spec.next_draft_p = req.spec.next_topk[1][0]
            req.spec.hidden = hidden[row].clone()

    @torch.inference_mode()
    def propose(self, items: list[tuple[Req, int]]) -> None:
        if self.topk > 1:
            return self._tree(items)
        live = []
        for req, n in items:
            if req.spec.next_draft is not None:
                req.drafts = [req.spec.next_draft]
                live.append((req, n))
        feats = {req: req.spec.hidden for req, _ in live}
        for j in range(1, max((n for _, n in live), default=0)):
            rows = [req for req, n in live if n > j]
            at = [req.seq_len - 2 + j for req in rows]
            logits = self._run(
                [(req, p, 1) for req, p in zip(rows, at)],
                [req.drafts[-1] for req in rows],
                at,
                list(range(len(rows))),
                torch.stack([feats[req] for req in rows]),
            )
            hidden = self.runner.last_hidden
            for k, (req, token) in enumerate(zip(rows, logits.argmax(dim=-1).tolist())):
                req.drafts.append(token)
                feats[req] = hidden[k]

    def _tree(self, items: list[tuple[Req, int]]) -> None:
        """Each request's tree of at most n drafts (``req.drafts`` / ``req.draft_parents``)."""
        k = self.topk
        trees = {}
        for req, n in items:
            ids, probs = req.spec.next_topk
            if req.spec.next_draft is None or len(ids) < k:
                continue
            first = [_Node(math.log(p), t, None, 1) for t, p in zip(ids[:k], probs)]
            trees[req] = _Tree(n, first, first, [req.spec.hidden] * k)
        for level in range(1, self.depth):
            live = [(req, t) for req, t in trees.items() if min(self.depth, t.n) > level]
            if not live:
                break
            rows, ids, positions, hidden, masks = [], [], [], [], {}
            for b, (req, t) in enumerate(live):
                base = req.seq_len - 1  # the head's tree slots start where its pairs end
                for i, node in enumerate(t.frontier):
                    node.slot = (level - 1) * k + i
                rows.append((req, base + (level - 1) * k, k))
                ids += [node.token for node in t.frontier]
                positions += [base + level - 1] * k
                hidden += t.inputs
                masks[b] = tree_mask(
                    base,
                    [node.slots() for node in t.frontier],
                    [base + s // k for s in range(level * k)],
                )
            logits = self._run(
                rows, ids, positions, list(range(len(ids))), torch.stack(hidden), masks
            )
            out = self.runner.last_hidden
            logp = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
            for b, (req, t) in enumerate(live):
                children, inputs = [], []
                for i, parent in enumerate(t.frontier):
                    row = b * k + i
                    for token, lp in zip(logp.indices[row].tolist(), logp.values[row].tolist()):
                        children.append(_Node(parent.score + lp, token, parent, level + 1))
                        inputs.append(out[row])
                t.nodes += children
                best = sorted(range(len(children)), key=lambda c: -children[c].score)[:k]
                t.frontier = [children[c] for c in best]
                t.inputs = [inputs[c] for c in best]
        for req, t in trees.items():
            # the n best; a parent scores at least its child and sorts first on a tie (depth)
            order = sorted(range(len(t.nodes)), key=lambda i: (-t.nodes[i].score, t.nodes[i].depth))
            rank = {i: r for r, i in enumerate(order[: t.n])}
            chosen = sorted(rank, key=lambda i: (t.nodes[i].depth, rank[i]))
            row = {id(t.nodes[i]): j + 1 for j, i in enumerate(chosen)}
            req.drafts = [t.nodes[i].token for i in chosen]
            req.draft_parents = [
                0 if t.nodes[i].parent is None else row[id(t.nodes[i].parent)] for i in chosen
            ]


class _Node:
    """A token of a draft tree: its path's log-probability under the head, its parent, its
    level, and its slot among the head's tree slots once the head ran over it."""

    __slots__ = ("score", "token", "parent", "depth", "slot")

    def __init__(self, score: float, token: int, parent, depth: int):
        self.score, self.token, self.parent, self.depth = score, token, parent, depth
        self.slot = None

    def slots(self) -> list[int]:
        """The head's slots this token's run sees: its ancestors' and its own."""
        out, node = [], self
        while node is not None:
            out.append(node.slot)
            node = node.parent
        return out[::-1]


class _Tree:
    """A request's tree under construction: its draft count, every token so far, the level the
    head runs over next and that level's hidden inputs (the head's output at each parent)."""

    def __init__(self, n: int, nodes: list, frontier: list, inputs: list):
        self.n, self.nodes, self.frontier, self.inputs = n, list(nodes), frontier, inputs


class MtpProposer(EagleProposer):
    """``MTP``: DeepSeek-V3's next-token-prediction layer of the target's own checkpoint
    (``models/deepseek_mtp.py``), run as an EAGLE head is."""

    def head_class(self) -> type:
        from pdserve.models.deepseek_mtp import DeepseekV3MTP

        return DeepseekV3MTP


class Eagle3Proposer(EagleProposer):
    """``EAGLE3``: an EAGLE-3 head (``models/eagle.py``) over three of the target's layer
    outputs for its first step and its own output stream after that."""

    def head_class(self) -> type:
        from pdserve.models.eagle import Eagle3LlamaForCausalLM

        return Eagle3LlamaForCausalLM
