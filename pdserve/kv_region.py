"""``Region``: one buffer a rank registers with the KV transfer layer, described by the pool that
owns it.

A region is an array of equal *items* addressed by the page ids of one cache group (``group``):
item i starts at ``ptr + i * item_bytes``. A pool says what each of its regions holds (``layer``
and ``part``: "k" and "v" of an attention layer, "latent" of a latent-attention layer, ...),
when its pages are final (``final``) and how the item splits across tensor-parallel ranks
(``split``):

- ``heads``: the item is ``[kv_heads, ...]`` over the rank's KV heads
  (``distributed.kv_heads_for_rank``); ranks holding other heads hold other bytes.
- ``replicated``: every rank of the attention group holds the same bytes (a latent, an indexer
  key, the routed expert ids); a decode rank reads them from one prefill rank.
- ``segments``: the item is the concatenation of ``segments`` (this rank's bytes of each), each
  segment sharded evenly over the ranks along its own axis (a convolution state over channels).

The transfer layer pairs a prefill region with the decode region of the same ``key`` and plans
each by its split (``disagg/rank_map.py``); it never asks what kind of cache a region belongs to.
This module is shared by ``engine`` (the pools) and ``disagg`` (the wire, which encodes it as it
is); it imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

SPLITS = ("heads", "replicated", "segments")
FINALS = (
    "per_chunk",
    "last_chunk",
)  # last_chunk: pages still change until the last forward (a window)


@dataclass(frozen=True, kw_only=True)
class Region:
    ptr: int
    nbytes: int
    item_bytes: int  # bytes of one item (one page of the group; one slot of a per-request group)
    group: int  # the cache group whose page ids address the items
    layer: int = -1  # the model's (global) layer; -1: not one layer's (e.g. routed expert ids)
    part: str = ""  # what of the layer: "k", "v", "latent", ...
    final: str = "per_chunk"
    split: str = "heads"
    segments: tuple[int, ...] = ()  # "segments": this rank's bytes of each segment of an item
    # per segment, the whole units no rank splits (a Mamba2 layer's groups), 0: split evenly
    # (``kv_spec.piece_range``: with more ranks than units, ranks share one)
    pieces: tuple[int, ...] = ()

    @property
    def key(self) -> tuple[int, int, str]:
        """What pairs a prefill region with a decode region."""
        return (self.group, self.layer, self.part)

    @property
    def items(self) -> int:
        return self.nbytes // self.item_bytes if self.item_bytes > 0 else 0

    @property
    def name(self) -> str:
        where = f"layer {self.layer} " if self.layer >= 0 else ""
        return f"cache group {self.group} {where}{self.part or 'region'}"

    def check(self) -> str:
        """Why the region is malformed ("" when it is not)."""
        if self.split not in SPLITS:
            return f"{self.name}: split {self.split!r} is not one of {SPLITS}"
        if self.final not in FINALS:
            return f"{self.name}: final {self.final!r} is not one of {FINALS}"
        if self.item_bytes < 0 or self.nbytes < 0:
            return f"{self.name}: negative size ({self.nbytes} bytes, items of {self.item_bytes})"
        if (self.split == "segments") != bool(self.segments):
            return f"{self.name}: segments {list(self.segments)} with split {self.split!r}"
        if self.pieces and len(self.pieces) != len(self.segments):
            return f"{self.name}: pieces {list(self.pieces)} for segments {list(self.segments)}"
        if self.segments and sum(self.segments) != self.item_bytes:
            return (
                f"{self.name}: segments of {sum(self.segments)} bytes in items of {self.item_bytes}"
            )
        return ""

    def describe_split(self) -> str:
        return f"segments {list(self.segments)}" if self.split == "segments" else self.split

    def at(self, ptr: int) -> "Region":
        """The same region at another address (a window's view of the same bytes)."""
        return replace(self, ptr=ptr)
