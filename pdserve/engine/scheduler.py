"""The scheduler: continuous batching over the paged KV pool.

Each ``step()`` reads like the request lifecycle:
  1. disaggregation queues make progress (prefill: bootstrap/inflight; decode: prealloc/transfer);
  2. a batch is formed: every running request (decode rows first, then unfinished chunked
     prefills), then waiting requests within the prefill token budget (``max_prefill_tokens``
     per batch, ``chunked_prefill_size`` per request) and the KV budget; when pages run out the
     least-advanced request is retracted (recomputed later);
  3. the batch runs as plan -> forward -> draw -> commit (``step.py``: each row extends a prompt,
     samples a token or verifies drafts; ``commit.py``: drawn tokens appended and stop-checked;
     ``speculative/verify.py``), the speculator and the PD queues acting around the forward as
     ``StepParticipant``s, in that order;
  4. finished requests release their KV into the radix cache.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch

from pdserve.config import ServerArgs
from pdserve.distributed import SINGLE_RANK, Parallel
from pdserve.engine import admission, dp_attention, images
from pdserve.engine.commit import Committer, Drawn, not_finite, record_input_logprobs
from pdserve.engine.grammar_masks import GrammarMasks
from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.kv_pool import BufferAllocator, default_allocator
from pdserve.engine.kv_tier.tier import make_tier
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.pd_queues import PDQueues
from pdserve.engine.request import MAX_TOP_LOGPROBS, FinishKind, FinishReason, Req
from pdserve.engine.sampler import Sampler
from pdserve.engine.schedule_policy import order_waiting
from pdserve.engine.speculative import Speculator, page_riders
from pdserve.engine.speculative import refusal as speculative_refusal
from pdserve.engine.speculative.verify import row_tokens
from pdserve.engine.step import SAMPLE, VERIFY, Row, StepPlan
from pdserve.engine.step_participant import StepParticipant
from pdserve.engine.stop import eos_token_ids
from pdserve.kv_events import KVEventPublisher, offset_port
from pdserve.lora.control import request_adapter
from pdserve.lora_args import parse_lora_paths
from pdserve.routed_experts_args import refusal as routed_experts_refusal

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        args: ServerArgs,
        tokenizer=None,
        kv_allocator: BufferAllocator = default_allocator,
        par: Parallel = SINGLE_RANK,
    ):
        self.args = args
        self.par = par
        # the scheduler loop's clock: rank 0's reading, set every iteration so that every rank
        # takes time-based decisions (timeouts, arrival order) alike; None: the local clock
        self.clock: Optional[float] = None
        self.runner = ModelRunner(args, kv_allocator, par, page_riders=page_riders(args, par))
        if self.runner.lora is not None:
            for name, path in parse_lora_paths(args.lora_paths).items():
                self.runner.lora.load(name, path)
        self.page_size = args.page_size
        # every page of every cache group, and the prefix cache: requests' KV changes only there
        self.kv = KVCacheManager(
            self.runner.cache_groups,
            self.runner.pools,
            self.page_size,
            disable_radix_cache=args.disable_radix_cache,
            namespace=self.runner.model.prefix_namespace,
        )
        self.tree = self.kv.tree
        if self.runner.lora is not None:  # its events name the adapters' blocks
            self.tree.lora_names = self.runner.lora.names
        self.kv_events: Optional[KVEventPublisher] = None
        if args.kv_events_endpoint and par.leads_group:  # one publisher per attention group
            self.tree.events = []
            endpoints = (
                offset_port(e, par.dp_rank)
                for e in (args.kv_events_endpoint, args.kv_events_replay_endpoint)
            )
            self.kv_events = KVEventPublisher(
                *endpoints, args.kv_events_topic, par.dp_rank if par.dp_attention else None
            )
        # the tiers below the pool (--enable-hierarchical-cache), fed by the prefix tree
        self.tier = make_tier(args, self.kv, par)
        if tokenizer is None:
            from pdserve.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(args.tokenizer_path)
        self.tokenizer = tokenizer
        self.eos_ids = eos_token_ids(self.runner.hf_config, tokenizer, args.model_path)
        self.committer = Committer(self.eos_ids, tokenizer, self.runner.context_length)
        self.sampler = Sampler(
            self.runner.vocab_size, self.runner.device, self.eos_ids, seed=args.random_seed
        )
        self.context_length = self.runner.context_length
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.updated: set[Req] = set()  # requests with output not yet reported
        self.stats = {
            "prompt_tokens": 0,
            "generation_tokens": 0,
            "cache_hit_tokens": 0,
            "retractions": 0,
            "preemptions": 0,  # of them: for a waiting request of higher priority
            "shed": 0,  # requests refused or shed by the full queue (engine/admission.py)
            "recomputed": 0,  # of them: sequences that outgrew their KV (``KVCacheManager.stale``)
            # speculative decoding: rows verified, drafts proposed and accepted
            "spec_verify_steps": 0,
            "spec_draft_tokens": 0,
            "spec_accepted_tokens": 0,
            "spec_moved_rows": 0,  # tree rows whose kept drafts' KV moved to their positions
        }
        why = speculative_refusal(self.kv.policies, args.speculative_algorithm)
        if why:
            raise ValueError(why)
        self.speculator = (
            Speculator(args, self.runner, kv_allocator, par, port=self)
            if args.speculative_algorithm
            else None
        )
        # Disaggregation queues plug in here (pdserve.disagg.prefill / decode); they see this
        # scheduler through ``engine/pd_queues.SchedulerPort`` only.
        self.pd: Optional[PDQueues] = None
        # Requests whose image embeddings encoder servers compute wait in these first
        # (pdserve/multimodal/encoder_queue.py, attached by the server process: EPD)
        self.encoders: Any = None
        self._reported_early = False
        self.groups_busy = 0  # DP attention: the busiest group's level at the last step
        self.grammars = GrammarMasks(
            args.grammar_backend, tokenizer, self.runner.vocab_size, self.eos_ids
        )
        if self.speculator is not None:
            self.speculator.check_tokenizer(tokenizer)

    # ---- requests in and out -------------------------------------------------------------
    def validate(self, req: Req) -> None:
        n = req.prompt_len
        if n == 0:
            raise ValueError("prompt: must not be empty")
        if n >= self.context_length:
            raise ValueError(
                f"prompt: {n} tokens is too long; the context length is {self.context_length} "
                f"(prompt plus at least one generated token)"
            )
        bad = [t for t in req.input_ids if not 0 <= t < self.runner.vocab_size]
        if bad:
            raise ValueError(
                f"input_ids: token id {bad[0]} outside the vocabulary [0, {self.runner.vocab_size})"
            )
        why = self.kv.capacity_error(n, self.args.chunked_prefill_size)
        if why:
            raise ValueError(
                f"prompt: {n} tokens exceed the KV cache capacity ({self.runner.max_total_tokens} "
                f"tokens): {why}"
            )
        if not 0 <= req.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs_num: must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs_num}"
            )
        if req.logprob_start_len >= n:
            raise ValueError(
                f"logprob_start_len: must be < prompt length {n}, got {req.logprob_start_len}"
            )
        if req.return_routed_experts:
            why = routed_experts_refusal(
                self.args, self.runner.routed_spec, req.routed_experts_start_len, n
            )
            if why:
                raise ValueError(why)

    def add_request(self, req: Req) -> None:
        self.validate(req)
        if req.lora_name is not None:
            req.lora_slot, req.lora_key = request_adapter(self.runner.lora, req.lora_name)
        images.prepare(
            req,
            self.runner.model,
            computes_prompts=self.args.disaggregation_mode != "decode",
            encoders=self.encoders is not None,
        )
        if req.grammar_spec is not None:
            req.grammar = self.grammars.for_request(req.grammar_spec, req.grammar_start_after)
        req.sampling.max_new_tokens = min(
            req.sampling.max_new_tokens, self.context_length - req.prompt_len
        )
        req.arrival_time = req.arrival_time or self.now()
        try:
            shed = admission.make_room(req, self.queued(), self.sheddable(), self.args)
        except admission.QueueFull:
            self.stats["shed"] += 1  # demand the queue could not hold (router/autoscale.py)
            raise
        if shed is not None:
            self.stats["shed"] += 1
            self.finish(shed, admission.shed_reason())
        if self.encoders is not None and self.encoders.accepts(req):
            self.encoders.add(req)
        else:
            self._enqueue(req)

    def _enqueue(self, req: Req) -> None:
        if self.pd is not None and self.pd.accepts(req):
            self.pd.add(req)
        else:
            self.waiting.append(req)

    def _take_encoded(self) -> None:
        """Requests whose images the encoders computed go on; those that failed end."""
        ready, failed = self.encoders.poll()
        for req in ready:
            self._enqueue(req)
        for req, why in failed:
            self.finish(req, why)

    def queued(self) -> list[Req]:
        """Requests that arrived and wait to run (``engine/admission.py``)."""
        held = self.encoders.queued() if self.encoders is not None else []
        return self.waiting + (self.pd.queued() if self.pd is not None else []) + held

    def sheddable(self) -> list[Req]:
        """Queued requests that have not started: nothing computed, nothing sent."""
        return [
            r
            for r in self.waiting
            if r.kv is None and not r.output_ids and not r.num_retractions and not r.resumed
        ]

    def publish_kv_events(self) -> None:
        """Send what the radix cache and the tiers below it stored and evicted since the last
        call (one batch)."""
        below = self.tier.poll() if self.tier is not None else []
        if self.kv_events is not None and (self.tree.events or below):
            events, self.tree.events = self.tree.events + below, []
            self.kv_events.publish(events)

    def now(self) -> float:
        return self.clock if self.clock is not None else time.monotonic()

    # ---- what the PD queues may do (engine/pd_queues.SchedulerPort) ----------------------------
    def num_running(self) -> int:
        return len(self.running)

    def scheduled(self) -> list[Req]:
        return self.waiting + self.running

    def enqueue(self, req: Req) -> None:
        self.waiting.append(req)

    def start_decoding(self, req: Req, failure: Optional[FinishReason] = None) -> None:
        self.stats["prompt_tokens"] += req.prompt_len
        self.stats["generation_tokens"] += len(req.output_ids)
        self.running.append(req)
        self.updated.add(req)
        if self.speculator is not None and req.kv is not None:
            self.speculator.started(req, transferred=True)
        reason = failure or self.committer.finish_reason(req)
        if reason is not None:
            self.finish(req, reason)

    def hand_off(self, req: Req) -> None:
        self.running.remove(req)

    def resume(self, req: Req) -> None:
        self.running.append(req)

    def count(self, stat: str, n: int) -> None:
        self.stats[stat] += n

    def abort(self, rid: str, message: str = "aborted by client", status_code: int = 499) -> bool:
        """Abort one request (or every request when rid == ""); frees its KV at once."""
        hit = False
        for req in (
            list(self.waiting)
            + list(self.running)
            + (self.pd.all_reqs() if self.pd else [])
            + (self.encoders.queued() if self.encoders is not None else [])
        ):
            if rid and req.rid != rid:
                continue
            hit = True
            self.finish(
                req, FinishReason(FinishKind.ABORT, message=message, status_code=status_code)
            )
        return hit

    def finish(self, req: Req, reason: FinishReason) -> None:
        """End a request wherever it is and release everything it holds."""
        if req.finished:
            return
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if self.pd is not None:
            self.pd.discard(req)
        if self.encoders is not None:
            self.encoders.drop(req)
        self._collect_routed_experts(req)
        self.release_kv(req)
        self.updated.add(req)

    def _collect_routed_experts(self, req: Req) -> None:
        """A finishing request that asked gets the ids of every token it ran, read from its pages
        before they go (a prefill server leaves that to decode's answer)."""
        store = self.runner.routed
        if (
            req.return_routed_experts
            and store is not None
            and req.kv is not None
            and req.finish_reason.kind != FinishKind.ABORT
            and self.args.disaggregation_mode != "prefill"
        ):
            req.routed_experts = store.collect(req)

    def drain(self) -> list[Req]:
        """Requests with new output since the last call (finished ones included, once)."""
        out = list(self.updated)
        self.updated.clear()
        return out

    @property
    def has_work(self) -> bool:
        return bool(
            self.waiting
            or self.running
            or (self.pd is not None and self.pd.has_work)
            or (self.encoders is not None and self.encoders.has_work)
        )

    # ---- KV bookkeeping (the cache manager's; the PD queues add what they hold) ---------------
    def reset_kv(self, kv_allocator: BufferAllocator) -> None:
        """Empty pools of the same sizes from ``kv_allocator`` and an empty prefix cache (a role
        switch, while nothing runs; KV event subscribers see the cache cleared)."""
        assert not self.has_work, "reset_kv while requests are held"
        events = self.tree.events
        self.tree.reset()
        self.kv = self.tree = None  # the old pools' last references (see reallocate_kv)
        self.runner.reallocate_kv(kv_allocator)
        self.kv = KVCacheManager(
            self.runner.cache_groups,
            self.runner.pools,
            self.page_size,
            disable_radix_cache=self.args.disable_radix_cache,
            namespace=self.runner.model.prefix_namespace,
        )
        self.tree = self.kv.tree
        self.tree.events = events
        if self.tier is not None:
            self.tier.attach(self.kv)

    def flush_cache(self, tiers: bool = True) -> bool:
        """Empty the prefix cache and (``tiers``) every tier below it; False (nothing changed)
        while a request holds cached pages."""
        if not self.tree.reset():
            return False
        if tiers and self.tier is not None:
            self.tier.clear()
        return True

    def release_kv(self, req: Req) -> None:
        self.kv.release(req)

    def in_use_pages(self) -> list[int]:
        """Pages per cache group held by requests (and the PD queues), not the prefix cache."""
        used = self.kv.in_use(self.running + (self.pd.all_reqs() if self.pd else []))
        extra = self.pd.extra_pages() if self.pd else [0] * len(used)
        return [u + e for u, e in zip(used, extra)]

    def check_integrity(self) -> dict:
        info = self.kv.check_integrity(self.in_use_pages())
        info.update(running=len(self.running), waiting=len(self.waiting))
        if self.pd is not None:
            info.update(self.pd.integrity())
        if self.encoders is not None:
            info.update(self.encoders.integrity())
        return info

    def retract(self, req: Req) -> None:
        """Preempt a running request: drop its KV (full pages stay cached) and requeue it; it is
        computed again (prompt and output) when admitted."""
        self.running.remove(req)
        self.release_kv(req)
        # it computes its sequence again, no speculative row
        req.drafts, req.draft_parents = [], None
        if not req.input_logprobs_done:
            del req.input_token_logprobs[1 if req.effective_logprob_start == 0 else 0 :]
            del req.input_top_logprobs[
                1 if req.effective_logprob_start == 0 and req.top_logprobs_num else 0 :
            ]
        req.num_retractions += 1
        self.stats["retractions"] += 1
        self.waiting.insert(0, req)
        logger.debug("retracted %s (%d output tokens)", req.rid, len(req.output_ids))

    # ---- one iteration ----------------------------------------------------------------------
    def step(self) -> list[Req]:
        if self.encoders is not None and self.encoders.has_work:
            self._take_encoded()
        if self.pd is not None:
            self.pd.process_queues()
            if self.updated and not self._reported_early:
                # First tokens committed from transferred KV go out now, not after a forward:
                # otherwise PD's time to first token would include one decode step.
                self._reported_early = True
                if self.par.dp_attention:
                    self._dp_round([])
                return self.drain()
        self._reported_early = False
        batch = self._schedule()
        if self.par.dp_attention:
            self._dp_round(batch)
        elif batch:
            self._run(batch)
        return self.drain()

    def _dp_round(self, batch: list[tuple[Req, int]]) -> None:
        """DP attention, once per step on every rank: when any group has tokens, every group
        runs a forward (an idle one without tokens of its own) so the MLPs' collectives meet."""
        busy = 2 if self.waiting or self.running else int(self.has_work)  # see sync_counts
        counts, self.groups_busy = dp_attention.sync_counts(
            self.par, sum(e for _, e in batch), busy
        )
        if batch:
            self._run(batch, counts)
        elif any(counts):
            self.runner.idle_forward(counts)

    def _schedule(self) -> list[tuple[Req, int]]:
        budget = self.args.max_prefill_tokens  # prefill tokens in this batch
        chunk = self.args.chunked_prefill_size  # prefill tokens of one request in one batch
        self._preempt_for_priority()
        # 1. decode rows
        decoding = sorted(
            (r for r in self.running if r.extend_len == 1), key=lambda r: r.arrival_time
        )
        batch = self._decode_rows(decoding)
        # 2. unfinished chunked prefills continue within the token budget
        for req in self.running:
            if req.extend_len > 1 and budget > 0:
                ext = min(req.extend_len, chunk, budget)
                if not self.kv.grow(req, ext):
                    continue
                batch.append((req, ext))
                budget -= ext
        # 3. admit waiting requests
        reserve = len(decoding)  # keep one page per decoding request for its next token
        if self.waiting and budget > 0:
            order_waiting(
                self.waiting, self.args.schedule_policy, self.kv, admission.rank_key(self.args)
            )
        while self.waiting and budget > 0 and len(self.running) < self.args.max_running_requests:
            req = self.waiting[0]
            if not self._admit(req, min(chunk, budget), reserve):
                break
            self.running.append(self.waiting.pop(0))
            req.mark("forward_start")
            ext = min(req.extend_len, chunk, budget)
            batch.append((req, ext))
            budget -= ext
        return batch

    def _preempt_for_priority(self) -> None:
        """Every running place taken: the waiting request of highest priority may take the place
        of a running one of far lower priority (``engine/admission.py``). Not on a prefill
        server, whose running requests are sending their KV."""
        key = admission.rank_key(self.args)
        if (
            key is None
            or not self.waiting
            or len(self.running) < self.args.max_running_requests
            or self.args.disaggregation_mode == "prefill"
        ):
            return
        head = min(self.waiting, key=lambda r: (key(r), r.arrival_time))
        victim = admission.preemptee(head, self.running, self.args)
        if victim is not None:
            self.retract(victim)
            self.stats["preemptions"] += 1

    def _decode_rows(self, decoding: list[Req]) -> list[tuple[Req, int]]:
        """The decode rows of this step, one per running request whose prompt is done, in order
        of arrival: (request, its tokens to compute). A request whose KV went stale is recomputed
        instead; when pages run out, the least advanced request is retracted. The one place a
        decode row is made (a speculative row would be its token and the drafts)."""
        rows: list[tuple[Req, int]] = []
        for req in decoding:
            if req not in self.running:
                continue  # retracted below to make room for an earlier one
            if self.kv.stale(req):
                # its sequence outgrew what its KV was computed for (LongRoPE past the original
                # context): computed again from the start, as HF does
                self.retract(req)
                self.stats["recomputed"] += 1
                continue
            want = self._drafts_wanted(req)
            if want and not self.kv.grow(req, 1 + self.speculator.room(want)):
                want = 0  # no room for them: one token, as without speculation
            grown = self.kv.grow(req, 1)
            while not grown:
                scheduled = {r for r, _ in rows}
                victim = min(
                    (r for r in self.running if r not in scheduled),
                    key=lambda r: (len(r.output_ids), -r.arrival_time),
                )
                self.retract(victim)
                if victim is req:
                    break
                grown = self.kv.grow(req, 1)
            if grown:
                rows.append((req, 1 + want))
        if self.speculator is not None:  # the drafts, for every row at once (a draft model's batch)
            self.speculator.propose([(r, ext - 1) for r, ext in rows if ext > 1])
            rows = [(r, 1 + len(r.drafts)) for r, _ in rows]
        return rows

    def _drafts_wanted(self, req: Req) -> int:
        """How many speculative drafts ``req``'s next row asks for, within its token budget, its
        context and the prefix-cache namespace of its length (the row is computed for one
        sequence length)."""
        if self.speculator is None:
            return 0
        limit = min(
            req.sampling.max_new_tokens - len(req.output_ids) - 1,
            self.context_length - req.seq_len - 1,
        )
        namespace = self.kv.namespace(req.seq_len)
        while limit > 0 and self.kv.namespace(req.seq_len + limit) != namespace:
            limit -= 1
        return self.speculator.wanted(req, limit)

    def _admit(self, req: Req, budget: int, reserve: int) -> bool:
        ids = req.all_ids
        max_pages = (len(ids) - 1) // self.page_size
        if req.return_logprob and not req.input_logprobs_done:
            # input logprobs need the logits from position start - 1 on: do not skip them
            max_pages = min(max_pages, max(req.effective_logprob_start - 1, 0) // self.page_size)
        if not self.kv.admit(req, budget, reserve, max_pages):
            return False
        why = images.unavailable(req, self.runner.model)
        if why is not None:  # a preempted request this server cannot compute again
            self.finish(req, FinishReason(FinishKind.ABORT, message=why, status_code=503))
            return False
        if self.speculator is not None:
            self.speculator.started(req)
        if req.num_retractions == 0:
            req.cached_tokens = req.kv_len
            if req.return_logprob and req.effective_logprob_start == 0:
                req.input_token_logprobs.append((None, req.input_ids[0]))
                if req.top_logprobs_num:
                    req.input_top_logprobs.append(None)
            self.stats["cache_hit_tokens"] += req.kv_len
            self.stats["prompt_tokens"] += req.prompt_len
        return True

    @property
    def participants(self) -> list[StepParticipant]:
        """What acts around each forward (``engine/step_participant.py``), in this order: the
        speculator, then the PD queues."""
        return [p for p in (self.speculator, self.pd) if p is not None]

    def _run(self, batch: list[tuple[Req, int]], dp_counts: Optional[list[int]] = None) -> None:
        """One forward of ``batch`` and what follows it: plan -> forward -> draw -> commit."""
        plan = StepPlan.build(batch)
        fb = plan.forward_batch(self.runner, dp_counts)
        participants = self.participants
        for p in participants:
            p.before_forward(plan, fb)
        sampled, verified = plan.of_kind(SAMPLE), plan.of_kind(VERIFY)
        # the grammar masks are filled on a worker thread while the forward runs
        masks = self.grammars.start([r.req for r in sampled if r.req.sampling.max_new_tokens > 0])
        verify_masks = self.grammars.start(*row_tokens(verified)) if verified else None
        logits = self.runner.forward(fb)
        for row in plan.rows:  # a verify row's drafts count once accepted
            row.req.kv_len += 1 if row.kind == VERIFY else row.ext
        for p in participants:
            p.after_forward(plan)
        record_input_logprobs(logits, plan.spans)
        firsts = self._sample(logits, sampled, None if masks is None else masks.result())
        self._verify(logits, verified, None if verify_masks is None else verify_masks.result())
        for p in participants:
            p.after_commit(plan)
        for req, reason in firsts:  # a prompt is done: a participant may take the request over
            if not any(p.takes_over(req) for p in participants) and reason is not None:
                self.finish(req, reason)

    def _commit(
        self, req: Req, drawn: list[Drawn], kv_base: Optional[int] = None
    ) -> Optional[FinishReason]:
        before = len(req.output_ids)
        reason = self.committer.commit(req, drawn, kv_base)
        self.stats["generation_tokens"] += len(req.output_ids) - before
        self.updated.add(req)
        return reason

    def _sample(self, logits: torch.Tensor, rows: list[Row], grammar=None) -> list:
        """Draw the next token of each SAMPLE row and commit it; returns (request, finish reason
        or None) of the requests whose first token this was, which ``_run`` offers to the
        participants once the step is done; the others' reasons apply at once."""
        for row in rows:
            row.req.input_logprobs_done = True
            if row.req.sampling.max_new_tokens == 0:
                self.finish(row.req, FinishReason(FinishKind.LENGTH, matched=0))
        todo = [row for row in rows if row.req.sampling.max_new_tokens > 0]
        if not todo:
            return []
        at = torch.tensor([row.logits_at for row in todo], device=logits.device)
        out = self.sampler.sample(logits[at], [row.req for row in todo], grammar)
        failed = set(out.failed)
        firsts = []
        for k, row in enumerate(todo):
            req = row.req
            if k in failed:
                self.finish(req, not_finite())
                continue
            reason = self._commit(
                req, [Drawn(out.next_ids[k], out.logprobs[k], out.top_logprobs[k])]
            )
            if len(req.output_ids) == 1 and req.num_retractions == 0:
                firsts.append((req, reason))
            elif reason is not None:
                self.finish(req, reason)
        return firsts

    def _verify(self, logits: torch.Tensor, rows: list[Row], grammar=None) -> None:
        """Speculative rows: the speculator's verdicts (``speculative/verify.py``), each row's
        kept tokens committed one by one with ``kv_len`` following them."""
        if not rows:
            return
        for v in self.speculator.verify(self.sampler, logits, rows, grammar):
            req = v.req
            if v.failed:
                self.finish(req, not_finite())
                continue
            req.spec_verify_ct += 1
            req.spec_accepted += v.accepted
            self.stats["spec_verify_steps"] += 1
            self.stats["spec_draft_tokens"] += v.drafted
            self.stats["spec_accepted_tokens"] += v.accepted
            self.stats["spec_moved_rows"] += v.moved
            reason = self._commit(req, v.tokens, kv_base=req.kv_len)
            if reason is not None:
                self.finish(req, reason)
