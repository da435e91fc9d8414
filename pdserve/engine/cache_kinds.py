"""What the engine does with each cache kind (``kv_spec.CacheSpec.kind``): its policy in the KV
cache manager (``cache_policy.py``) and the pool that holds it (``kv_pool.py``), in one table. A
new kind is a spec in ``kv_spec``, its policy and pool (often existing ones) and one row here;
``policy_for`` and ``make_pool`` (here) read it, nothing else names a kind."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pdserve.engine.cache_policy import (
    CachePolicy,
    CompressedPolicy,
    FullAttentionPolicy,
    StatePolicy,
    WindowPolicy,
)
from pdserve.engine.kv_pool import (
    BaseKVPool,
    BufferAllocator,
    CompressedPool,
    KVPool,
    LatentPool,
    LedgerPool,
    StatePool,
    default_allocator,
)
from pdserve.engine.kv_quant import KVQuant
from pdserve.kv_spec import CacheSpec


@dataclass(frozen=True)
class KindHandling:
    policy: type[CachePolicy]
    pool: type[BaseKVPool]


KINDS: dict[str, KindHandling] = {
    "full_attention": KindHandling(FullAttentionPolicy, KVPool),
    "sliding_window": KindHandling(WindowPolicy, KVPool),
    "chunked_attention": KindHandling(WindowPolicy, KVPool),
    "latent_attention": KindHandling(FullAttentionPolicy, LatentPool),
    "index_keys": KindHandling(FullAttentionPolicy, LatentPool),
    "latent_window": KindHandling(WindowPolicy, LatentPool),
    "recurrent_state": KindHandling(StatePolicy, StatePool),
    "compressed": KindHandling(CompressedPolicy, CompressedPool),
    "compressor_state": KindHandling(StatePolicy, StatePool),
    "position_ledger": KindHandling(FullAttentionPolicy, LedgerPool),
}


def policy_for(spec: CacheSpec, page_size: int, prefix_cache: bool = True) -> CachePolicy:
    kind = KINDS.get(spec.kind)
    if kind is None:
        raise ValueError(
            f"cache kind {spec.kind!r} has no policy in the KV cache manager "
            f"(policies: {', '.join(sorted(KINDS))})"
        )
    return kind.policy(spec, page_size, prefix_cache)


def make_pool(
    group,
    num_pages: int,
    page_size: int,
    dtype: torch.dtype,
    device,
    allocator: BufferAllocator = default_allocator,
    quant: Optional[KVQuant] = None,
) -> BaseKVPool:
    """The pool of cache group ``group`` (``kv_spec.CacheGroup``), by its spec's kind; ``quant``:
    a quantized KV format (``KVPool`` only: ``kv_quant.check_quantizable`` refused the rest)."""
    kind = KINDS.get(group.kind)
    if kind is None:
        raise ValueError(
            f"cache kind {group.kind!r} (layers {list(group.layers)}) has no pool in this engine "
            f"(pools: {', '.join(sorted(KINDS))})"
        )
    cls = kind.pool
    extra = {"quant": quant} if quant is not None and cls is KVPool else {}
    return cls.for_spec(
        group.spec, len(group.layers), num_pages, page_size, dtype, device, allocator, **extra
    )
