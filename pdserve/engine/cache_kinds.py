"""What the engine does with each cache kind (``kv_spec.CacheSpec.kind``): its policy in the KV
cache manager (``cache_policy.py``) and the pool that holds it (``kv_pool.py``), in one table. A
new kind is a spec in ``kv_spec``, its policy and pool (often existing ones) and one row here;
``policy_for`` and ``make_pool`` read it, nothing else names a kind."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.cache_policy import (
    CachePolicy,
    CompressedPolicy,
    FullAttentionPolicy,
    StatePolicy,
    WindowPolicy,
)
from pdserve.engine.kv_pool import BaseKVPool, CompressedPool, KVPool, LatentPool, StatePool


@dataclass(frozen=True)
class KindHandling:
    policy: type[CachePolicy]
    pool: type[BaseKVPool]


KINDS: dict[str, KindHandling] = {
    "full_attention": KindHandling(FullAttentionPolicy, KVPool),
    "sliding_window": KindHandling(WindowPolicy, KVPool),
    "latent_attention": KindHandling(FullAttentionPolicy, LatentPool),
    "index_keys": KindHandling(FullAttentionPolicy, LatentPool),
    "latent_window": KindHandling(WindowPolicy, LatentPool),
    "recurrent_state": KindHandling(StatePolicy, StatePool),
    "compressed": KindHandling(CompressedPolicy, CompressedPool),
    "compressor_state": KindHandling(StatePolicy, StatePool),
}
