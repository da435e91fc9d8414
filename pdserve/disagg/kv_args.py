"""``KVArgs``: what one scheduler rank registers with the KV transfer layer, and the
compatibility rules between a prefill rank and a decode rank.

KV regions are listed per cache group, then per (layer, K|V) layer-major within the group
(``[g0.L0.K, g0.L0.V, g0.L1.K, ..., g1.L1.K, ...]``), as each group's ``KVPool.buffer_info()``
returns them; one item is one page of one layer's K (or V). ``kv_region_group`` and
``kv_region_layer`` say which group and which (global) layer each region holds, so the transfer
layer pairs regions by (group, layer) and never counts "entries per layer"; it does not need to
know what a group's kind is, only that its pages are addressed by the group's own page ids.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

STATE_TYPES = ("none", "swa", "mamba", "nsa")
REGION_FINAL = ("per_chunk", "last_chunk")
# per group: [num_layers, 2, num_pages, kv_heads, page_size, head_dim]
KV_LAYOUT = "group,layer,kv,page,head,token,dim"


@dataclass
class KVArgs:
    engine_rank: int = 0
    # KV pools: one entry per (group, layer, K|V), group-major then layer-major
    kv_data_ptrs: list[int] = field(default_factory=list)
    kv_data_lens: list[int] = field(default_factory=list)
    kv_item_lens: list[int] = field(default_factory=list)
    kv_region_group: list[int] = field(default_factory=list)  # cache group of each entry
    kv_region_layer: list[int] = field(default_factory=list)  # global layer of each entry
    # when each entry's pages are final: "per_chunk" (sent as chunks complete) or "last_chunk"
    # (only after the last forward: a window still drops pages while the prompt is computed)
    kv_region_final: list[str] = field(default_factory=list)
    # per layer this rank holds: {"layer", "group", "kind", "head_dim", "window"?} (kv_spec)
    layer_specs: list[dict] = field(default_factory=list)
    # metadata buffers (MetadataBuffers.buffer_info()), bootstrap_room last
    aux_data_ptrs: list[int] = field(default_factory=list)
    aux_data_lens: list[int] = field(default_factory=list)
    aux_item_lens: list[int] = field(default_factory=list)
    # hybrid-model state buffers
    state_data_ptrs: list[int] = field(default_factory=list)
    state_data_lens: list[int] = field(default_factory=list)
    state_item_lens: list[int] = field(default_factory=list)
    state_type: str = "none"
    state_dim_per_tensor: list[int] = field(default_factory=list)
    # routed experts of every token slot (--enable-return-routed-experts; engine/routed_experts.py):
    # one region, item i = page i of cache group ``routed_group``, sent with that group's pages
    routed_data_ptrs: list[int] = field(default_factory=list)
    routed_data_lens: list[int] = field(default_factory=list)
    routed_item_lens: list[int] = field(default_factory=list)
    routed_group: int = -1
    routed_experts: Optional[dict] = None  # RoutedExpertsSpec.describe(): both sides must agree
    # head slicing (non-MLA): KV heads held by this rank / by the whole model, query heads of the
    # whole model (which KV heads a rank holds follows from them: distributed.kv_heads_for_rank)
    kv_head_num: int = 0
    total_kv_head_num: int = 0
    num_heads: int = 0
    page_size: int = 1
    # parallelism
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    prefill_start_layer: int = 0  # first layer this rank holds (pipeline parallel prefill)
    system_dp_rank: int = 0  # the attention-DP group (SGLang's attn_dp_rank)
    dp_size: int = 1
    global_rank: int = 0  # the rank's index among all of its server's ranks
    # device / network
    gpu_id: int = 0
    device: str = "cpu"
    ib_device: Optional[str] = None
    ib_traffic_class: Optional[int] = None
    # compatibility
    model_fingerprint: str = ""
    num_layers: int = 0  # layers of the whole model
    head_dim: int = 0
    kv_dtype: str = ""
    layout: str = KV_LAYOUT

    def __post_init__(self) -> None:
        if self.state_type not in STATE_TYPES:
            raise ValueError(f"state_type: must be one of {STATE_TYPES}, got {self.state_type!r}")
        for prefix in ("kv", "aux", "state", "routed"):
            n = {len(getattr(self, f"{prefix}_data_{s}")) for s in ("ptrs", "lens")}
            n.add(len(getattr(self, f"{prefix}_item_lens")))
            if len(n) != 1:
                raise ValueError(f"{prefix}_data_ptrs/lens/item_lens: lengths differ ({sorted(n)})")
        if self.page_size < 1:
            raise ValueError(f"page_size: must be >= 1, got {self.page_size}")
        if not self.kv_region_group and self.kv_data_ptrs:  # one group of consecutive layers
            self.kv_region_group = [0] * len(self.kv_data_ptrs)
            self.kv_region_layer = [self.prefill_start_layer + i // 2 for i in range(len(self.kv_data_ptrs))]
        if not self.kv_region_final:
            self.kv_region_final = ["per_chunk"] * len(self.kv_data_ptrs)
        n = {len(self.kv_region_group), len(self.kv_region_layer), len(self.kv_region_final), len(self.kv_data_ptrs)}
        if len(n) != 1:
            raise ValueError(f"kv_region_group/layer/final: {len(self.kv_region_group)}/{len(self.kv_region_layer)}/"
                             f"{len(self.kv_region_final)} entries for {len(self.kv_data_ptrs)} KV regions")
        bad = sorted(set(self.kv_region_final) - set(REGION_FINAL))
        if bad:
            raise ValueError(f"kv_region_final: {bad} not in {REGION_FINAL}")
        if self.routed_data_ptrs and self.routed_group not in self.kv_region_group:
            raise ValueError(f"routed_group: {self.routed_group} is not one of the KV regions' cache groups")

    @classmethod
    def from_buffers(cls, kv_pools, metadata_buffers, *, engine_rank: int = 0, model_fingerprint: str = "",
                     total_kv_head_num: Optional[int] = None, cache_groups: Optional[Sequence] = None,
                     **kwargs: Any) -> "KVArgs":
        """Build from the ranks' ``KVPool`` (one, or one per cache group, with ``cache_groups``:
        the ``kv_spec.CacheGroup`` of each) and ``MetadataBuffers`` (the common case)."""
        pools = [kv_pools] if not isinstance(kv_pools, (list, tuple)) else list(kv_pools)
        start = kwargs.get("prefill_start_layer", 0)
        if cache_groups is None:  # one full-attention group of the pool's layers
            from pdserve.kv_spec import CacheGroup, FullAttention

            p = pools[0]
            cache_groups = [CacheGroup(0, FullAttention(p.kv_heads, p.head_dim), tuple(range(start, start + p.num_layers)))]
        ptrs, lens, items, groups, layers, finals, specs = [], [], [], [], [], [], []
        for g, pool in zip(cache_groups, pools):
            kv = pool.buffer_info()
            ptrs += kv.data_ptrs
            lens += kv.data_lens
            items += kv.item_lens
            groups += [g.id] * len(kv.data_ptrs)
            layers += [layer for layer in g.layers for _ in (0, 1)]  # K and V of each layer
            finals += ["last_chunk" if g.spec.drops_pages else "per_chunk"] * len(kv.data_ptrs)
            desc = {k: v for k, v in g.spec.describe().items() if k != "num_kv_heads"}  # heads differ across TP
            specs += [{"layer": layer, "group": g.id, **desc} for layer in g.layers]
        first = pools[0].buffer_info()
        aux = metadata_buffers.buffer_info()
        return cls(
            engine_rank=engine_rank,
            kv_data_ptrs=ptrs, kv_data_lens=lens, kv_item_lens=items, kv_region_group=groups,
            kv_region_layer=layers, kv_region_final=finals, layer_specs=sorted(specs, key=lambda d: d["layer"]),
            aux_data_ptrs=list(aux.data_ptrs), aux_data_lens=list(aux.data_lens),
            aux_item_lens=list(aux.item_lens),
            kv_head_num=first.kv_heads,
            total_kv_head_num=total_kv_head_num if total_kv_head_num is not None else first.kv_heads,
            page_size=first.page_size,
            device=str(pools[0].device),
            gpu_id=pools[0].device.index or 0,
            model_fingerprint=model_fingerprint,
            num_layers=kwargs.pop("num_layers", sum(len(g.layers) for g in cache_groups)),
            head_dim=first.head_dim,
            kv_dtype=first.dtype,
            **kwargs,
        )

    @property
    def num_local_layers(self) -> int:
        return len(set(self.kv_region_layer))

    @property
    def num_groups(self) -> int:
        return max(self.kv_region_group, default=-1) + 1

    def final_after_last_chunk(self, group: int) -> bool:
        """Whether ``group``'s pages may only be sent with the last chunk."""
        return any(f == "last_chunk" for g, f in zip(self.kv_region_group, self.kv_region_final) if g == group)

    def compat_info(self) -> dict[str, Any]:
        """The fields a peer must agree on (also published on the bootstrap server)."""
        return {
            "model_fingerprint": self.model_fingerprint,
            "num_layers": self.num_layers,
            "kv_heads": self.total_kv_head_num,
            "head_dim": self.head_dim,
            "kv_dtype": self.kv_dtype,
            "page_size": self.page_size,
            "layout": self.layout,
            "layer_specs": self.layer_specs,
            "routed_experts": self.routed_experts,
        }

    def regions(self) -> list[tuple[int, int]]:
        """Every (ptr, nbytes) this rank registers with its transfer backend."""
        out = []
        for prefix in ("kv", "aux", "state", "routed"):
            out += zip(getattr(self, f"{prefix}_data_ptrs"), getattr(self, f"{prefix}_data_lens"))
        return [(int(p), int(n)) for p, n in out]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


COMPAT_FIELDS = ("model_fingerprint", "num_layers", "kv_heads", "head_dim", "kv_dtype", "page_size", "layout",
                 "layer_specs", "routed_experts")
_HINTS = {
    "kv_dtype": " (give both servers the same --kv-cache-dtype or --dtype: --dtype auto measures on each server)",
    "routed_experts": " (start prefill and decode both with --enable-return-routed-experts, or neither: the ids "
                      "travel with the KV pages)",
}


def _describe(spec: dict) -> str:
    extra = ", ".join(f"{k} {v}" for k, v in spec.items() if k not in ("layer", "group", "kind"))
    return f"{spec.get('kind')} ({extra})" if extra else str(spec.get("kind"))


def _layer_spec_mismatches(prefill: list[dict], decode: list[dict]) -> list[str]:
    """The cache layout of the layers prefill sends (a pipeline stage sends only its own) must
    be decode's for the same layers: kind, window, head size and cache group."""
    by_layer = {s["layer"]: s for s in decode}
    for p in prefill:
        d = by_layer.get(p["layer"])
        if d is None:
            return [f"layer {p['layer']} cache: prefill has {_describe(p)}, decode has no such layer"]
        if {k: v for k, v in p.items()} != {k: v for k, v in d.items()}:
            return [f"layer {p['layer']} cache mismatch: prefill {_describe(p)} in group {p.get('group')}, "
                    f"decode {_describe(d)} in group {d.get('group')}"]
    return []


def compat_mismatches(prefill: dict[str, Any], decode: dict[str, Any]) -> list[str]:
    """Human-readable differences between a prefill and a decode ``compat_info()``, e.g.
    ``"page_size mismatch: prefill 16, decode 1"``. An empty fingerprint means "unknown" and is
    not compared, nor is a field one side does not list (the bootstrap server publishes only the
    instance fields; ``Register`` carries them all)."""
    out = []
    for name in COMPAT_FIELDS:
        if name not in prefill or name not in decode:
            continue
        p, d = prefill.get(name), decode.get(name)
        if name == "model_fingerprint" and (not p or not d):
            continue
        if name == "layer_specs":
            out += _layer_spec_mismatches(p or [], d or [])
            continue
        if p != d:
            out.append(f"{name} mismatch: prefill {p}, decode {d}{_HINTS.get(name, '')}")
    return out
