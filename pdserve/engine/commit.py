"""Where drawn tokens become a request's output: the one place a token is appended.

``Committer.commit`` appends a request's drawn tokens one by one (its output, logprobs and
grammar state), checks the stop conditions after each and stops at the first that ends the
request; it returns that ``FinishReason`` rather than ending the request, so the caller decides
when it takes effect (a PD prefill hands a request whose first token is drawn to decode first).
``record_input_logprobs`` stores the prompt logprobs a step's rows read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pdserve.engine import logprobs as lp
from pdserve.engine.request import FinishKind, FinishReason, Req
from pdserve.engine.stop import check_finish


@dataclass
class Drawn:
    """A token drawn for a request, with its logprob and top logprobs when the request asked."""

    token: int
    logprob: Optional[float] = None
    top: Optional[list] = None


def not_finite() -> FinishReason:
    """An engine fault (the request checks keep the client's knobs finite)."""
    why = "sampling: the request's logits were not finite (NaN or infinity)"
    return FinishReason(FinishKind.ABORT, message=why, status_code=500)


class Committer:
    def __init__(self, eos_ids: set[int], tokenizer, context_length: int):
        self.eos_ids = eos_ids
        self.tokenizer = tokenizer
        self.context_length = context_length

    def commit(
        self, req: Req, drawn: list[Drawn], kv_base: Optional[int] = None
    ) -> Optional[FinishReason]:
        """Append ``drawn`` to ``req`` up to the first token that finishes it. ``kv_base``: a
        verify row's ``kv_len`` after its first token, which follows each appended token (the
        KV of accepted drafts is in; the last token's is the next step's input)."""
        for j, d in enumerate(drawn):
            req.output_ids.append(d.token)
            if kv_base is not None:
                req.kv_len = kv_base + j
            if req.grammar is not None:
                req.grammar.advance(req.output_ids)
            if req.return_logprob:
                req.output_token_logprobs.append((d.logprob, d.token))
                if req.top_logprobs_num:
                    req.output_top_logprobs.append(d.top or [])
            reason = self.finish_reason(req)
            if reason is not None:
                return reason
        return None

    def finish_reason(self, req: Req) -> Optional[FinishReason]:
        """Why ``req`` ends after its newest output token (None: it goes on)."""
        reason = check_finish(req, self.eos_ids, self.tokenizer, self.context_length)
        grammar = req.grammar
        if grammar is not None and grammar.failed:  # an engine fault, not the client's
            return FinishReason(
                FinishKind.ABORT, message=f"grammar: {grammar.failed}", status_code=500
            )
        if reason is None and grammar is not None and grammar.terminated:
            # complete, even with ignore_eos
            reason = FinishReason(FinishKind.STOP, matched=req.output_ids[-1])
        return reason


def record_input_logprobs(logits: torch.Tensor, spans) -> None:
    """Store the prompt logprobs of a step's ``LogprobSpan``s (called once the rows' ``kv_len``
    counts the step: a request whose computed tokens reach its prompt's last one is done)."""
    for span in spans:
        req = span.req
        rows = logits[span.at : span.at + len(span.targets)]
        vals = lp.token_logprobs(rows, torch.tensor(span.targets, device=rows.device))
        req.input_token_logprobs.extend(zip(vals, span.targets))
        if req.top_logprobs_num:
            req.input_top_logprobs.extend(lp.top_logprobs(rows, req.top_logprobs_num))
        if req.kv_len >= req.prompt_len - 1:
            req.input_logprobs_done = True
