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
the last pages go: ``PDQueues.prompt_done`` runs after ``stepped``), sends the head's KV with the
pages and puts the first draft, its probability and the head's hidden state in the metadata row
(``output_topk_index`` / ``output_topk_p`` / ``output_hidden_states``); decode speculates from its
first step with them.

A prefix-cache hit's last pair was computed with the token that followed the prefix when it
was cached (the hidden state of the next position is not kept): where the new sequence goes on
differently, the head's first drafts may differ from a cold run's; the tokens never do.
"""

from __future__ import annotations

import torch

from pdserve.engine.request import Req
from pdserve.engine.speculative import SpecState
from pdserve.engine.speculative.draft_model import DraftModelProposer


class EagleProposer(DraftModelProposer):
    def __init__(self, args, runner, kv_allocator, par):
        super().__init__(args, runner, kv_allocator, par, model_cls=self.head_class())
        self.runner.model.share_target(runner.model)
        runner.capture_hidden = True
        self.runner.capture_hidden = True

    def head_class(self) -> type:
        from pdserve.models.eagle import EagleLlamaForCausalLM

        return EagleLlamaForCausalLM

    def started(self, req: Req, transferred: bool = False) -> None:
        req.kv.draft_len = req.kv_len
        if req.spec is not None and not transferred:  # a transferred one keeps prefill's draft
            req.spec.next_draft = req.spec.hidden = None

    def follow(self, rows: list[tuple[Req, int, int]]) -> None:
        """The pairs whose next token is known before sampling (a prompt chunk's, but for the
        prompt's last position): computed before the PD queues send the chunk's pages."""
        self._pairs(rows, lambda req, end: min(end, req.seq_len - 1), drafts=False)

    def verified(self, req: Req, start: int, drafted: int, kept: int) -> None:
        pass  # ``stepped`` computes the kept positions' pairs

    @torch.inference_mode()
    def stepped(self, rows: list[tuple[Req, int, int]]) -> None:
        """The rest, once the step's tokens are sampled and verified; the pair of a request's last
        computed position gives its next draft."""
        self._pairs(rows, lambda req, end: min(end, req.kv_len))

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
            feats += range(first + begin - start, first + end - start)
            if drafts and end == req.seq_len - 1:  # the last computed position: the next draft
                last.append((req, len(ids) - 1))
        if not todo:
            return
        logits = self._run(todo, ids, positions, [row for _, row in last], target_hidden[feats])
        hidden = self.runner.last_hidden
        for req, begin, n in todo:
            req.kv.draft_len = begin + n
        probs = torch.softmax(logits, dim=-1).max(dim=-1) if last else None
        for k, (req, row) in enumerate(last):
            if req.spec is None:
                req.spec = SpecState(budget=self.num_drafts)
            req.spec.next_draft = int(probs.indices[k])
            req.spec.next_draft_p = float(probs.values[k])
            req.spec.hidden = hidden[row].clone()

    @torch.inference_mode()
    def propose(self, items: list[tuple[Req, int]]) -> None:
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
