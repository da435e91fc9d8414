"""Wire a scheduler for prefill or decode mode: KV pool placement, metadata buffers, KV manager,
bootstrap server (prefill), and the queues that plug into the scheduler loop."""

from __future__ import annotations

import logging

from pdserve.config import ServerArgs
from pdserve.distributed import SINGLE_RANK, Parallel
from pdserve.disagg.manager import buffer_allocator, get_kv_class
from pdserve.disagg.metadata import MetadataBuffers

logger = logging.getLogger(__name__)


def num_metadata_slots(args: ServerArgs) -> int:
    # one row per request that can be in flight at once, with headroom for draining rooms
    return max(64, 2 * args.max_running_requests)


def routed_regions(runner) -> dict:
    """The ``KVArgs`` fields of the routed experts' store (--enable-return-routed-experts): its
    rows go with the pages of its cache group, so decode's copy of a page carries prefill's ids."""
    store = runner.routed
    if store is None:
        return {}
    ptr, nbytes, item = store.buffer_info()
    return {"routed_data_ptrs": [ptr], "routed_data_lens": [nbytes], "routed_item_lens": [item],
            "routed_group": store.spec.group, "routed_experts": store.spec.describe()}


def attach_disaggregation(args: ServerArgs, tokenizer=None, par: Parallel = SINGLE_RANK):
    """Build a ``Scheduler`` for ``args.disaggregation_mode`` in {prefill, decode} (one rank's).

    Ranks are addressed as SGLang's: a rank's ``engine_rank`` / ``tp_size`` are its place in its
    attention group (the whole TP group without DP attention), ``system_dp_rank`` its group,
    ``pp_rank`` its pipeline stage."""
    from pdserve.engine.scheduler import Scheduler

    mode, backend = args.disaggregation_mode, args.disaggregation_transfer_backend
    allocator = buffer_allocator(backend, mode)
    if mode == "decode" and not args.disaggregation_decode_enable_radix_cache:
        # without the decode prefix cache a tree would only hold pages nobody reuses
        args.disable_radix_cache = True
    scheduler = Scheduler(args, tokenizer, kv_allocator=allocator, par=par)
    metadata = MetadataBuffers(num_metadata_slots(args), allocator=allocator, device=scheduler.runner.device)
    model = scheduler.runner.model
    tp = par.attn
    kv_args = get_kv_class(backend, "kv_args").from_buffers(
        scheduler.runner.pools, metadata, cache_groups=scheduler.runner.cache_groups, engine_rank=tp.rank, tp_size=tp.size, model_fingerprint=scheduler.runner.fingerprint,
        total_kv_head_num=model.total_kv_heads, num_heads=model.num_attention_heads,
        system_dp_rank=par.dp_rank, dp_size=par.dp_size, pp_rank=par.pp_rank, pp_size=par.pp_size,
        prefill_start_layer=model.first_layer, num_layers=model.total_layers, global_rank=par.world.rank,
        **routed_regions(scheduler.runner),
    )
    # the room states are MIN-all-reduced over the ranks that share the scheduler
    group = par.sched.cpu_group if par.sched.size > 1 else None
    if mode == "prefill":
        from pdserve.disagg.fake import FakeKVSender
        from pdserve.disagg.prefill import PrefillQueues

        bootstrap = None
        if backend != "fake" and par.world.rank == 0:  # one per server; it waits for every rank to register
            bootstrap = get_kv_class(backend, "bootstrap_server")(args.host, args.disaggregation_bootstrap_port,
                                                                   par.world.size, secret=args.disaggregation_secret)
        mgr = get_kv_class(backend, "manager")(kv_args, "prefill", args, backend)
        scheduler.pd = PrefillQueues(scheduler, mgr, metadata, get_kv_class(backend, "sender"), FakeKVSender,
                                     group=group)
        scheduler.pd.bootstrap_server = bootstrap
    else:
        from pdserve.disagg.decode import DecodeQueues

        mgr = get_kv_class(backend, "manager")(kv_args, "decode", args, backend)
        scheduler.pd = DecodeQueues(scheduler, mgr, metadata, get_kv_class(backend, "receiver"),
                                    fake=backend == "fake", group=group)
    logger.info("%s mode with the %s transfer backend", mode, backend)
    return scheduler
