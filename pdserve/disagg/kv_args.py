"""``KVArgs``: what one scheduler rank registers with the KV transfer layer, and the
compatibility rules between a prefill rank and a decode rank.

The rank's buffers are one list of typed ``kv_region.Region`` (from each cache group's pool, and
the routed experts' store), each saying its cache group, layer, part, when its pages are final
and how it splits across TP ranks; and the metadata buffers (``aux_*``, one row per request).
The transfer layer pairs regions by ``Region.key`` and plans each by its split; it does not know
what kind of cache a group is, only that its items are addressed by the group's own page ids.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from pdserve.kv_region import Region
from pdserve.kv_spec import anchor_group

KV_LAYOUT = "regions/v3"  # typed regions (kv_region.Region), paired by (group, layer, part)


@dataclass
class KVArgs:
    engine_rank: int = 0
    # every cache region this rank holds (kv_region.Region), in the order the pools list them
    regions: list[Region] = field(default_factory=list)
    # per (layer, cache group) this rank holds: {"layer", "group", "kind", ...} (kv_spec describe(),
    # without this rank's share of the heads)
    layer_specs: list[dict] = field(default_factory=list)
    # metadata buffers (MetadataBuffers.buffer_info()), bootstrap_room last
    aux_data_ptrs: list[int] = field(default_factory=list)
    aux_data_lens: list[int] = field(default_factory=list)
    aux_item_lens: list[int] = field(default_factory=list)
    routed_experts: Optional[dict] = None  # RoutedExpertsSpec.describe(): both sides must agree
    # the "heads" split: KV heads held by this rank / by the whole model, query heads of the whole
    # model (which KV heads a rank holds follows from them: distributed.kv_heads_for_rank)
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
    kv_dtype: str = ""
    layout: str = KV_LAYOUT
    grammar: str = ""  # the grammar engine and the vocabulary it masks ("" unknown)
    # a speculative draft model whose KV travels with the pages ("" none): both sides must agree
    speculative: str = ""

    def __post_init__(self) -> None:
        self.regions = [r if isinstance(r, Region) else Region(**r) for r in self.regions]
        bad = next((why for why in (r.check() for r in self.regions) if why), "")
        if bad:
            raise ValueError(f"regions: {bad}")
        keys = [r.key for r in self.regions]
        if len(set(keys)) != len(keys):
            dup = next(k for k in keys if keys.count(k) > 1)
            raise ValueError(
                f"regions: two regions of cache group {dup[0]}, layer {dup[1]}, part {dup[2]!r}"
            )
        n = {len(getattr(self, f"aux_{s}")) for s in ("data_ptrs", "data_lens", "item_lens")}
        if len(n) != 1:
            raise ValueError(f"aux_data_ptrs/lens/item_lens: lengths differ ({sorted(n)})")
        if self.page_size < 1:
            raise ValueError(f"page_size: must be >= 1, got {self.page_size}")

    @classmethod
    def from_buffers(
        cls,
        kv_pools,
        metadata_buffers,
        *,
        engine_rank: int = 0,
        model_fingerprint: str = "",
        total_kv_head_num: Optional[int] = None,
        cache_groups: Optional[Sequence] = None,
        extra_regions: Sequence[Region] = (),
        **kwargs: Any,
    ) -> "KVArgs":
        """Build from the rank's pools (one, or one per cache group, with ``cache_groups``: the
        ``kv_spec.CacheGroup`` of each), its ``MetadataBuffers`` and ``extra_regions`` (regions
        addressed by a group's pages that no pool owns: the routed expert ids)."""
        pools = [kv_pools] if not isinstance(kv_pools, (list, tuple)) else list(kv_pools)
        start = kwargs.get("prefill_start_layer", 0)
        if cache_groups is None:  # one pool, alone in its group
            cache_groups = [pools[0].as_group(start)]
        regions, specs = [], []
        for g, pool in zip(cache_groups, pools):
            regions += pool.regions(g)
            # heads differ across TP; tuples as lists, as the description arrives from a peer
            desc = {k: _plain(v) for k, v in g.spec.describe().items() if k != "num_kv_heads"}
            specs += [{"layer": layer, "group": g.id, **desc} for layer in g.layers]
        heads = max((p.kv_heads for p in pools), default=0)
        anchor = pools[
            anchor_group(cache_groups)
        ]  # its page size, device and dtype are the cache's
        aux = metadata_buffers.buffer_info()
        return cls(
            engine_rank=engine_rank,
            regions=regions + list(extra_regions),
            layer_specs=sorted(specs, key=lambda d: (d["layer"], d["group"])),
            aux_data_ptrs=list(aux.data_ptrs),
            aux_data_lens=list(aux.data_lens),
            aux_item_lens=list(aux.item_lens),
            kv_head_num=heads,
            total_kv_head_num=total_kv_head_num if total_kv_head_num is not None else heads,
            page_size=anchor.page_size,
            device=str(anchor.device),
            gpu_id=anchor.device.index or 0,
            model_fingerprint=model_fingerprint,
            num_layers=kwargs.pop("num_layers", sum(len(g.layers) for g in cache_groups)),
            kv_dtype=anchor.dtype_name,
            **kwargs,
        )

    @property
    def num_local_layers(self) -> int:
        # the model's own layers (a draft model's regions number theirs past them)
        top = self.num_layers or float("inf")
        return len({r.layer for r in self.regions if 0 <= r.layer < top})

    @property
    def num_groups(self) -> int:
        return max((r.group for r in self.regions), default=-1) + 1

    @property
    def splits(self) -> tuple[str, ...]:
        """The TP splits of this rank's regions (what ``rank_map.plan`` has to pair)."""
        return tuple(sorted({r.split for r in self.regions}))

    def final_after_last_chunk(self, group: int) -> bool:
        """Whether ``group``'s pages may only be sent with the last chunk."""
        return any(r.final == "last_chunk" for r in self.regions if r.group == group)

    def compat_info(self) -> dict[str, Any]:
        """The fields a peer must agree on (also published on the bootstrap server)."""
        return {
            "model_fingerprint": self.model_fingerprint,
            "num_layers": self.num_layers,
            "kv_heads": self.total_kv_head_num,
            "kv_dtype": self.kv_dtype,
            "page_size": self.page_size,
            "layout": self.layout,
            "layer_specs": self.layer_specs,
            "routed_experts": self.routed_experts,
            "grammar": self.grammar,
            "speculative": self.speculative,
        }

    def buffers(self) -> list[tuple[int, int]]:
        """Every (ptr, nbytes) this rank registers with its transfer backend."""
        out = [(r.ptr, r.nbytes) for r in self.regions]
        out += zip(self.aux_data_ptrs, self.aux_data_lens)
        return [(int(p), int(n)) for p, n in out]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


COMPAT_FIELDS = (
    "model_fingerprint",
    "num_layers",
    "kv_heads",
    "kv_dtype",
    "page_size",
    "layout",
    "layer_specs",
    "routed_experts",
    "grammar",
    "speculative",
)
_HINTS = {
    "kv_dtype": " (give both servers the same --kv-cache-dtype or --dtype: "
    "--dtype auto measures on each server)",
    "routed_experts": " (start prefill and decode both with --enable-return-routed-experts, or "
    "neither: the ids travel with the KV pages)",
    "speculative": " (start prefill and decode with the same --speculative-algorithm STANDALONE "
    "and --speculative-draft-model-path, or neither: "
    "decode's draft continues from the draft KV prefill computed)",
    "grammar": " (give both servers the same --grammar-backend and tokenizer: decode continues the "
    "grammar from prefill's first token, so both must allow the same tokens)",
}


def _describe(spec: dict) -> str:
    extra = ", ".join(f"{k} {v}" for k, v in spec.items() if k not in ("layer", "group", "kind"))
    return f"{spec.get('kind')} ({extra})" if extra else str(spec.get("kind"))


def _plain(value: Any) -> Any:
    """``value`` with its tuples as lists, at every depth (what a description is on the wire)."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _layer_spec_mismatches(prefill: list[dict], decode: list[dict]) -> list[str]:
    """The caches of the layers prefill sends (a pipeline stage sends only its own) must be
    decode's for the same layers: kind, window, shapes and cache group, per (layer, group); a
    layer may hold several caches (latent attention and its indexer's keys)."""
    by_key = {(s["layer"], s.get("group")): s for s in decode}
    for p in prefill:
        d = by_key.get((p["layer"], p.get("group")))
        if d is None:
            theirs = [s for s in decode if s["layer"] == p["layer"]]
            if not theirs:
                return [
                    f"layer {p['layer']} cache: prefill has {_describe(p)}, "
                    "decode has no such layer"
                ]
            return [
                f"layer {p['layer']} cache mismatch: "
                f"prefill {_describe(p)} in group {p.get('group')}, decode "
                + ", ".join(f"{_describe(t)} in group {t.get('group')}" for t in theirs)
            ]
        if p != d:
            return [
                f"layer {p['layer']} cache mismatch: prefill {_describe(p)} in group "
                f"{p.get('group')}, decode {_describe(d)} in group {d.get('group')}"
            ]
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
        if name in ("model_fingerprint", "grammar") and (not p or not d):
            continue
        if name == "layer_specs":
            out += _layer_spec_mismatches(p or [], d or [])
            continue
        if p != d:
            if name == "speculative":
                p, d = p or "no draft model", d or "no draft model"
            out.append(f"{name} mismatch: prefill {p}, decode {d}{_HINTS.get(name, '')}")
    return out
