"""Next-token sampling for a batch of requests (one logits row per request).

Per row, in order: repetition penalty (vLLM: over prompt + output tokens, positive logits
divided, negative multiplied), frequency/presence penalties (OpenAI: over output tokens,
``logit -= freq * count + presence * (count > 0)``), the ``min_new_tokens`` ban on EOS and
``stop_token_ids``, the grammar mask of a constrained row (``pdserve/grammar``: disallowed tokens
become -inf; if the bans leave the grammar nothing, the grammar wins), then greedy argmax
(``temperature`` below ``SAMPLING_EPS`` or ``top_k == 1``) or temperature -> top_k -> top_p (over
the top-k renormalised distribution) -> min_p -> draw.

Reported logprobs are those of the raw logits (before penalties and temperature).

Randomness: each sampled row takes one uniform from a CPU generator and draws by inverse CDF.
A request with ``sampling.seed`` has its own generator (kept in ``req.generator``), re-seeded
every step from ``(seed, len(output_ids))``. Its tokens therefore depend only on its own logits,
not on which other requests share the batch, and stay the same across retraction/recompute and
across a prefill/decode split (the decode side starts a fresh generator and still draws what a
colocated server would). Other requests share the sampler's generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from pdserve.engine.logprobs import TopList, token_logprobs, top_logprobs
from pdserve.engine.request import Req, SamplingParams
from pdserve.grammar.mask import apply_bitmask

_MASK64 = (1 << 64) - 1
# Filtered rows look at this many most likely tokens before falling back to a full sort.
_CANDIDATES = 256


def _step_seed(seed: int, step: int) -> int:
    """A well-mixed 63-bit seed for draw number ``step`` of a request seeded with ``seed``."""
    z = (seed + (step + 1) * 0x9E3779B97F4A7C15) & _MASK64  # splitmix64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _has_penalty(s: SamplingParams) -> bool:
    return s.repetition_penalty != 1.0 or s.frequency_penalty != 0.0 or s.presence_penalty != 0.0


def _has_filter(s: SamplingParams) -> bool:
    return s.top_k > 1 or s.top_p < 1.0 or s.min_p > 0.0


def _rows_to_process(
    reqs: Sequence[Req], ahead: Sequence[Sequence[int]]
) -> tuple[list[int], list[int]]:
    """(rows with a penalty, rows still under min_new_tokens); ``ahead[i]``: tokens row i draws
    after (a speculative row's accepted drafts before it)."""
    penalized = [i for i, r in enumerate(reqs) if _has_penalty(r.sampling)]
    banned = [
        i
        for i, r in enumerate(reqs)
        if len(r.output_ids) + len(ahead[i]) < r.sampling.min_new_tokens
    ]
    return penalized, banned


def _pairs(
    rows: list[int], id_lists: list[list[int]], device, *per_row: list[float]
) -> list[torch.Tensor]:
    """Flattened (row, token) index pairs of each row's token list, plus each ``per_row`` value
    list repeated to one value per pair."""
    lengths = torch.tensor([len(ids) for ids in id_lists], dtype=torch.long)
    out = [
        torch.tensor(rows, dtype=torch.long).repeat_interleave(lengths),
        torch.tensor([t for ids in id_lists for t in ids], dtype=torch.long),
    ]
    out += [torch.tensor(v, dtype=torch.float32).repeat_interleave(lengths) for v in per_row]
    return [t.to(device) for t in out]


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row of ``probs`` [R, W] (unnormalised, >= 0) given uniforms [R].
    The first index whose cumulative mass exceeds u * total always has nonzero probability."""
    cum = probs.cumsum(dim=-1)
    total = cum[:, -1:]
    target = torch.minimum(
        uniforms.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total))
    )
    return torch.searchsorted(cum, target, right=True).view(-1)


def _draw_sorted(probs: torch.Tensor, token_ids: torch.Tensor, knobs: torch.Tensor) -> torch.Tensor:
    """Apply top_k, top_p, min_p to ``probs`` [R, W] (each row sorted descending; the first
    W tokens of the row by probability, ids in ``token_ids``) and draw a token id per row.
    ``knobs`` columns: top_k, top_p, min_p, total mass of the row, uniform."""
    top_k, top_p, min_p, row_total = (knobs[:, i : i + 1] for i in range(4))
    width = probs.shape[-1]
    rank = torch.arange(width, device=probs.device)
    probs = probs.masked_fill(rank.unsqueeze(0) >= top_k, 0.0)
    cum = probs.cumsum(dim=-1)
    # Nucleus over the top-k renormalised distribution: drop a token once the tokens before it
    # already hold top_p of the top-k mass. The first token has no mass before it: always kept.
    total = torch.where(top_k <= width, cum[:, -1:], row_total)
    probs = probs.masked_fill(cum - probs > top_p * total, 0.0)
    # min_p is relative to the most likely token, so renormalising does not change it.
    probs = probs.masked_fill(probs < min_p * probs[:, :1], 0.0)
    picked = _inverse_cdf(probs, knobs[:, 4])
    return token_ids.gather(1, picked.unsqueeze(1)).view(-1)


@dataclass
class SampleOutput:
    next_ids: list[int]
    # one entry per request; None for requests without return_logprob
    logprobs: list[Optional[float]]
    # one entry per request; None unless return_logprob and top_logprobs_num > 0
    top_logprobs: list[Optional[TopList]]
    # rows that drew no token: their processed logits were not finite (next_ids holds 0 there)
    failed: list[int] = field(default_factory=list)


class Sampler:
    """Samples one token per request. Holds no per-request state except ``req.generator``.

    ``logits`` may be wider than ``vocab_size`` (padded lm_head); the extra columns are never
    sampled. ``req.output_ids`` must not yet contain the token being sampled.
    """

    def __init__(self, vocab_size: int, device, eos_token_ids: set[int], seed: int = 0):
        self.vocab_size = vocab_size
        self.device = torch.device(device)  # where logits live; the generators are on the CPU
        self.eos_token_ids = sorted(t for t in eos_token_ids if 0 <= t < vocab_size)
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)

    def sample(
        self,
        logits: torch.Tensor,
        reqs: Sequence[Req],
        grammar: Optional[tuple[torch.Tensor, list[int]]] = None,
        offsets: Optional[Sequence[int]] = None,
        ahead: Optional[Sequence[Sequence[int]]] = None,
    ) -> SampleOutput:
        """``grammar``: (bitmask [G, words], the G constrained rows) or None. ``offsets``: per
        row, how many tokens past the request's output it draws (speculative rows of one request:
        0, 1, ...; a seeded request's draw depends on its seed and that position only);
        ``ahead``: per row, the tokens between the request's output and the row (a speculative
        row's drafts before it), which penalties and the min_new_tokens ban count as output."""
        offsets = list(offsets) if offsets is not None else [0] * len(reqs)
        ahead = list(ahead) if ahead is not None else [()] * len(reqs)
        assert logits.dim() == 2 and logits.shape[0] == len(reqs), (logits.shape, len(reqs))
        assert logits.shape[1] >= self.vocab_size, (logits.shape, self.vocab_size)
        raw = logits[:, : self.vocab_size]
        num = len(reqs)
        greedy = [r.sampling.is_greedy for r in reqs]
        penalized, banned = _rows_to_process(reqs, ahead)

        if all(greedy) and not penalized and not banned and grammar is None:
            # Fast path; argmax is exact in any float dtype.
            next_ids = raw.argmax(dim=-1)
        else:
            x = raw.to(torch.float32, copy=True)
            self._process(x, reqs, penalized, banned, ahead)
            if grammar is not None:
                self._constrain(x, raw, *grammar)
            greedy_rows = [i for i in range(num) if greedy[i]]
            sampled_rows = [i for i in range(num) if not greedy[i]]
            if not sampled_rows:
                next_ids = x.argmax(dim=-1)
            elif not greedy_rows:
                next_ids = self._sample_rows(x, list(reqs), offsets)
            else:
                next_ids = torch.empty(num, dtype=torch.long, device=x.device)
                g = self._index(greedy_rows, x)
                s = self._index(sampled_rows, x)
                next_ids[g] = x[g].argmax(dim=-1)
                next_ids[s] = self._sample_rows(
                    x[s], [reqs[i] for i in sampled_rows], [offsets[i] for i in sampled_rows]
                )
        # a row whose processed logits hold a NaN (or +inf) draws past the vocabulary: it gets no
        # token, and the scheduler ends that request instead of indexing with it
        bad = (next_ids < 0) | (next_ids >= raw.shape[-1])
        failed = bad.nonzero().view(-1).tolist() if bool(bad.any()) else []
        if failed:
            next_ids = next_ids.masked_fill(bad, 0)
        out = self._output(raw, next_ids, reqs)
        out.failed = failed
        return out

    # -- logit processing (in place on a float32 copy) --------------------------------------

    def process_logits(self, logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
        """A float32 copy of ``logits[:, :vocab_size]`` with penalties and min_new_tokens bans
        applied: what greedy rows take the argmax of and sampled rows divide by temperature."""
        x = logits[:, : self.vocab_size].to(torch.float32, copy=True)
        ahead = [()] * len(reqs)
        penalized, banned = _rows_to_process(reqs, ahead)
        self._process(x, reqs, penalized, banned, ahead)
        return x

    def _process(
        self,
        x: torch.Tensor,
        reqs: Sequence[Req],
        penalized: list[int],
        banned: list[int],
        ahead: Sequence[Sequence[int]],
    ) -> None:
        if penalized:
            self._apply_penalties(x, reqs, penalized, ahead)
        if banned:
            self._ban_stop_tokens(x, reqs, banned)

    def _constrain(
        self, x: torch.Tensor, raw: torch.Tensor, bitmask: torch.Tensor, rows: list[int]
    ) -> None:
        """Grammar masks on ``rows``. A row the min_new_tokens ban left without an allowed token
        (the grammar wants EOS) takes the grammar's mask over its unbanned logits."""
        index = self._index(rows, x)
        apply_bitmask(x, bitmask, index)
        dead = torch.isneginf(x.amax(dim=-1).index_select(0, index)).nonzero().view(-1)
        if dead.numel():
            redo = raw.index_select(0, index[dead]).to(torch.float32)
            apply_bitmask(
                redo,
                bitmask.index_select(0, dead.cpu()),
                torch.arange(dead.numel(), device=x.device),
            )
            x.index_copy_(0, index[dead], redo)

    @staticmethod
    def _index(rows: list[int], like: torch.Tensor) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.long, device=like.device)

    def _apply_penalties(
        self, x: torch.Tensor, reqs: Sequence[Req], rows: list[int], ahead
    ) -> None:
        """Touches only the (row, token) pairs that occur, so the cost follows the token count,
        not rows x vocab; a row's ``ahead`` tokens count as output."""
        params = {i: reqs[i].sampling for i in rows}
        rep = [i for i in rows if params[i].repetition_penalty != 1.0]
        if rep:
            r, t, penalty = _pairs(
                rep,
                [reqs[i].all_ids + list(ahead[i]) for i in rep],
                x.device,
                [params[i].repetition_penalty for i in rep],
            )
            vals = x[r, t]
            # A repeated token writes the same value several times: applied once per token.
            x[r, t] = torch.where(vals > 0, vals / penalty, vals * penalty)
        occ = [i for i in rows if params[i].frequency_penalty or params[i].presence_penalty]
        if occ:
            r, t, freq, presence = _pairs(
                occ,
                [reqs[i].output_ids + list(ahead[i]) for i in occ],
                x.device,
                [params[i].frequency_penalty for i in occ],
                [params[i].presence_penalty for i in occ],
            )
            x.index_put_((r, t), -freq, accumulate=True)  # once per occurrence
            x[r, t] = x[r, t] - presence  # once per distinct token, as above

    def _ban_stop_tokens(self, x: torch.Tensor, reqs: Sequence[Req], rows: list[int]) -> None:
        """min_new_tokens not reached yet: EOS and stop token ids cannot be drawn (even with
        ignore_eos, which only stops EOS from finishing the request)."""
        id_lists = []
        for i in rows:
            stop_ids = reqs[i].sampling.stop_token_ids or []
            extra = [t for t in stop_ids if 0 <= t < self.vocab_size]
            id_lists.append(sorted(set(self.eos_token_ids).union(extra)))
        r, t = _pairs(rows, id_lists, x.device)
        x[r, t] = float("-inf")

    # -- drawing -----------------------------------------------------------------------------

    def _sample_rows(self, x: torch.Tensor, reqs: list[Req], offsets: list[int]) -> torch.Tensor:
        """Draw one token per row of ``x`` [R, V] (all rows non-greedy), by inverse CDF with one
        uniform per row. A row's token depends only on that row and its request."""
        dev = x.device
        params = [r.sampling for r in reqs]
        temps = torch.tensor([p.temperature for p in params], device=dev).unsqueeze(1)
        probs = torch.softmax(x / temps, dim=-1)
        uniforms = self._uniforms(reqs, offsets).to(dev)

        filtered = [j for j, p in enumerate(params) if _has_filter(p)]
        if not filtered:
            return _inverse_cdf(probs, uniforms)
        plain = [j for j, p in enumerate(params) if not _has_filter(p)]
        choice = torch.empty(len(reqs), dtype=torch.long, device=dev)
        if plain:
            pl = self._index(plain, x)
            choice[pl] = _inverse_cdf(probs[pl], uniforms[pl])
        f = self._index(filtered, x)
        choice[f] = self._sample_filtered(probs[f], uniforms[f], [params[j] for j in filtered])
        return choice

    def _sample_filtered(
        self, probs: torch.Tensor, uniforms: torch.Tensor, params: list[SamplingParams]
    ) -> torch.Tensor:
        """Rows with top_k/top_p/min_p. A full sort is slow on CPU (~0.4 s for 64 x 49k), so
        each row first takes its most likely ``_CANDIDATES`` tokens; only rows whose filters may
        keep a token outside them are sorted in full."""
        vocab = probs.shape[-1]
        width = min(_CANDIDATES, vocab)
        # per-row knobs, columns: top_k (vocab when disabled), top_p, min_p, total mass, uniform
        knobs = torch.tensor(
            [[min(p.top_k, vocab) if p.top_k > 0 else vocab, p.top_p, p.min_p] for p in params],
            dtype=torch.float32,
            device=probs.device,
        )
        knobs = torch.cat([knobs, probs.sum(-1, keepdim=True), uniforms.unsqueeze(1)], dim=1)
        top_k, top_p, min_p, total = knobs[:, 0:1], knobs[:, 1:2], knobs[:, 2:3], knobs[:, 3:4]

        cand, cand_ids = probs.topk(width, dim=-1, sorted=True)
        # The candidates suffice when the tail is dropped for sure, and the top_p total (the
        # mass of the top_k tokens) is known without looking at the tail.
        total_known = (top_k <= width) | (top_k >= vocab) | (top_p >= 1.0)
        tail_dropped = (
            (top_k <= width)
            | (cand.sum(-1, keepdim=True) > top_p * total)
            | (cand[:, -1:] < min_p * cand[:, :1])
        )
        fits = (total_known & tail_dropped).view(-1)
        if bool(fits.all()):
            return _draw_sorted(cand, cand_ids, knobs)

        choice = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
        fit, rest = fits.nonzero().view(-1), (~fits).nonzero().view(-1)
        if fit.numel():
            choice[fit] = _draw_sorted(cand[fit], cand_ids[fit], knobs[fit])
        sorted_probs, order = probs[rest].sort(dim=-1, descending=True, stable=True)
        choice[rest] = _draw_sorted(sorted_probs, order, knobs[rest])
        return choice

    def _uniforms(self, reqs: list[Req], offsets: list[int]) -> torch.Tensor:
        """One uniform in [0, 1) per row, on the CPU: seeded requests draw from their own
        generator, seeded by the output position drawn, the others from the shared one. CPU
        generators make a seed give the same tokens on any device (for the same probabilities)."""
        u = torch.empty(len(reqs))
        shared = [j for j, r in enumerate(reqs) if r.sampling.seed is None]
        if shared:
            u[shared] = torch.rand(len(shared), generator=self.generator)
        for j, r in enumerate(reqs):
            if r.sampling.seed is not None:
                u[j] = torch.rand(1, generator=self._req_generator(r, offsets[j]))[0]
        return u

    def _req_generator(self, req: Req, offset: int = 0) -> torch.Generator:
        gen = req.generator
        if gen is None:
            gen = req.generator = torch.Generator()
        gen.manual_seed(_step_seed(req.sampling.seed, len(req.output_ids) + offset))
        return gen

    # -- output ------------------------------------------------------------------------------

    def _output(
        self, raw: torch.Tensor, next_ids: torch.Tensor, reqs: Sequence[Req]
    ) -> SampleOutput:
        num = len(reqs)
        logprobs: list[Optional[float]] = [None] * num
        tops: list[Optional[TopList]] = [None] * num
        wanted = [i for i, r in enumerate(reqs) if r.return_logprob]
        if wanted:
            w = self._index(wanted, raw)
            for i, lp in zip(wanted, token_logprobs(raw[w], next_ids[w])):
                logprobs[i] = lp
            with_top = [i for i in wanted if reqs[i].top_logprobs_num > 0]
            if with_top:
                k = max(reqs[i].top_logprobs_num for i in with_top)
                lists = top_logprobs(raw[self._index(with_top, raw)], k)
                for i, lst in zip(with_top, lists):
                    tops[i] = lst[: reqs[i].top_logprobs_num]
        return SampleOutput(next_ids=next_ids.tolist(), logprobs=logprobs, top_logprobs=tops)
