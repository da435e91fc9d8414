"""Cache specs: what one layer keeps per token (or per request), declared by the model.

A model returns the specs of each layer it runs (``CausalLM.kv_cache_specs``: one, or a tuple when a
layer keeps several caches); layers with equal specs form a ``CacheGroup`` (``group_layers``; a
layer of several caches is in several groups), and each group gets its own pool and page allocator
(``engine/kv_cache.py``). Everything that sizes, allocates or transfers the cache reads these
specs, never the model's shapes:

- ``FullAttention``: K and V per token per KV head; a sequence keeps every page.
- ``SlidingWindow``: the same per token, but a query at position i sees keys i-W < j <= i, so a
  sequence keeps only the pages that the next query can still see (``first_live_page``).
- ``ChunkedAttention``: the same per token, but a query sees only the keys of its own chunk of
  C positions (C*floor(i/C) <= j <= i: a window that restarts at each chunk boundary, Llama 4's
  local layers), so a sequence keeps only the pages of its current chunk.
- ``LatentAttention``: one latent vector per token (MLA): no head axis, replicated over
  attention TP.
- ``LatentWindow``: one vector per token like a latent, within a window (a single head that is
  both key and value, DeepSeek-V4's sliding window).
- ``IndexKeys``: one key vector per token (DeepSeek-V3.2's indexer, MiniMax M3's block indexer),
  beside a layer's latent or its K/V.
- ``RecurrentState``: fixed-size tensors per request (linear attention / SSM): one slot, not
  pages.
- ``CompressedEntries``: one vector per ``rate`` tokens (DeepSeek-V4's compressed attention: a
  compressor pools each closed window of ``rate`` tokens into one entry); an entry is kept on the
  logical page where its window closes, so a page of ``page_size >= rate`` tokens holds
  ``page_size / rate`` entries and, below that, one page in ``rate / page_size`` holds one.
- ``CompressorState``: the per-request state a compressor carries between forwards (the tokens
  of the window not yet closed, the overlap slice of the last closed one): a ``RecurrentState``
  that every rank holds whole.

This module is the contract between ``models`` and ``engine``; it imports neither.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import ClassVar, Optional, Sequence

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "uint8": 1}  # uint8: fp8 bits


@dataclass(frozen=True)
class CacheSpec:
    """Base of the specs. ``kind`` names the spec in errors, logs and the transfer layout."""

    kind: ClassVar[str] = ""
    per_request: ClassVar[bool] = False  # one slot per request instead of pages per token
    # items only on some logical pages (0 on the others, by structure: ``holds_item``)
    sparse_pages: ClassVar[bool] = False
    # whether an attention backend reads this kind's pages (a per-request state is its layers'
    # own business, a ``PositionLedger`` holds nothing to read)
    attended: ClassVar[bool] = True

    def page_bytes(self, page_size: int, dtype_bytes: int) -> int:
        """Bytes one page of one layer takes (per-request kinds: one slot of one layer); every
        concrete spec defines it."""
        raise NotImplementedError(f"{type(self).__name__} does not say its page size")

    def first_live_page(self, kv_len: int, page_size: int) -> int:
        """The first page a sequence with ``kv_len`` tokens in the cache still needs for its next
        query (every page before it may be freed)."""
        return 0

    def pages_kept(self, seq_len: int, page_size: int) -> int:
        """Pages a sequence of ``seq_len`` tokens holds once its next token is being computed
        (the page of that token included)."""
        return (seq_len + page_size) // page_size - self.first_live_page(seq_len, page_size)

    def peak_pages(self, seq_len: int, chunk: int, page_size: int) -> int:
        """Most pages one sequence of ``seq_len`` tokens holds at once when prefilled in chunks
        of ``chunk`` tokens."""
        return seq_len // page_size + 1

    @property
    def drops_pages(self) -> bool:
        """Whether a sequence lets go of pages as it grows (a window)."""
        return False

    @property
    def keeps_every_page(self) -> bool:
        """Whether a sequence holds an item on each of its logical pages for its whole life (what
        the anchor, the routed experts' ids and a draft model's KV need)."""
        return not (self.per_request or self.drops_pages or self.sparse_pages)

    def holds_item(self, page: int, page_size: int) -> bool:
        """Whether logical page ``page`` of a sequence has an item of this kind."""
        return True

    def page_share(self, page_size: int) -> float:
        """The share of a long sequence's logical pages that hold an item (what a pool needs per
        logical page, in pages)."""
        return 1.0

    def bytes_per_token(self, dtype_bytes: int) -> float:
        """Bytes one layer keeps per token of a long sequence."""
        return self.page_bytes(1, dtype_bytes)

    def describe(self) -> dict:
        """The fields a peer must agree on (transfer compatibility), with the kind."""
        return {"kind": self.kind, **asdict(self)}

    @property
    def key(self) -> str:
        """How a layer names this cache among its own (``ForwardBatch.layer_caches``): its kind,
        unless the layer may keep two of the kind."""
        return self.kind

    def whole(self, total_kv_heads: int) -> "CacheSpec":
        """The spec of the whole model where this rank holds a share (of the KV heads); kinds
        whose cache every rank holds whole return themselves."""
        return self


@dataclass(frozen=True)
class FullAttention(CacheSpec):
    """Keys and values of ``num_kv_heads`` heads (this rank's) of ``head_dim`` per token."""

    kind: ClassVar[str] = "full_attention"
    num_kv_heads: int
    head_dim: int
    # the whole model's KV heads of these layers where they are not the model's
    # ``total_kv_heads`` (Gemma 4's full layers keep fewer than its windows); 0: the model's
    total_kv_heads: int = field(default=0, kw_only=True)

    def page_bytes(self, page_size: int, dtype_bytes: int) -> int:
        return 2 * self.num_kv_heads * page_size * self.head_dim * dtype_bytes

    def describe(self) -> dict:
        out = super().describe()
        if not self.total_kv_heads:
            del out["total_kv_heads"]  # the model's: nothing more to agree on
        return out

    def whole(self, total_kv_heads: int) -> "CacheSpec":
        return replace(self, num_kv_heads=self.total_kv_heads or total_kv_heads)


class Windowed:
    """What a window does to a per-token spec: a query at position i sees keys i-W < j <= i, so
    a sequence keeps only the pages its next query can still see. Mixed into a spec with a
    ``window`` field."""

    window: int

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(
                f"{self.kind.replace('_', ' ')}: window must be >= 1, got {self.window}"
            )

    def first_live_page(self, kv_len: int, page_size: int) -> int:
        # the next query sits at position kv_len and sees keys kv_len - window + 1 .. kv_len
        return max(0, kv_len - self.window + 1) // page_size

    def peak_pages(self, seq_len: int, chunk: int, page_size: int) -> int:
        # a chunk's queries see back one window from its first token: window + chunk tokens
        return min(seq_len // page_size + 1, (self.window + chunk) // page_size + 2)

    @property
    def drops_pages(self) -> bool:
        return True


@dataclass(frozen=True)
class SlidingWindow(Windowed, FullAttention):
    """Attention within the last ``window`` keys (the query's own included)."""

    kind: ClassVar[str] = "sliding_window"
    window: int = 0


@dataclass(frozen=True)
class ChunkedAttention(FullAttention):
    """Attention within the query's own chunk of ``chunk`` positions: a query at i sees keys
    C*floor(i/C) <= j <= i, so every page before the current chunk's first is of no more use."""

    kind: ClassVar[str] = "chunked_attention"
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.chunk < 1:
            raise ValueError(f"chunked attention: chunk must be >= 1, got {self.chunk}")

    def first_live_page(self, kv_len: int, page_size: int) -> int:
        # the next query sits at position kv_len and sees its chunk from its first position
        return kv_len // self.chunk * self.chunk // page_size

    def peak_pages(self, seq_len: int, chunk: int, page_size: int) -> int:
        # a prefill chunk's queries see back at most to the start of the attention chunk its first
        # token is in: fewer than ``self.chunk`` tokens before it
        return min(seq_len // page_size + 1, (self.chunk + chunk) // page_size + 2)

    @property
    def drops_pages(self) -> bool:
        return True


@dataclass(frozen=True)
class PositionLedger(CacheSpec):
    """Pages without bytes: what a model that keeps no per-token cache (a pure state-space model)
    gives one layer, so that its requests still hold pages that count their positions, as an
    attention cache's would, for the page table, the prefix tree (whose state snapshots hang on
    page boundaries) and PD (which then moves only the state)."""

    kind: ClassVar[str] = "position_ledger"
    attended: ClassVar[bool] = False

    def page_bytes(self, page_size: int, dtype_bytes: int) -> int:
        return 0


@dataclass(frozen=True)
class LatentAttention(CacheSpec):
    """One compressed latent (``latent_dim``) plus its rotary part (``rope_dim``) per token."""

    kind: ClassVar[str] = "latent_attention"
    latent_dim: int
    rope_dim: int

    def page_bytes(self, page_size: int, dtype_bytes: int) -> int:
        return page_size * (self.latent_dim + self.rope_dim) * dtype_bytes


@dataclass(frozen=True)
class LatentWindow(Windowed, LatentAttention):
    """One vector per token, no head axis, seen within the last ``window`` keys: a sliding window
    over a single head that is both key and value (DeepSeek-V4's), kept once."""

    kind: ClassVar[str] = "latent_window"
    window: int = 0


@dataclass(frozen=True)
class IndexKeys(CacheSpec):
    """One key vector (``dim``) per token, no head axis: the sparse-attention indexer's
    (DeepSeek-V3.2, MiniMax M3), a second cache of the same layers as their latents or K/V."""

    kind: ClassVar[str] = "index_keys"
    dim: int

    def page_bytes(self, page_size: int, dtype_bytes: int) -> int:
        return page_size * self.dim * dtype_bytes


@dataclass(frozen=True)
class RecurrentState(CacheSpec):
    """Per-request state tensors of a linear-attention layer (e.g. a convolution window and an
    SSM state): ``parts`` names them, ``shapes`` are this rank's shapes in elements and ``dtypes``
    their element types (float32 in bf16 models, as HF keeps them). A tensor whose axis 0
    concatenates pieces that TP shards separately (a convolution state over the channels of
    x | B | C) lists the pieces' sizes along that axis in ``segments`` (() for one piece). A
    segment made of whole units that ranks do not split (a Mamba2 layer's groups: B and C) gives
    their count in ``pieces`` (0: split evenly); with more ranks than units each rank holds the
    one unit of its heads, as other ranks do (``piece_range``)."""

    kind: ClassVar[str] = "recurrent_state"
    per_request: ClassVar[bool] = True
    region_split: ClassVar[str] = "segments"  # how TP ranks share it (``kv_region.Region``)
    parts: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    segments: tuple[tuple[int, ...], ...] = ()
    pieces: tuple[tuple[int, ...], ...] = ()  # per segment: whole units (0: split evenly)
    ranks: int = 1  # the tensor-parallel ranks whose shares along axis 0 make the whole state

    def describe(self) -> dict:
        """The whole model's state (every rank's share together), which ranks of any TP size
        agree on."""
        w = self.whole(0)
        return {
            "kind": self.kind,
            "parts": list(w.parts),
            "shapes": [list(s) for s in w.shapes],
            "dtypes": list(w.dtypes),
            "segments": [list(s) for s in w.segments],
        }

    def whole(self, total_kv_heads: int) -> "CacheSpec":
        if self.ranks == 1:
            return self
        n = self.ranks
        segments = tuple(
            tuple(x // held(k, n) * k if k else x * n for x, k in zip(seg, units))
            for seg, units in zip(self.segments, self.part_pieces())
        )
        shapes = tuple(
            (sum(seg) if seg else s[0] * n, *s[1:])
            for s, seg in zip(self.shapes, segments + ((),) * len(self.shapes))
        )
        return replace(self, shapes=shapes, segments=segments, ranks=1)

    def part_pieces(self) -> tuple[tuple[int, ...], ...]:
        """``pieces`` of every segment of every part (0 where undeclared)."""
        return tuple(
            tuple(self.pieces[i]) if i < len(self.pieces) and self.pieces[i] else (0,) * len(seg)
            for i, seg in enumerate(self.segments)
        )

    def segment_pieces(self, i: int) -> tuple[int, ...]:
        """``pieces`` of part ``i``'s segments as ``segment_bytes`` lists them."""
        units = self.part_pieces()
        return units[i] if i < len(units) and units[i] else (0,) * len(self.segment_bytes(i))

    def __post_init__(self) -> None:
        if not len(self.parts) == len(self.shapes) == len(self.dtypes):
            raise ValueError(
                f"recurrent state: {len(self.parts)} parts, {len(self.shapes)} shapes and "
                f"{len(self.dtypes)} dtypes"
            )
        bad = [d for d in self.dtypes if d not in DTYPE_BYTES]
        if bad:
            raise ValueError(f"recurrent state: dtypes {bad} are not among {sorted(DTYPE_BYTES)}")
        for i, seg in enumerate(self.segments):
            if seg and sum(seg) != self.shapes[i][0]:
                raise ValueError(
                    f"recurrent state {self.parts[i]!r}: segments {list(seg)} do not add up to "
                    f"axis 0 of {self.shapes[i]}"
                )

    def part_bytes(self, i: int) -> int:
        """Bytes of tensor ``i`` of one request."""
        n = DTYPE_BYTES[self.dtypes[i]]
        for s in self.shapes[i]:
            n *= s
        return n

    def segment_bytes(self, i: int) -> tuple[int, ...]:
        """The bytes of each piece of tensor ``i`` along its axis 0 (one piece when undeclared)."""
        rows = self.segments[i] if i < len(self.segments) and self.segments[i] else None
        if rows is None:
            return (self.part_bytes(i),)
        row = self.part_bytes(i) // self.shapes[i][0]
        return tuple(r * row for r in rows)

    def page_bytes(self, page_size: int, dtype_bytes: int) -> int:
        return sum(self.part_bytes(i) for i in range(len(self.parts)))

    def pages_kept(self, seq_len: int, page_size: int) -> int:
        return 0

    def peak_pages(self, seq_len: int, chunk: int, page_size: int) -> int:
        return 0


@dataclass(frozen=True)
class CompressedEntries(CacheSpec):
    """One ``dim``-vector per closed window of ``rate`` tokens, no head axis (every rank of an
    attention group holds them whole). ``part`` tells apart the entries of two compressors of the
    same layers (a compressor's ``"kv"`` and an indexer's ``"index_k"``), which may agree on
    ``dim`` and ``rate``. Entry e covers tokens ``e * rate .. (e + 1) * rate - 1`` and lives on the
    logical page of its last token, at slot ``e % entries_per_page``: a page holds only closed
    windows' entries, so it is final when the page is full, as a full-attention page is."""

    kind: ClassVar[str] = "compressed"
    sparse_pages: ClassVar[bool] = True
    dim: int
    rate: int
    part: str = "kv"

    def __post_init__(self) -> None:
        if self.rate < 1 or self.dim < 1:
            raise ValueError(
                f"compressed entries {self.part!r}: rate and dim must be >= 1, got rate "
                f"{self.rate}, dim {self.dim}"
            )

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.part}"  # a layer keeps a compressor's and an indexer's

    def check_page_size(self, page_size: int) -> None:
        """A page holds whole windows, or a window whole pages: refuse other page sizes."""
        if page_size % self.rate and self.rate % page_size:
            raise ValueError(
                f"page_size: {page_size} tokens and a compress rate of {self.rate} "
                f"(compressed entries {self.part!r}): one must divide the other, so that a "
                "window's entry lands on one page; choose a page_size that is a power of two"
            )

    def entries_per_page(self, page_size: int) -> int:
        return max(1, page_size // self.rate)

    def holds_item(self, page: int, page_size: int) -> bool:
        # a window closes on this page: its last token ((e + 1) * rate - 1) lies in it
        return ((page + 1) * page_size) // self.rate > (page * page_size) // self.rate

    def entry_location(self, entry, page_size: int):
        """(logical page, slot in the page) of entry ``entry`` (an int, or a tensor of them)."""
        return ((entry + 1) * self.rate - 1) // page_size, entry % self.entries_per_page(page_size)

    def items_between(self, first: int, end: int, page_size: int) -> int:
        """Items on logical pages ``first .. end - 1``."""
        if end <= first:
            return 0
        if page_size >= self.rate:
            return end - first
        span = self.rate // page_size  # logical pages per window; the last one holds the item
        return end // span - first // span

    def page_bytes(self, page_size: int, dtype_bytes: int) -> int:
        return self.entries_per_page(page_size) * self.dim * dtype_bytes

    def page_share(self, page_size: int) -> float:
        return min(1.0, page_size / self.rate)

    def bytes_per_token(self, dtype_bytes: int) -> float:
        return self.dim * dtype_bytes / self.rate

    def peak_pages(self, seq_len: int, chunk: int, page_size: int) -> int:
        return self.items_between(0, seq_len // page_size + 1, page_size)


@dataclass(frozen=True)
class CompressorState(RecurrentState):
    """A compressor's state between forwards, per request (``RecurrentState``'s tensors): the
    projected tokens of the window not yet closed and, where windows overlap, the slice of the
    last closed one that the next entry reads. Every rank holds it whole (its compressor is not
    split by TP), so its regions are replicated."""

    kind: ClassVar[str] = "compressor_state"
    region_split: ClassVar[str] = "replicated"


@dataclass(frozen=True)
class CacheGroup:
    """Layers that share one spec, one pool and one index space. ``layers``: the model's layer
    ids (global, ascending); a layer's slot in the group's pool is its index in ``layers``."""

    id: int
    spec: CacheSpec
    layers: tuple[int, ...]

    @property
    def kind(self) -> str:
        return self.spec.kind

    def describe(self) -> dict:
        return {"id": self.id, "layers": list(self.layers), **self.spec.describe()}


def piece_range(pieces: int, ranks: int, rank: int) -> tuple[int, int]:
    """The units [start, end) of a segment of ``pieces`` whole units (``RecurrentState.pieces``)
    that rank ``rank`` of ``ranks`` holds: an even share when the ranks divide them, else the one
    unit its heads read (the ranks a multiple of the units)."""
    if pieces % ranks == 0:
        n = pieces // ranks
        return rank * n, (rank + 1) * n
    if ranks % pieces == 0:
        unit = rank // (ranks // pieces)
        return unit, unit + 1
    raise ValueError(f"{ranks} ranks can neither split {pieces} whole units nor share them")


def held(pieces: int, ranks: int) -> int:
    """Units of a segment of ``pieces`` that one rank of ``ranks`` holds."""
    start, end = piece_range(pieces, ranks, 0)
    return end - start


def specs_of(entry) -> tuple[CacheSpec, ...]:
    """The specs of one layer's entry in ``kv_cache_specs``: a spec, a tuple of them, or None or
    an empty tuple (a layer that keeps no cache, e.g. an MLP-only layer)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def group_layers(specs: Sequence, first_layer: int = 0) -> list[CacheGroup]:
    """Group layers ``first_layer, first_layer + 1, ...`` by equal spec, paged kinds in order of
    first use and then the per-request kinds (so the first group is paged whatever layer 0
    keeps); ``specs[i]`` is layer i's entry (``specs_of``: a layer may be in no group or in
    several)."""
    order: list[CacheSpec] = []
    members: dict[CacheSpec, list[int]] = {}
    for i, entry in enumerate(specs):
        for spec in specs_of(entry):
            if spec not in members:
                order.append(spec)
                members[spec] = []
            members[spec].append(first_layer + i)
    order.sort(key=lambda spec: spec.per_request)  # stable: first use within each part
    return [CacheGroup(g, spec, tuple(members[spec])) for g, spec in enumerate(order)]


def anchor_group(groups: Sequence[CacheGroup]) -> int:
    """The anchor group: the first paged one with an item on every logical page (a per-token
    cache), whose pages count a request's logical pages and whose pool's page size, device and
    dtype stand for the model's cache."""
    for g in groups:
        if not g.spec.per_request and not g.spec.sparse_pages:
            return g.id
    raise ValueError(
        "the model keeps no per-token cache (cache groups: "
        f"{', '.join(g.kind for g in groups) or 'none'}); pages need one paged group to count them"
    )


def transfer_bytes_per_token(
    groups: Sequence[CacheGroup], total_kv_heads: int, dtype_bytes: int
) -> int:
    """Bytes the cache of ``groups`` takes per prompt token, counting each byte once however many
    ranks hold it (a KV head replicated over TP ranks, a latent every rank holds): what PD moves
    per token of a long prompt. Windows are left out when another group keeps every page (a long
    prompt sends only a window's last pages), per-request state always (it is per request)."""
    paged = [g for g in groups if not g.spec.per_request]
    kept = [g for g in paged if not g.spec.drops_pages] or paged
    return round(
        sum(g.spec.whole(total_kv_heads).bytes_per_token(dtype_bytes) * len(g.layers) for g in kept)
    )


def state_bytes_per_request(groups: Sequence[CacheGroup]) -> int:
    """Bytes of the per-request state of ``groups`` (a recurrent state's whole tensors, every
    rank's share once, each in its own dtype): what PD moves per request whatever its length."""
    return sum(
        g.spec.whole(0).page_bytes(1, 0) * len(g.layers) for g in groups if g.spec.per_request
    )


def layer_window(spec: CacheSpec) -> Optional[int]:
    return spec.window if isinstance(spec, Windowed) else None
