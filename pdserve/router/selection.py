"""Who serves one attempt of a request: a worker per role by that role's policy, among the pairs
that can move KV to each other (``pairing.py``); then, with ``--pd-policy conditional``, whether
prefill takes part at all (``pd_policy.py``); with ``--dp-aware``, each worker's DP group."""

from __future__ import annotations

import logging
from typing import Callable

from pdserve.router import pairing
from pdserve.router.kv_index import KVIndex, PromptBlocks
from pdserve.router.pd_policy import LOCAL, Decision, PDPolicy
from pdserve.router.policy import CacheAwarePolicy, make_policy
from pdserve.router.workers import DECODE, PREFILL, REGULAR, Worker, WorkerPool

logger = logging.getLogger(__name__)


class Selector:
    def __init__(self, pool: WorkerPool, metrics, args, index: KVIndex | None = None):
        self.pool = pool
        self.metrics = metrics
        self.index = index
        balance = args.cache_aware_balance
        self.policies = {
            PREFILL: make_policy(args.prefill_policy or args.policy, index, balance),
            DECODE: make_policy(args.decode_policy or args.policy, index, balance),
            REGULAR: make_policy(args.policy, index, balance),
        }
        self.pd = PDPolicy(args, index)

    def select(
        self, exclude: set[Worker], keep: Worker | None = None, prompt: PromptBlocks | None = None
    ) -> tuple[list[Worker] | None, str]:
        """[prefill, decode] (PD) or [worker] (colocated), or None and why not. ``keep``: a
        worker to keep from the last attempt when it is still available."""
        roles = [PREFILL, DECODE] if self.pool.pd_mode else [REGULAR]
        chosen = []
        for role in roles:
            candidates = self.pool.available(role, exclude)
            if not candidates:
                tried = (
                    " (the others failed this request)"
                    if any(w.role == role for w in exclude)
                    else ""
                )
                return None, f"no healthy {role} worker available{tried}"
            if role == PREFILL:  # only prefills that some decode can work with
                decodes = self.pool.available(DECODE, exclude)
                fits = [
                    p for p in candidates if any(pairing.why_not(p, d) is None for d in decodes)
                ]
                if decodes and not fits:
                    return None, pairing.why_not(candidates[0], decodes[0])
                candidates = fits or candidates
            elif role == DECODE:
                fits = [d for d in candidates if pairing.why_not(chosen[0], d) is None]
                if not fits:
                    return None, pairing.why_not(chosen[0], candidates[0])
                candidates = fits
            policy = self.policies[role]
            worker = (
                keep
                if keep is not None and keep in candidates
                else policy.select(candidates, prompt)
            )
            if policy.needs_index and prompt is not None and prompt.ids:
                matched = self.index.matched_tokens(worker, prompt)[0]
                self.metrics.cache_matched_tokens.labels(role).observe(matched / len(prompt.ids))
            chosen.append(worker)
        return chosen, ""

    def decide(
        self, prompt: PromptBlocks | None, prefill: Worker, main: Worker, path: str, batch: bool
    ) -> tuple[Worker | None, Decision]:
        """The prefill leg's worker for this attempt (``prefill``, or None when decode prefills
        locally) and the decision, recorded in the metrics."""
        d = self.pd.decide(prompt, prefill, main, batch=batch)
        self.metrics.pd_decisions.labels(d.mode, d.reason).inc()
        if d.ttft_pd_s is not None:
            self.metrics.pd_estimated_ttft.labels("pd").observe(d.ttft_pd_s)
            self.metrics.pd_estimated_ttft.labels("local").observe(d.ttft_local_s + d.itl_penalty_s)
        if d.mode == LOCAL:
            logger.debug("%s prefilled on decode %s: %s", path, main.url, d.meta())
            return None, d
        return prefill, d

    def group_chooser(self, worker: Worker, prompt: PromptBlocks | None) -> Callable[[], int]:
        """How ``worker``'s DP group is chosen: by its groups' caches under ``cache_aware``, else by
        load."""
        policy = self.policies[worker.role]
        if prompt is not None and isinstance(policy, CacheAwarePolicy):
            return lambda: policy.choose_group(worker, prompt)
        return worker.choose_dp_rank
