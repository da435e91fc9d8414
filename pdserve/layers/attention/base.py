"""Attention backends: attention of new tokens against the paged KV cache.

A backend stores the new tokens' K/V in their layer's pool (``ForwardBatch.kv``) and attends each
new token to its request's prefix plus the new tokens before it (causal), within the layer's
sliding window if it has one, with the layer's logit soft-capping and attention sinks if it has
them.

Each backend declares the cache kinds (``kv_spec`` kinds) and layer features it supports;
``check_supported`` turns an unsupported combination into a start-up error that names both,
never a failure in the middle of a request.
"""

from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Iterable, Optional

import torch

if TYPE_CHECKING:
    from pdserve.forward_batch import ForwardBatch

_REGISTRY = {
    "torch": ("pdserve.layers.attention.torch_backend", "TorchAttnBackend"),
    "cpu": ("pdserve.layers.attention.cpu_backend", "CpuAttnBackend"),
}


@dataclass(frozen=True)
class AttnLayer:
    """What a backend needs to know of one attention layer.

    ``layer_id``: the layer's index in this stage (0 = the stage's first layer), which is how
    ``ForwardBatch`` finds its cache group and pool slot. ``sliding_window``: query i sees keys
    i-W < j <= i. ``attention_chunk``: query i sees the keys of its own chunk of C positions,
    C*floor(i/C) <= j <= i (Llama 4's local layers; a layer has a window or a chunk, not both).
    ``logit_softcap``: scores become ``cap * tanh(scores / cap)`` before the mask (Gemma 2).
    ``has_sinks``: each query head has a learned sink logit (GPT-OSS): its softmax runs
    over the visible keys' scaled, masked scores plus one more column holding the sink, and that
    column is then dropped, so the sink only adds ``exp(sink)`` to the denominator (no value, no
    KV). The sink values are the model's parameter, passed to ``AttentionBackend.forward`` at each
    call (they are loaded after this descriptor is made). ``stores_kv`` False: a layer that reads
    another layer's cache (Gemma 4's KV-shared layers: ``layer_id`` is that layer's, and the
    k/v passed are the ones it stored in this forward), which the backend attends without
    writing. ``key_masked``: its queries see only the keys a ``KeyMask`` passed at each call lets
    through (block-sparse attention)."""

    layer_id: int
    scale: float
    sliding_window: Optional[int] = None
    logit_softcap: Optional[float] = None
    has_sinks: bool = False
    stores_kv: bool = True
    key_masked: bool = False
    attention_chunk: Optional[int] = None

    def __post_init__(self) -> None:
        if self.sliding_window and self.attention_chunk:
            raise ValueError(
                f"layer {self.layer_id}: a sliding window and an attention chunk at once"
            )

    @property
    def span(self) -> Optional[int]:
        """The keys a query sees besides causality, as the kernels take it: W > 0 a sliding
        window of W keys, -C an attention chunk of C positions, None every earlier key."""
        if self.sliding_window:
            return self.sliding_window
        return -self.attention_chunk if self.attention_chunk else None


# layer feature -> (the backend flag that says it is supported, whether a layer has it)
_FEATURES = {
    "attention logit soft-capping": ("supports_softcap", lambda layer: bool(layer.logit_softcap)),
    "attention sinks": ("supports_sinks", lambda layer: layer.has_sinks),
}


class KeyMask(abc.ABC):
    """Which keys each new token may see, per KV head, on top of the causal (and window) rule:
    block-sparse attention chooses its keys per KV head (``block_select.BlockSelection``). Key j
    is the j-th token of the token's own sequence (its position); the query heads of a KV head
    share its row."""

    @abc.abstractmethod
    def rows(self, tokens: torch.Tensor, width: int) -> torch.Tensor:
        """[len(tokens), kv_heads, width] bool (True: may attend) for the flattened new tokens
        ``tokens`` over keys 0 .. width - 1 (keys past a token's sequence may be True: the
        backend's own mask hides them)."""


class AttentionBackend(abc.ABC):
    """Contract: ``forward`` is called once per layer per forward, from the scheduler thread only.

    ``q``: [T, num_heads, head_dim]; ``k``/``v``: [T, kv_heads, head_dim] for the flattened new
    tokens of ``fb``. It must write k/v into the layer's pool at its group's ``out_pages`` and
    ``fb.out_offsets`` (unless ``layer.stores_kv`` is False) and return [T, num_heads, head_dim].
    ``sinks``: [num_heads] (this rank's heads, any float dtype) exactly when ``layer.has_sinks``,
    else None. ``key_mask`` (a ``KeyMask`` over this rank's KV heads, or None): the keys each
    token sees per KV head, besides causality; query head h belongs to KV head
    ``h // (num_heads / kv_heads)``.
    """

    name: ClassVar[str] = ""
    cache_kinds: ClassVar[frozenset[str]] = frozenset(
        {"full_attention", "sliding_window", "chunked_attention"}
    )
    supports_softcap: ClassVar[bool] = True
    supports_sinks: ClassVar[bool] = True

    def init_forward(self, fb: "ForwardBatch") -> None:
        """Precompute per-forward metadata shared by all layers (optional)."""

    def drop_forward_state(self) -> None:
        """Forget the last forward's batch, which holds the KV pools (a role switch reallocates
        them: the old ones must not stay alive here); ``init_forward`` sets it again."""
        self._fb = None

    @abc.abstractmethod
    def forward(
        self,
        layer: AttnLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        fb: "ForwardBatch",
        sinks: Optional[torch.Tensor] = None,
        key_mask: Optional[KeyMask] = None,
    ) -> torch.Tensor: ...

    def forward_latent(
        self,
        layer: AttnLayer,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        fb: "ForwardBatch",
        w_kc: torch.Tensor,
        w_vc: torch.Tensor,
        selection: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> torch.Tensor:
        """Latent attention (MLA) of a ``latent_attention`` layer. ``q_nope`` [T, H, N] and
        ``q_rope`` [T, H, r] (rotated): the query's two parts; ``latent`` [T, R + r]: the new
        tokens' compressed latent (normalised) and rotated key part, which this call stores;
        ``w_kc`` [H, N, R] and ``w_vc`` [H, V, R]: the key and value up-projections of this
        rank's heads. Key j of head h is ``[w_kc[h] @ c_j, k_rope_j]``, its value ``w_vc[h] @
        c_j``; returns [T, H, V]. A backend may attend in the decompressed form (the keys and
        values built per head) or the absorbed one (``w_kc`` folded into the query, attention over
        the latents as one shared head of R + r dims whose values are their first R, ``w_vc``
        applied after), which agree up to rounding. ``selection`` (sparse attention, from
        ``index_select``): each row attends to its listed positions only."""
        raise NotImplementedError(f"attention backend {self.name!r} has no latent attention")

    def forward_window_kv(
        self,
        layer: AttnLayer,
        q: torch.Tensor,
        kv: torch.Tensor,
        fb: "ForwardBatch",
        sinks: torch.Tensor,
        extra: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None,
    ) -> torch.Tensor:
        """Attention of a ``latent_window`` layer (DeepSeek-V4's): one head that is both key and
        value. ``q`` [T, H, D] (rotated); ``kv`` [T, D]: the new tokens' key-and-value, which this
        call stores in the layer's window; each token attends to the last ``sliding_window``
        keys (its own included) and, with ``extra``, to the further keys of its request
        (``extra[i]``: keys [n, D], which are their own values, and [extend, n] bool saying
        which each new token sees: a compressor's entries), all with the layer's sinks. Returns
        [T, H, D]."""
        raise NotImplementedError(f"attention backend {self.name!r} has no window over one head")

    def index_select(
        self,
        layer: AttnLayer,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        fb: "ForwardBatch",
        topk: int,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3.2's lightning indexer for a latent layer with an indexer cache: stores the
        new tokens' ``keys`` [T, D] and returns, per new token, the positions it attends to:
        (positions [T, topk] int32, ascending, counts [T] int32 = min(topk, the keys it sees)).
        A key's score for query row t is ``sum_h weights[t, h] * relu(scale * q[t, h] . key)``
        (``q`` [T, H, D], ``weights`` [T, H], float32); the ``topk`` highest are chosen, the
        lowest position first among equal scores, so chunking, PD and decode choose alike."""
        raise NotImplementedError(
            f"attention backend {self.name!r} has no sparse-attention indexer"
        )

    def index_select_blocks(
        self,
        layer: AttnLayer,
        q: torch.Tensor,
        keys: torch.Tensor,
        fb: "ForwardBatch",
        block_size: int,
        topk: int,
        local: int,
    ) -> KeyMask:
        """The block indexer of block-sparse attention (MiniMax M3) for a layer with an indexer
        cache: stores the new tokens' ``keys`` [T, D] and returns which blocks of
        ``block_size`` keys (block b: positions b * block_size ..) each new token's KV head h
        sees. Query t scores the keys up to its position with ``q[t, h] . key`` (``q`` [T, H, D],
        H the model's KV heads, in float32); a block scores its best key; the ``local`` blocks
        ending at the query's own are always kept, then the best-scoring ones until ``topk``
        blocks, the lower block first among equal scores, so chunking, PD and decode choose
        alike."""
        raise NotImplementedError(f"attention backend {self.name!r} has no block indexer")

    @classmethod
    def missing_features(cls, layers: Iterable[AttnLayer]) -> list[str]:
        """The layer features of ``layers`` this backend does not support (``auto`` chooses a
        backend by this; ``check_supported`` refuses it)."""
        layers = list(layers)
        return [
            feature
            for feature, (flag, has) in _FEATURES.items()
            if not getattr(cls, flag) and any(has(layer) for layer in layers)
        ]

    def check_supported(
        self, cache_kinds: Iterable[str], layers: Iterable[AttnLayer], model: str
    ) -> None:
        """Raise ``ValueError`` naming the model's cache kind or layer feature this backend
        lacks."""
        missing = sorted(set(cache_kinds) - self.cache_kinds)
        if missing:
            raise ValueError(
                f"attention_backend: {self.name!r} does not support the cache kind(s) {missing} "
                f"of {model}; it supports {sorted(self.cache_kinds)}"
            )
        lacking = self.missing_features(layers)
        if lacking:
            raise ValueError(
                f"attention_backend: {self.name!r} does not support the {' and '.join(lacking)} "
                f"of {model}"
            )


def attention_backend_class(name: str) -> type[AttentionBackend]:
    if name not in _REGISTRY:
        raise ValueError(f"attention_backend: unknown {name!r}; available: {sorted(_REGISTRY)}")
    module, cls = _REGISTRY[name]
    return getattr(importlib.import_module(module), cls)


def get_attention_backend(name: str, **kwargs) -> AttentionBackend:
    return attention_backend_class(name)(**kwargs)
