"""``STANDALONE`` drafts: a smaller model of the target's vocabulary proposes each request's next
tokens by its own greedy decoding (``--speculative-draft-model-path``).

The draft's KV layers live in pools of their own indexed by the target's page ids: those of the
*host* group, the target's first paged group that keeps every page (so a request's pages, the
prefix cache's pages and a PD transfer's pages carry both models' KV). ``KVSlots.draft_len``
counts the positions whose draft KV is written; the prefix cache takes pages only up to it, so
a hit holds both models' KV.

- Every prompt chunk the target computes the draft computes too, from ``draft_len``
  (``follow``), before the PD queues send the row's pages; and every plain decode step of a
  request that never speculates (penalties, a grammar), so its output's pages are cached with
  the draft's KV. A speculating request that skips drafting for a while (its drafts were being
  rejected) lets the draft lag, and its next drafting step computes the lag in one row (a token
  at a time would cost a draft forward per token for no drafts).
- A speculating row: the draft first computes what it lags (the row's token, and the last
  accepted draft when a step kept all) and takes its argmax, then one token per further draft.
  It wrote positions K .. K + k - 1 for the row token at K and drafts d1 .. d(k-1); after the
  target kept ``kept`` tokens, positions up to K + min(kept, k) - 1 hold the right tokens.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from pdserve.engine.kv_budget import PageRider
from pdserve.engine.request import Req
from pdserve.engine.speculative import Proposer, Speculator

logger = logging.getLogger(__name__)


def host_group(groups) -> int:
    """The target's cache group whose page ids the draft's KV shares: the first paged group
    that keeps every page."""
    for g in groups:
        if g.spec.keeps_every_page:
            return g.id
    kinds = ", ".join(g.kind for g in groups)
    raise ValueError(
        "speculative_algorithm: 'STANDALONE' keeps the draft's KV in the pages of a target "
        f"cache group that keeps every page, and this model has none (cache groups: {kinds})"
    )


def draft_page_bytes(args, par, item_bytes: int) -> int:
    """Bytes of one page of the draft's KV on this rank (every layer), from its config alone:
    what the target's memory budget sets aside per page of the host group."""
    from pdserve.kv_spec import FullAttention, specs_of
    from pdserve.models.loader import load_config
    from pdserve.models.registry import model_class

    config = load_config(args.speculative_draft_model_path)
    with torch.device("meta"):
        model = model_class(config)(config, par=par, moe=args.moe_options())
    total = 0
    for entry in model.kv_cache_specs():
        for spec in specs_of(entry):
            if isinstance(spec, FullAttention):  # a window masks full pages in a draft
                spec = FullAttention(spec.num_kv_heads, spec.head_dim)
            total += spec.page_bytes(args.page_size, item_bytes)
            if isinstance(spec, FullAttention) and args.kv_cache_dtype == "int8":  # row scales
                total += spec.page_bytes(args.page_size, 4) // spec.head_dim
    return total


class DraftModelProposer(Proposer):
    has_kv = True

    @classmethod
    def page_riders(cls, args, par) -> list:
        """The draft's KV lives in pools of the host group's page count."""

        def rider(groups, item_bytes: int) -> PageRider:
            return PageRider(host_group(groups), draft_page_bytes(args, par, item_bytes), "draft")

        return [rider]

    def __init__(self, args, runner, kv_allocator, par, model_cls=None):
        from pdserve.engine.model_runner import ModelRunner

        path = args.speculative_draft_model_path
        if par.pp_size > 1 or par.dp_attention:
            raise ValueError(
                "speculative_algorithm: 'STANDALONE' is not available with "
                + ("pipeline parallelism (pp_size > 1)" if par.pp_size > 1 else "DP attention")
                + " yet"
            )
        self.target = runner
        self.host = host_group(runner.cache_groups)
        pages = runner.pools[self.host].num_pages
        draft_args = dataclasses.replace(
            args,
            model_path=path,
            tokenizer_path=path,
            served_model_name=None,
            speculative_algorithm=None,
            speculative_draft_model_path=None,
            speculative_num_steps=None,
            speculative_eagle_topk=None,  # its pools use the host group's scratch pages
            dtype=str(runner.dtype).replace("torch.", ""),
            context_length=None,
            max_total_tokens=(pages - 1) * args.page_size,  # the host group's pages, one for one
            disable_hybrid_swa_memory=True,  # a draft's windows mask full pages
            enable_return_routed_experts=False,
        )
        self.runner = ModelRunner(draft_args, kv_allocator, par, model_cls=model_cls)
        self.num_drafts = args.speculative_num_draft_tokens
        if self.runner.vocab_size != runner.vocab_size:
            raise ValueError(
                f"speculative_draft_model_path: the draft {path!r} has a vocabulary of "
                f"{self.runner.vocab_size} tokens and the target {args.model_path!r} one of "
                f"{runner.vocab_size}: a draft must share the target's tokenizer"
            )
        for g in self.runner.cache_groups:
            if g.spec.per_request:
                raise ValueError(
                    f"speculative_draft_model_path: the draft {path!r} keeps a per-request "
                    f"state ({g.kind}), which cannot drop rejected drafts; use an attention model"
                )
        if [p.num_pages for p in self.runner.pools] != [pages] * len(self.runner.pools):
            raise AssertionError("the draft's pools must have the host group's page count")
        runner.draft = self.runner
        runner.draft_host = self.host
        self.runner.share_scratch(runner.pools[self.host])
        self.groups = len(self.runner.pools)
        logger.info(
            "speculative draft %s: %d layers, KV %.1f MiB in the pages of cache group %d",
            path,
            len(self.runner.layer_group),
            sum(p.nbytes for p in self.runner.pools) / 2**20,
            self.host,
        )

    def check_tokenizer(self, tokenizer) -> None:
        """A draft directory with a tokenizer of its own must have the target's vocabulary."""
        import os

        path = self.runner.args.model_path
        if tokenizer is None or not os.path.exists(os.path.join(path, "tokenizer_config.json")):
            return
        from pdserve.tokenizer import load_tokenizer

        theirs = load_tokenizer(path).get_vocab()
        ours = tokenizer.get_vocab()
        if theirs != ours:
            diff = len(set(theirs.items()) ^ set(ours.items()))
            raise ValueError(
                f"speculative_draft_model_path: the draft {path!r}'s tokenizer differs from the "
                f"target's ({len(theirs)} against {len(ours)} tokens, {diff} entries differ): a "
                "draft must share the target's tokenizer"
            )

    # ---- the draft's forwards ---------------------------------------------------------------
    def _run(self, rows, ids, positions, logits_idx, hidden=None, trees=None) -> torch.Tensor:
        """The draft over ``rows`` (request, first slot, token count; the tokens in ``ids`` at
        ``positions``): its logits at ``logits_idx``; ``hidden``: a head's second input
        (``ForwardBatch.spec_hidden``); ``trees``: rows of a tree (``ForwardBatch.trees``). The
        draft's hidden states are ``runner.last_hidden`` where it keeps them."""
        fb = self.runner.make_forward_batch(
            ids,
            positions,
            [start for _, start, _ in rows],
            [n for *_, n in rows],
            [[req.kv.pages[self.host]] * self.groups for req, _, _ in rows],
            logits_idx,
            full_lens=[req.seq_len for req, _, _ in rows],
            trees=trees,
        )
        fb.spec_hidden = hidden
        return self.runner.forward(fb)

    def _forward(self, rows: list[tuple[Req, int, list[int]]], logits: bool) -> list[int]:
        """Run the draft over ``rows`` (request, first position, tokens); the argmax after each
        row's last token when ``logits``."""
        ids, positions, idx = [], [], []
        for _, start, tokens in rows:
            ids += tokens
            positions += range(start, start + len(tokens))
            idx.append(len(ids) - 1)
        counts = [(req, start, len(tokens)) for req, start, tokens in rows]
        out = self._run(counts, ids, positions, idx if logits else [])
        return out.argmax(dim=-1).tolist() if logits else []

    def started(self, req: Req, transferred: bool = False) -> None:
        # a request moved here mid-decode (``resumed``): its draft's KV of the last position may
        # be stale (the source's draft lags one token after a row that kept every draft), so the
        # draft computes that position again before drafting
        self.port.kv.draft_computed(req, req.kv_len - 1 if req.resumed else req.kv_len)

    def follow(self, rows: list[tuple[Req, int, int]]) -> None:
        todo = []
        for req, first, ext in rows:
            if req.drafts:
                continue  # its drafts were computed by ``propose``
            start, end = req.kv.draft_len, first + ext
            if ext == 1 and end == req.seq_len and Speculator.speculable(req):
                continue  # a speculating request's draft catches up when it drafts next
            if start < end:
                todo.append((req, start, req.all_ids[start:end]))
        if todo:
            self._forward(todo, logits=False)
            for req, _, tokens in todo:
                self.port.kv.draft_computed(req, req.kv.draft_len + len(tokens))

    @torch.inference_mode()
    def propose(self, items: list[tuple[Req, int]]) -> None:
        first = self._forward(
            [
                (req, req.kv.draft_len, req.all_ids[req.kv.draft_len : req.seq_len])
                for req, _ in items
            ],
            logits=True,
        )
        for (req, _), token in zip(items, first):
            self.port.kv.draft_computed(req, req.seq_len)
            req.drafts = [token]
        for j in range(1, max(n for _, n in items)):
            live = [req for req, n in items if n > j]
            nxt = self._forward([(req, req.seq_len - 1 + j, req.drafts[-1:]) for req in live], True)
            for req, token in zip(live, nxt):
                req.drafts.append(token)

    def verified(self, req: Req, start: int, drafted: int, kept: int, path=None) -> None:
        self.port.kv.draft_computed(req, start + min(kept, drafted))
