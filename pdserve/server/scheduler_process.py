"""The scheduler process of one tensor-parallel rank: receives requests over ZMQ, steps the
scheduler, streams outputs back.

Contract with the front end: rank 0 BINDs a PULL socket on ``in_addr`` and CONNECTs a PUSH socket
to ``out_addr`` (bound by the front end first); every rank reports once on its ``ready_conn``:
``{"status": "ready", "info": {...}}`` or ``{"status": "error", "message": ...}``; a rank of a
multi-host server that loses a peer says ``{"status": "lost", "message": ...}`` there before it
exits.

With ``--tp-size N`` (times ``--pp-size``) the ranks take the same decisions from the same
inputs: every loop iteration rank 0 drains the front end's messages and broadcasts them (msgpack
bytes over the gloo group) with its clock reading; every rank handles them and steps its
scheduler on that clock. Rank 0 receives from the front end and answers control calls. With DP
attention each group's scheduler takes the requests the front end addressed to it
(``routed_dp_rank``) and ignores the others, and the first rank of each group sends that group's
outputs (every group leader connects a PUSH to the front end's PULL). A rank that dies makes the
others' next collective fail (or time out): they exit, and the front end, which watches every
rank, stops serving. With ``--nnodes`` the ranks also exchange their start-up outcome (every
rank ready or none serves) and watch each other's heartbeats, which name a lost node
(``nodes.py``, ``heartbeat.py``).
"""

from __future__ import annotations

import copy
import logging
import os
import signal
import time
import traceback

import msgspec
import torch
import zmq

from pdserve.config import ServerArgs
from pdserve.distributed import SINGLE_RANK, Parallel, init_parallel
from pdserve.engine.request import FinishKind, FinishReason, Req
from pdserve.kv_spec import DTYPE_BYTES, state_bytes_per_request, transfer_bytes_per_token
from pdserve.lifetime import end_with_parent
from pdserve.log import role_tag, setup_logging
from pdserve.lora import control as lora_control
from pdserve.models.loader import weights_digest
from pdserve.server import messages as m
from pdserve.server.heartbeat import Heartbeat, first_line
from pdserve.server.nodes import (
    NodeLayout,
    choose_gloo_interface,
    gather_start_up,
    join_error,
    zmq_ipv6,
)

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 50  # a message wakes the poll at once: this only bounds idle wake-ups
# ... of several ranks, where every wake-up is a collective on each of them (an idle two-rank
# server's ranks took 3.5% of a core each at 50 ms)
IDLE_POLL_MS_RANKS = 250
# While the only work is waiting on peers (PD bootstrap, transfers), poll at this period rather
# than spinning: a spinning scheduler would take a core from the servers that compute.
PEER_WAIT_POLL_MS = 1


def build_scheduler(args: ServerArgs, par: Parallel = SINGLE_RANK):
    from pdserve.engine.scheduler import Scheduler

    if args.disaggregation_mode == "null":
        scheduler = Scheduler(args, par=par)
    else:
        from pdserve.disagg.setup import attach_disaggregation

        scheduler = attach_disaggregation(args, par=par)
    model = scheduler.runner.model
    if (
        hasattr(model, "encode_image")
        and args.disaggregation_mode != "decode"
        and par.world.size == 1  # the ranks of a TP prefill would have to agree when each is ready
    ):
        from pdserve.multimodal.encoder_queue import EncoderQueue

        # EPD: images whose embeddings encoder servers send
        scheduler.encoders = EncoderQueue(args, model.image_width, scheduler.runner.dtype)
    return scheduler


def token_out(req: Req) -> m.TokenOut:
    start = req.sent_output_len
    req.sent_output_len = len(req.output_ids)
    out = m.TokenOut(
        rid=req.rid,
        new_ids=req.output_ids[start:],
        finish_reason=req.finish_reason.to_json() if req.finished else None,
        prompt_tokens=req.prompt_len,
        cached_tokens=req.cached_tokens,
        spec_verify_ct=req.spec_verify_ct,
        spec_accepted=req.spec_accepted,
        timeline=req.timeline if req.finished else None,
        routed_experts=req.routed_experts if req.finished else None,
    )
    if req.return_logprob:
        out.output_token_logprobs = req.output_token_logprobs[start:]
        out.output_top_logprobs = req.output_top_logprobs[start:]
        if not req.sent_input_logprobs and (req.input_logprobs_done or req.finished):
            out.input_token_logprobs = req.input_token_logprobs
            out.input_top_logprobs = req.input_top_logprobs
            req.sent_input_logprobs = True
    return out


def kv_bytes_per_token(runner) -> int:
    """Cache bytes of the whole model for one prompt token, each byte counted once
    (``kv_spec.transfer_bytes_per_token``; a pipeline stage scales its own layers to the
    model's)."""
    item = DTYPE_BYTES[str(runner.kv_dtype).replace("torch.", "")]
    model = runner.model
    per_token = transfer_bytes_per_token(runner.cache_groups, model.total_kv_heads, item)
    quant = getattr(runner, "kv_quant", None)
    if quant is not None and quant.per_token:  # int8: a float32 scale per K/V row as well
        head_dim = runner.cache_groups[runner.anchor].spec.head_dim
        per_token += (
            transfer_bytes_per_token(runner.cache_groups, model.total_kv_heads, 4) // head_dim
        )
    return per_token * model.total_layers // max(model.num_layers, 1)


def kv_bytes_per_request(runner) -> int:
    """The whole model's fixed-size per-request state (linear-attention layers), each byte once;
    a pipeline stage scales its own layers to the model's."""
    model = runner.model
    own = state_bytes_per_request(runner.cache_groups)
    return own * model.total_layers // max(model.num_layers, 1)


class SchedulerLoop:
    def __init__(self, args: ServerArgs, in_addr: str, out_addr: str, par: Parallel = SINGLE_RANK):
        self.args = args
        self.par = par
        self.world = par.world
        self.idle_poll_ms = IDLE_POLL_MS if self.world.size == 1 else IDLE_POLL_MS_RANKS
        self.started_args = copy.copy(args)  # as given: a role switch applies its rules to these
        t0 = time.monotonic()
        self.scheduler = build_scheduler(args, par)
        self.start_s = (
            time.monotonic() - t0
        )  # model load, packing, pools (a role switch keeps the model)
        self.ctx = zmq.Context()
        self.pull = self.push = None
        self.poller = zmq.Poller()
        if self.world.rank == 0:  # the rank that receives from the front end
            self.pull = self.ctx.socket(zmq.PULL)
            self.pull.bind(in_addr)
            self.poller.register(self.pull, zmq.POLLIN)
        if par.leads_group:  # the ranks that send outputs: one per attention group, on any node
            self.push = self.ctx.socket(zmq.PUSH)
            self.push.setsockopt(zmq.IPV6, int(zmq_ipv6(out_addr)))
            self.push.connect(out_addr)

    def info(self) -> dict:
        s = self.scheduler
        r = s.runner
        return {
            "context_length": s.context_length,
            "vocab_size": r.vocab_size,
            "takes_images": hasattr(r.model, "encode_image"),
            "max_total_tokens": r.max_total_tokens,
            "page_size": s.page_size,
            "num_pages": r.pool.num_pages,
            "cache_groups": [
                {**g.describe(), "num_pages": p.num_pages} for g, p in zip(r.cache_groups, r.pools)
            ],
            "model_fingerprint": r.fingerprint,
            "eos_token_ids": sorted(s.eos_ids),
            "max_running_requests": self.args.max_running_requests,
            "dp_size": self.par.dp_size,
            # the whole model's KV per prompt token that a PD transfer moves (windowed layers move
            # a bounded amount and are left out when the model has full-attention layers)
            "kv_bytes_per_token": kv_bytes_per_token(r),
            # ... and per request whatever its length (a recurrent state: linear-attention layers)
            "kv_bytes_per_request": kv_bytes_per_request(r),
            # --enable-return-routed-experts on a MoE model: the layout of the returned ids
            "routed_experts": r.routed_spec.describe() if r.routed_spec is not None else None,
            "disaggregation_mode": self.args.disaggregation_mode,
            "scheduler_start_s": round(self.start_s, 3),
            "weights": weights_digest(
                r.model
            ),  # where the weights live (unchanged by a role switch)
        }

    def run(self) -> None:
        while True:
            s = self.scheduler
            # with DP attention rank 0 must not hold back the other groups' steps
            if s.waiting or s.running or s.groups_busy == 2:
                timeout = 0
            else:
                timeout = PEER_WAIT_POLL_MS if s.has_work or s.groups_busy else self.idle_poll_ms
            for raw in self._inputs(timeout):
                self.handle(m.decode_to_scheduler(raw))
            # DP attention: every group steps every iteration (the groups' forwards meet in the MLP)
            stepping = self.scheduler.has_work or self.par.dp_attention
            updated = self.scheduler.step() if stepping else self.scheduler.drain()
            self.scheduler.publish_kv_events()
            if updated and self.push is not None:
                self.push.send(m.encode(m.BatchOut(outs=[token_out(r) for r in updated])))

    def _inputs(self, timeout_ms: int) -> list[bytes]:
        """This iteration's messages from the front end, the same on every rank; sets the
        scheduler's clock to rank 0's."""
        raws: list[bytes] = []
        if self.pull is not None:
            while dict(self.poller.poll(timeout_ms)).get(self.pull):
                raws.append(self.pull.recv())
                timeout_ms = 0
        now = time.monotonic()
        if self.world.size > 1:
            data = self.world.broadcast_bytes(
                msgspec.msgpack.encode([now, raws]) if self.world.rank == 0 else None
            )
            now, raws = msgspec.msgpack.decode(data)
        self.scheduler.clock = now
        return raws

    def reply(self, msg) -> None:
        if self.push is not None:
            self.push.send(m.encode(msg))

    def reply_control(self, msg) -> None:
        if self.world.rank == 0:
            self.push.send(m.encode(msg))

    def handle(self, msg) -> None:
        s = self.scheduler
        if isinstance(msg, m.GenerateReq):
            if self.par.dp_attention and (msg.pd.routed_dp_rank or 0) != self.par.dp_rank:
                return  # another attention group's request
            try:
                req = Req.from_spec(msg)
                req.mark("queued")
                s.add_request(req)
            except ValueError as e:
                status = getattr(e, "status_code", 400)  # 429: the queue is full (admission)
                reason = FinishReason(FinishKind.ABORT, message=str(e), status_code=status)
                pd = msg.pd
                if s.pd is not None and pd.bootstrap_room is not None:  # the peer must not wait
                    try:
                        s.pd.reject(
                            pd.bootstrap_host, pd.bootstrap_port, pd.bootstrap_room, f"refused: {e}"
                        )
                    except Exception:  # best effort: the peer's own timeout still ends the room
                        logger.exception("could not end room %s on the PD peer", pd.bootstrap_room)
                self.reply(
                    m.BatchOut(
                        outs=[m.TokenOut(rid=msg.rid, new_ids=[], finish_reason=reason.to_json())]
                    )
                )
        elif isinstance(msg, m.AbortReq):
            s.abort(msg.rid, msg.message, msg.status_code)
        elif isinstance(msg, m.ControlReq):
            try:
                result = self.control(msg.op, msg.args)
                resp = m.ControlResp(req_id=msg.req_id, ok=True, result=result)
            except Exception as e:  # reported to the caller, the loop goes on
                resp = m.ControlResp(req_id=msg.req_id, ok=False, error=f"{type(e).__name__}: {e}")
            self.reply_control(resp)

    def gather_groups(self, info: dict) -> list[dict]:
        """Every attention group's ``info`` (its first rank's), in group order: a collective, so
        every rank must call it for the same control call."""
        if not self.par.dp_attention:
            return [info]
        per = [
            msgspec.json.decode(b) for b in self.world.all_gather_bytes(msgspec.json.encode(info))
        ]
        return per[:: self.par.attn.size][: self.par.dp_size]

    def control(self, op: str, args: dict):
        s = self.scheduler
        if op == "migrate_out":  # POST /migrate (disagg/migration.py)
            from pdserve.disagg.migration import migrate_control

            return migrate_control(self, args)
        if op in ("load_lora", "unload_lora", "list_lora"):  # POST /v1/load_lora_adapter, ...
            return lora_control.control(s, op, args)
        if op == "get_load":
            running = s.running + (s.pd.all_reqs() if s.pd else [])
            groups = self.gather_groups(
                {
                    "dp_rank": self.par.dp_rank,
                    "num_reqs": len(running) + len(s.waiting),
                    "num_waiting_reqs": len(s.waiting)
                    + getattr(s.pd, "kv_ready", 0),  # decode: KV here, no batch slot
                    "num_tokens": sum(r.seq_len for r in running),
                    "num_shed_reqs": s.stats["shed"],  # since start: demand refused (429)
                    **(
                        {"kv_transfer_bytes_per_s": s.pd.transfer_rate}
                        if getattr(s.pd, "transfer_rate", None)
                        else {}
                    ),
                    **(s.pd.queues() if s.pd else {}),
                }
            )
            counts = (
                "num_reqs",
                "num_waiting_reqs",
                "num_tokens",
                "num_shed_reqs",
                *(s.pd.queues() if s.pd else ()),
            )
            total = {k: sum(g[k] for g in groups) for k in counts}
            if self.par.dp_attention:
                return {**total, "dp": groups}
            return {**groups[0], **total}
        if op == "flush_cache":
            return s.flush_cache(tiers=(args or {}).get("tiers", True))
        if (
            op == "kv_events_snapshot"
        ):  # the cache's content, and the seq of the last batch it includes
            s.publish_kv_events()
            groups = self.gather_groups(
                {
                    "dp_rank": self.par.dp_rank,
                    "seq": s.kv_events.seq - 1 if s.kv_events else None,
                    "events": [
                        {
                            "type": "BlockStored",
                            "block_hashes": e.block_hashes,
                            "parent_block_hash": e.parent_block_hash,
                            "token_ids": e.token_ids,
                            **({"medium": e.medium} if e.medium else {}),
                            **({"lora_name": e.lora_name} if e.lora_name else {}),
                        }
                        for e in s.tree.stored_events()
                        + (s.tier.snapshot() if s.tier is not None else [])
                    ]
                    if s.kv_events
                    else [],
                }
            )
            return {"block_size": s.page_size, "groups": groups}
        if op == "integrity":
            if self.world.size == 1:
                return s.check_integrity()
            # every rank's own accounting (each has its pool and slots); a failed check must still
            # reach the collective, or the other ranks would wait for it
            try:
                info = s.check_integrity()
            except Exception as e:
                info = {"error": f"{type(e).__name__}: {e}"}
            ranks = [
                msgspec.json.decode(b)
                for b in self.world.all_gather_bytes(msgspec.json.encode(info))
            ]
            bad = [f"rank {i}: {r['error']}" for i, r in enumerate(ranks) if "error" in r]
            if bad:
                raise AssertionError("; ".join(bad))
            return {**info, "ranks": ranks}
        if op == "stats":
            a = s.runner.pool.allocator
            groups = self.gather_groups(
                {
                    "running": len(s.running),
                    "waiting": len(s.waiting),
                    "kv_pages_total": a.capacity,
                    "kv_pages_free": a.num_free(),
                    "kv_pages_used": a.capacity - a.num_free(),
                    "kv_pages_cached": s.tree.total_pages(),
                    "kv_pages_evictable": s.tree.evictable_pages(),
                    **s.stats,
                    **(s.pd.stats() if s.pd is not None else {}),
                    **(s.tier.counters() if s.tier is not None else {}),
                    "grammar_cache": s.grammars.cache_info(),
                    **({"lora": lora_control.stats(s)} if s.runner.lora is not None else {}),
                }
            )
            if len(groups) == 1:
                return groups[0]
            total = {
                k: sum(g[k] for g in groups)
                for k in groups[0]
                if isinstance(groups[0][k], (int, float))
            }
            return {**total, "dp": groups}
        if op == "expert_distribution":  # the MoE expert load recorder (server/expert_api.py)
            from pdserve.server.expert_api import scheduler_control

            return scheduler_control(self, args)
        if (
            op == "switch_role"
        ):  # POST /switch_role (server/role_switch.py); every rank re-wires itself
            from pdserve.disagg.setup import switch_role_control

            return switch_role_control(self, args)
        raise ValueError(f"unknown control op {op!r}")


def _exit_after(cleanup) -> None:
    """SIGTERM's exit, after ``cleanup`` (bounded by the front end's grace period)."""
    try:
        cleanup()
    finally:
        os._exit(0)


def _exit_lost(ready_conn, verdict: str) -> None:
    """A peer rank or node is gone (heartbeat verdict): this rank cannot go on alone. Its last
    word on ``ready_conn`` gives the front end the reason for the requests it fails."""
    logger.error("%s; this rank exits (the server is down)", verdict)
    try:
        ready_conn.send({"status": "lost", "message": verdict})
    except Exception:  # the front end may be gone too
        pass
    os._exit(1)


def run_scheduler_process(
    args: ServerArgs, in_addr: str, out_addr: str, ready_conn, tp_rank: int = 0, tp_init: str = ""
) -> None:
    setup_logging(role_tag(args.role, tp_rank), args.log_level)
    layout = NodeLayout.from_args(args)
    torch.set_num_threads(
        args.torch_num_threads or max(1, (os.cpu_count() or 1) // layout.ranks_per_node)
    )
    end_with_parent(os.getppid())  # a front end that dies however it dies takes its ranks along
    par, heartbeat = None, None
    try:
        choose_gloo_interface(layout)
        try:
            par = init_parallel(
                tp_rank,
                args.tp_size,
                tp_init,
                args.device,
                dp_size=args.dp_size,
                pp_size=args.pp_size,
                timeout_s=args.dist_timeout,
            )
        except Exception as e:
            raise RuntimeError(join_error(layout, args.dist_timeout, e)) if layout.multi_node else e
        if layout.multi_node:
            heartbeat = Heartbeat(
                layout, tp_rank, args.dist_timeout, on_lost=lambda v: _exit_lost(ready_conn, v)
            )
        loop = SchedulerLoop(args, in_addr, out_addr, par)
        status = {"status": "ready", "info": loop.info()}
    except Exception as e:
        if isinstance(
            e, ValueError
        ):  # a refusal of the configuration or the host: its message says it all
            logger.error("scheduler failed to start: %s", e)
            logger.debug("where: %s", traceback.format_exc())
        else:
            logger.error("scheduler failed to start: %s\n%s", e, traceback.format_exc())
        status = {"status": "error", "message": f"{type(e).__name__}: {e}"}
    if par is not None and layout.multi_node:  # every rank on every node ready, or none serves
        status = gather_start_up(par.world, layout, status)
    ready_conn.send(status)
    if status["status"] != "ready":
        return
    if heartbeat is not None:
        heartbeat.start()
        logger.info(
            "%s ready; heartbeats every %gs, a peer silent for %gs is lost",
            layout.describe(),
            heartbeat.interval,
            heartbeat.lost_after,
        )
    if loop.scheduler.tier is not None:  # a stop first finishes the tiers' queued disk writes
        signal.signal(signal.SIGTERM, lambda *_: _exit_after(loop.scheduler.tier.close))
    try:
        loop.run()
    except KeyboardInterrupt:
        pass
    except Exception as e:
        # a crash, or a collective that failed because another rank died: the whole server goes
        verdict = (
            heartbeat.wait_lost(heartbeat.lost_after + heartbeat.interval) if heartbeat else None
        )
        if verdict is None:
            logger.error("scheduler crashed:\n%s", traceback.format_exc())
            os._exit(1)
        _exit_lost(
            ready_conn, f"{verdict} (a collective failed: {type(e).__name__}: {first_line(e)})"
        )
