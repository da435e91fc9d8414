"""``KVArgs``: what one scheduler rank registers with the KV transfer layer, and the
compatibility rules between a prefill rank and a decode rank.

KV regions are listed per (layer, K|V), layer-major (``[L0.K, L0.V, L1.K, ...]``), as
``KVPool.buffer_info()`` returns them; one item is one page of one layer's K (or V).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

STATE_TYPES = ("none", "swa", "mamba", "nsa")
KV_LAYOUT = "layer,kv,page,head,token,dim"  # [num_layers, 2, num_pages, kv_heads, page_size, head_dim]


@dataclass
class KVArgs:
    engine_rank: int = 0
    # KV pool: one entry per (layer, K|V), layer-major; draft-model entries appended
    kv_data_ptrs: list[int] = field(default_factory=list)
    kv_data_lens: list[int] = field(default_factory=list)
    kv_item_lens: list[int] = field(default_factory=list)
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
        for prefix in ("kv", "aux", "state"):
            n = {len(getattr(self, f"{prefix}_data_{s}")) for s in ("ptrs", "lens")}
            n.add(len(getattr(self, f"{prefix}_item_lens")))
            if len(n) != 1:
                raise ValueError(f"{prefix}_data_ptrs/lens/item_lens: lengths differ ({sorted(n)})")
        if self.page_size < 1:
            raise ValueError(f"page_size: must be >= 1, got {self.page_size}")

    @classmethod
    def from_buffers(cls, kv_pool, metadata_buffers, *, engine_rank: int = 0, model_fingerprint: str = "",
                     total_kv_head_num: Optional[int] = None, **kwargs: Any) -> "KVArgs":
        """Build from a ``KVPool`` and ``MetadataBuffers`` (the common case)."""
        kv = kv_pool.buffer_info()
        aux = metadata_buffers.buffer_info()
        return cls(
            engine_rank=engine_rank,
            kv_data_ptrs=list(kv.data_ptrs), kv_data_lens=list(kv.data_lens), kv_item_lens=list(kv.item_lens),
            aux_data_ptrs=list(aux.data_ptrs), aux_data_lens=list(aux.data_lens),
            aux_item_lens=list(aux.item_lens),
            kv_head_num=kv.kv_heads,
            total_kv_head_num=total_kv_head_num if total_kv_head_num is not None else kv.kv_heads,
            page_size=kv.page_size,
            device=str(kv_pool.device),
            gpu_id=kv_pool.device.index or 0,
            model_fingerprint=model_fingerprint,
            num_layers=kwargs.pop("num_layers", kv_pool.num_layers),
            head_dim=kv.head_dim,
            kv_dtype=kv.dtype,
            **kwargs,
        )

    @property
    def num_local_layers(self) -> int:
        return len(self.kv_data_ptrs) // self.kv_entries_per_layer if self.kv_data_ptrs else 0

    @property
    def kv_entries_per_layer(self) -> int:
        return 2  # K and V (an MLA pool would have 1)

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
        }

    def regions(self) -> list[tuple[int, int]]:
        """Every (ptr, nbytes) this rank registers with its transfer backend."""
        out = []
        for prefix in ("kv", "aux", "state"):
            out += zip(getattr(self, f"{prefix}_data_ptrs"), getattr(self, f"{prefix}_data_lens"))
        return [(int(p), int(n)) for p, n in out]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


COMPAT_FIELDS = ("model_fingerprint", "num_layers", "kv_heads", "head_dim", "kv_dtype", "page_size", "layout")


def compat_mismatches(prefill: dict[str, Any], decode: dict[str, Any]) -> list[str]:
    """Human-readable differences between a prefill and a decode ``compat_info()``, e.g.
    ``"page_size mismatch: prefill 16, decode 1"``. An empty fingerprint means "unknown" and is
    not compared."""
    out = []
    for name in COMPAT_FIELDS:
        p, d = prefill.get(name), decode.get(name)
        if name == "model_fingerprint" and (not p or not d):
            continue
        if p != d:
            hint = " (give both servers the same --kv-cache-dtype or --dtype: --dtype auto measures on each server)" \
                if name == "kv_dtype" else ""
            out.append(f"{name} mismatch: prefill {p}, decode {d}{hint}")
    return out
