"""Cache specs: what one layer keeps per token (or per request), declared by the model.

A model returns the specs of each layer it runs (``CausalLM.kv_cache_specs``: one, or a tuple when a
layer keeps several caches); layers with equal specs form a ``CacheGroup`` (``group_layers``; a
layer of several caches is in several groups), and each group gets its own pool and page allocator
(``engine/kv_cache.py``). Everything that sizes, allocates or transfers the cache reads these
specs, never the model's shapes:

- ``FullAttention``: K and V per token per KV head; a sequence keeps every page.
- ``SlidingWindow``: the same per token, but a query at position i sees keys i-W < j <= i, so a
  sequence keeps only the pages that the next query can still see (``first_live_page``).
- ``LatentAttention``: one latent vector per token (MLA): no head axis, replicated over
  attention TP.
- ``IndexKeys``: one key vector per token (DeepSeek-V3.2's indexer), beside a layer's latent.
- ``RecurrentState``: fixed-size tensors per request (linear attention / SSM): one slot, not
  pages.

This module is the contract between ``models`` and ``engine``; it imports neither.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import ClassVar, Optional, Sequence

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class CacheSpec:
    """Base of the specs. ``kind`` names the spec in errors, logs and the transfer layout."""

    kind: ClassVar[str] = ""
    per_request: ClassVar[bool] = False  # one slot per request instead of pages per token

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

    def describe(self) -> dict:
        """The fields a peer must agree on (transfer compatibility), with the kind."""
        return {"kind": self.kind, **asdict(self)}

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

    def page_bytes(self, page_size: int, dtype_bytes: int) -> int:
        return 2 * self.num_kv_heads * page_size * self.head_dim * dtype_bytes

    def whole(self, total_kv_heads: int) -> "CacheSpec":
        return replace(self, num_kv_heads=total_kv_heads)


@dataclass(frozen=True)
class SlidingWindow(FullAttention):
    """Attention within the last ``window`` keys (the query's own included)."""

    kind: ClassVar[str] = "sliding_window"
    window: int = 0

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"sliding window: must be >= 1, got {self.window}")

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
class LatentAttention(CacheSpec):
    """One compressed latent (``latent_dim``) plus its rotary part (``rope_dim``) per token."""

    kind: ClassVar[str] = "latent_attention"
    latent_dim: int
    rope_dim: int

    def page_bytes(self, page_size: int, dtype_bytes: int) -> int:
        return page_size * (self.latent_dim + self.rope_dim) * dtype_bytes


@dataclass(frozen=True)
class IndexKeys(CacheSpec):
    """One key vector (``dim``) per token, no head axis: the sparse-attention indexer's
    (DeepSeek-V3.2), a second cache of the same layers as their latents."""

    kind: ClassVar[str] = "index_keys"
    dim: int

    def page_bytes(self, page_size: int, dtype_bytes: int) -> int:
        return page_size * self.dim * dtype_bytes


@dataclass(frozen=True)
class RecurrentState(CacheSpec):
    """Per-request state tensors (e.g. a convolution window and an SSM state), ``shapes`` per
    layer in elements, each of ``dtype_bytes_each``."""

    kind: ClassVar[str] = "recurrent_state"
    per_request: ClassVar[bool] = True
    shapes: tuple[tuple[int, ...], ...]
    dtype_bytes_each: tuple[int, ...]

    def page_bytes(self, page_size: int, dtype_bytes: int) -> int:
        total = 0
        for shape, nbytes in zip(self.shapes, self.dtype_bytes_each):
            n = nbytes
            for s in shape:
                n *= s
            total += n
        return total

    def pages_kept(self, seq_len: int, page_size: int) -> int:
        return 0

    def peak_pages(self, seq_len: int, chunk: int, page_size: int) -> int:
        return 0


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


def specs_of(entry) -> tuple[CacheSpec, ...]:
    """The specs of one layer's entry in ``kv_cache_specs``: a spec, or a tuple of them."""
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def group_layers(specs: Sequence, first_layer: int = 0) -> list[CacheGroup]:
    """Group layers ``first_layer, first_layer + 1, ...`` by equal spec, in order of first use;
    ``specs[i]`` is layer i's spec or tuple of specs (a layer in several groups)."""
    order: list[CacheSpec] = []
    members: dict[CacheSpec, list[int]] = {}
    for i, entry in enumerate(specs):
        for spec in specs_of(entry):
            if spec not in members:
                order.append(spec)
                members[spec] = []
            members[spec].append(first_layer + i)
    return [CacheGroup(g, spec, tuple(members[spec])) for g, spec in enumerate(order)]


def transfer_bytes_per_token(
    groups: Sequence[CacheGroup], total_kv_heads: int, dtype_bytes: int
) -> int:
    """Bytes the cache of ``groups`` takes per prompt token, counting each byte once however many
    ranks hold it (a KV head replicated over TP ranks, a latent every rank holds): what PD moves
    per token of a long prompt. Windows are left out when another group keeps every page (a long
    prompt sends only a window's last pages), per-request state always (it is per request)."""
    paged = [g for g in groups if not g.spec.per_request]
    kept = [g for g in paged if not g.spec.drops_pages] or paged
    return sum(
        g.spec.whole(total_kv_heads).page_bytes(1, dtype_bytes) * len(g.layers) for g in kept
    )


def layer_window(spec: CacheSpec) -> Optional[int]:
    return spec.window if isinstance(spec, SlidingWindow) else None
