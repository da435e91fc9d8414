"""Wire a scheduler for prefill or decode mode: KV pool placement, metadata buffers, KV manager,
bootstrap server (prefill), and the queues that plug into the scheduler loop; and re-wire a
running one for another role (``switch_role``, behind ``POST /switch_role``).

A role switch keeps the model (weights, packed weights, attention backend) and rebuilds what
depends on the role, on every rank for the same control call: the PD queues and KV manager of
the old role are closed (its bootstrap server too), the prefix cache is flushed, the KV pools
are allocated again at the same sizes (decode's must be visible to its transfer backend, e.g.
shared memory for ``local``), and the new role's manager, metadata buffers and queues (and on a
prefill, its bootstrap server) are built as at start-up. Every step the ranks must agree on is
agreed over the world group; when one rank fails, every rank goes back to the old role.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import msgspec

from pdserve.config import ServerArgs
from pdserve.disagg.manager import buffer_allocator, get_kv_class
from pdserve.disagg.metadata import MetadataBuffers
from pdserve.distributed import SINGLE_RANK, Parallel

logger = logging.getLogger(__name__)


def num_metadata_slots(args: ServerArgs) -> int:
    # one row per request that can be in flight at once, with headroom for draining rooms
    return max(64, 2 * args.max_running_requests)


def routed_regions(runner) -> dict:
    """The ``KVArgs`` fields of the routed experts' store (--enable-return-routed-experts): its
    rows are a region of its cache group's pages, so decode's copy of a page carries prefill's
    ids."""
    store = runner.routed
    if store is None:
        return {}
    return {"extra_regions": [store.region()], "routed_experts": store.spec.describe()}


def draft_regions(runner) -> dict:
    """The ``KVArgs`` fields of a speculative draft model (``--speculative-algorithm
    STANDALONE``): its KV regions are addressed by the host group's page ids and numbered past
    the target's layers, so a page's transfer carries both models' KV."""
    draft = runner.draft
    if draft is None:
        return {}
    offset = runner.model.total_layers
    regions = [
        dataclasses.replace(r, group=runner.draft_host, layer=offset + r.layer)
        for g, pool in zip(draft.cache_groups, draft.pools)
        for r in pool.regions(g)
    ]
    describe = ", ".join(f"{len(g.layers)} {g.kind} layer(s)" for g in draft.cache_groups)
    algorithm = runner.args.speculative_algorithm
    return {
        "extra_regions": regions,
        "speculative": f"{algorithm} draft {draft.fingerprint} ({describe}, KV {draft.kv_dtype})",
    }


def extra_fields(runner) -> dict:
    """``KVArgs`` fields beyond the pools': the routed experts' and a draft model's regions."""
    routed, draft = routed_regions(runner), draft_regions(runner)
    out = {**routed, **draft}
    out["extra_regions"] = routed.get("extra_regions", []) + draft.get("extra_regions", [])
    return out


def apply_role_rules(args: ServerArgs, disable_radix_cache: bool) -> None:
    """What a role changes in the arguments it runs with (``disable_radix_cache``: the user's)."""
    # without the decode prefix cache a tree would only hold pages nobody reuses
    decode_without_cache = (
        args.disaggregation_mode == "decode" and not args.disaggregation_decode_enable_radix_cache
    )
    args.disable_radix_cache = disable_radix_cache or decode_without_cache


def attach_disaggregation(args: ServerArgs, tokenizer=None, par: Parallel = SINGLE_RANK):
    """Build a ``Scheduler`` for ``args.disaggregation_mode`` in {prefill, decode} (one rank's).

    Ranks are addressed as SGLang's: a rank's ``engine_rank`` / ``tp_size`` are its place in its
    attention group (the whole TP group without DP attention), ``system_dp_rank`` its group,
    ``pp_rank`` its pipeline stage."""
    from pdserve.engine.scheduler import Scheduler

    apply_role_rules(args, args.disable_radix_cache)
    allocator = buffer_allocator(args.disaggregation_transfer_backend, args.disaggregation_mode)
    scheduler = Scheduler(args, tokenizer, kv_allocator=allocator, par=par)
    attach_role(scheduler, par, start_bootstrap(args, par))
    return scheduler


def start_bootstrap(args: ServerArgs, par: Parallel):
    """A prefill's bootstrap server: one per server, on its first rank (it waits for every rank
    to register); None elsewhere, for other roles and for the fake backend."""
    if (
        args.disaggregation_mode != "prefill"
        or args.disaggregation_transfer_backend == "fake"
        or par.world.rank
    ):
        return None
    cls = get_kv_class(args.disaggregation_transfer_backend, "bootstrap_server")
    return cls(
        args.host,
        args.disaggregation_bootstrap_port,
        par.world.size,
        secret=args.disaggregation_secret,
    )


def metadata_buffers(scheduler, allocator, num_slots: int) -> MetadataBuffers:
    runner = scheduler.runner
    return MetadataBuffers(
        num_slots,
        allocator=allocator,
        device=runner.device,
        # an EAGLE head's first step on decode: its hidden state after the prompt
        hidden_size=runner.model.hidden_size if runner.capture_hidden else 0,
    )


def build_kv_args(scheduler, par: Parallel, metadata: MetadataBuffers):
    """What this rank registers with its transfer backend: its pools and ``metadata``."""
    runner, model, tp = scheduler.runner, scheduler.runner.model, par.attn
    return get_kv_class(scheduler.args.disaggregation_transfer_backend, "kv_args").from_buffers(
        runner.pools,
        metadata,
        cache_groups=runner.cache_groups,
        engine_rank=tp.rank,
        tp_size=tp.size,
        model_fingerprint=runner.fingerprint,
        total_kv_head_num=model.total_kv_heads,
        num_heads=model.num_attention_heads,
        system_dp_rank=par.dp_rank,
        dp_size=par.dp_size,
        pp_rank=par.pp_rank,
        pp_size=par.pp_size,
        prefill_start_layer=model.first_layer,
        num_layers=model.total_layers,
        global_rank=par.world.rank,
        grammar=scheduler.grammars.fingerprint,
        **extra_fields(runner),
    )


def attach_role(scheduler, par: Parallel, bootstrap=None) -> None:
    """Give ``scheduler`` the PD queues of ``scheduler.args.disaggregation_mode`` over its pools."""
    args = scheduler.args
    mode, backend = args.disaggregation_mode, args.disaggregation_transfer_backend
    metadata = metadata_buffers(
        scheduler, buffer_allocator(backend, mode), num_metadata_slots(args)
    )
    kv_args = build_kv_args(scheduler, par, metadata)
    # the room states are MIN-all-reduced over the ranks that share the scheduler
    group = par.sched.cpu_group if par.sched.size > 1 else None
    mgr = get_kv_class(backend, "manager")(kv_args, mode, args, backend)
    if mode == "prefill":
        from pdserve.disagg.fake import FakeKVSender
        from pdserve.disagg.prefill import PrefillQueues

        scheduler.pd = PrefillQueues(
            scheduler, mgr, metadata, get_kv_class(backend, "sender"), FakeKVSender, group=group
        )
        scheduler.pd.bootstrap_server = bootstrap
    else:
        from pdserve.disagg.decode import DecodeQueues

        scheduler.pd = DecodeQueues(
            scheduler,
            mgr,
            metadata,
            get_kv_class(backend, "receiver"),
            fake=backend == "fake",
            group=group,
        )
    logger.info("%s mode with the %s transfer backend", mode, backend)


def detach_role(scheduler) -> None:
    """Close the PD queues, KV manager and bootstrap server of the scheduler's role (if any)."""
    pd, scheduler.pd = scheduler.pd, None
    if pd is not None:
        pd.close()


# ---- role switch (every rank, one control call) ----------------------------------------------


class SwitchFailed(RuntimeError):
    pass


def _agree(par: Parallel, value: str) -> list[str]:
    """Every rank's ``value`` (a collective over the world group)."""
    if par.world.size == 1:
        return [value]
    return [msgspec.json.decode(b) for b in par.world.all_gather_bytes(msgspec.json.encode(value))]


def _first_error(par: Parallel, error: str) -> str:
    return next((f"rank {i}: {e}" for i, e in enumerate(_agree(par, error)) if e), "")


def idle_reason(scheduler) -> str:
    """Why the scheduler cannot switch now ("" when it can): anything queued, running or held."""
    s = scheduler
    if s.waiting or s.running:
        return f"{len(s.running)} request(s) running, {len(s.waiting)} waiting"
    if s.pd is not None and s.pd.has_work:
        held = len(s.pd.all_reqs())
        return (
            f"{held} request(s) in the PD queues"
            if held
            else "ended rooms still draining (a peer may write)"
        )
    return ""


def switch_role(
    scheduler, started: ServerArgs, mode: str, bootstrap_port: int, par: Parallel
) -> dict:
    """Re-wire an idle scheduler for ``mode`` (null, prefill, decode). ``started``: the arguments
    the server was started with (the user's, before any role rule). Returns ``{"busy": why}``
    while any rank still holds work (the front end asks again), else the timings; raises
    ``RuntimeError`` when the new role could not be built (the old one is back then)."""
    busy = _first_error(par, idle_reason(scheduler))
    if busy:
        return {"busy": busy}
    args = scheduler.args
    old = (args.disaggregation_mode, args.disaggregation_bootstrap_port)
    # validated as at start-up (the front end checked already; this is the scheduler's copy)
    dataclasses.replace(
        started, disaggregation_mode=mode, disaggregation_bootstrap_port=bootstrap_port
    )
    t0 = time.monotonic()
    try:
        _rewire(scheduler, started, mode, bootstrap_port, par)
    except SwitchFailed as e:
        logger.error("switch to %s failed (%s); going back to %s", mode, e, old[0])
        try:
            _rewire(scheduler, started, *old, par)  # what ran a moment ago
        except Exception:
            logger.critical(
                "cannot go back to the %s role either; this rank exits", old[0], exc_info=True
            )
            raise SystemExit(1) from None  # the front end sees the rank go and stops serving
        raise RuntimeError(
            f"cannot switch to {mode!r}: {e}; the server keeps its role {old[0]!r}"
        ) from None
    return {"reconfigure_s": time.monotonic() - t0}


def _rewire(scheduler, started: ServerArgs, mode: str, bootstrap_port: int, par: Parallel) -> None:
    args = scheduler.args
    detach_role(scheduler)
    args.disaggregation_mode, args.disaggregation_bootstrap_port = mode, bootstrap_port
    apply_role_rules(args, started.disable_radix_cache)
    backend = args.disaggregation_transfer_backend
    scheduler.reset_kv(buffer_allocator(backend, mode))  # flushes the prefix cache
    bootstrap, error = None, ""
    try:
        bootstrap = start_bootstrap(args, par)
    except Exception as e:  # e.g. the port is taken
        error = f"bootstrap server on port {bootstrap_port}: {type(e).__name__}: {e}"
    error = _first_error(par, error)  # before the managers register with it
    if not error and mode != "null":
        try:
            attach_role(scheduler, par, bootstrap)
        except Exception as e:
            logger.exception("building the %s role failed", mode)
            error = f"{type(e).__name__}: {e}"
        error = _first_error(par, error)
    if error:
        if scheduler.pd is not None:
            detach_role(scheduler)
        elif bootstrap is not None:
            bootstrap.shutdown()
        raise SwitchFailed(error)


def switch_role_control(loop, request: dict) -> dict:
    """The ``switch_role`` control op of a ``SchedulerLoop`` (every rank runs it for the same
    call): ``request`` has ``mode`` and ``bootstrap_port``. Asserts that the weights stayed where
    they were; the answer carries the new role's ``info`` for the front end."""
    from pdserve.log import retag, role_tag
    from pdserve.models.loader import weights_digest

    s = loop.scheduler
    model, before = s.runner.model, weights_digest(s.runner.model)
    old = s.args.disaggregation_mode
    out = switch_role(
        s, loop.started_args, request["mode"], int(request["bootstrap_port"]), loop.par
    )
    if "busy" in out:
        return out
    after = weights_digest(s.runner.model)
    assert s.runner.model is model and after == before, (
        f"the weights changed in a role switch: {before} -> {after}"
    )
    retag(role_tag(s.args.role, loop.world.rank))
    logger.info(
        "role switched from %s to %s in %.3fs: KV pools of %s pages reallocated, prefix cache "
        "flushed, weights kept (%d tensors, %.1f MiB, digest %s)",
        old,
        s.args.disaggregation_mode,
        out["reconfigure_s"],
        "/".join(str(p.num_pages) for p in s.runner.pools),
        after["tensors"],
        after["bytes"] / 2**20,
        after["digest"],
    )
    return {**out, "weights": after, "info": loop.info()}
