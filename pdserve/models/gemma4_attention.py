"""Gemma 4's attention (``gemma4.py``): each layer kind's own ``head_dim`` and KV heads (the
configuration's per-layer view), q/k/v norms and RoPE, keys doubling as values
(``attention_k_eq_v``), and the KV-shared layers, which compute queries only and attend over the
cache of an earlier layer (``kv_sources``). Each attention loads its own weights: its heads' rows
of its kind's sizes."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from pdserve.distributed import kv_heads_for_rank, shard_range
from pdserve.forward_batch import ForwardBatch
from pdserve.layers.attention.base import AttnLayer
from pdserve.layers.linear import Linear, MergedLinear, RowParallelLinear
from pdserve.layers.norm import Gemma4RMSNorm
from pdserve.layers.rotary import apply_rotary
from pdserve.models.weights import TPShards

SLIDING = "sliding_attention"


def layer_config(config, layer_id: int):
    """Layer ``layer_id``'s configuration (the per-layer view where the layers differ)."""
    return config.per_layer_config[layer_id] if config.is_heterogeneous else config


def kv_sources(config) -> list[Optional[int]]:
    """Per layer, the layer whose cache it reads instead of keeping one (the last layer of its
    kind before the shared ones), or None."""
    n, shared = config.num_hidden_layers, config.num_kv_shared_layers or 0
    first = n - shared
    if not 0 <= shared < n:
        raise ValueError(f"num_kv_shared_layers: {shared} of {n} layers; fewer than all expected")
    kinds, out = config.layer_types, []
    for i in range(n):
        own = [j for j in range(first) if kinds[j] == kinds[i]]
        if i >= first and not own:
            raise ValueError(
                f"num_kv_shared_layers: layer {i} ({kinds[i]}) would read the cache of an earlier "
                f"{kinds[i]} layer, and layers 0..{first - 1} have none"
            )
        out.append(own[-1] if i >= first else None)
        if out[-1] is not None:
            mine, theirs = layer_config(config, i), layer_config(config, out[-1])
            shape = (mine.head_dim, mine.num_key_value_heads)
            if shape != (theirs.head_dim, theirs.num_key_value_heads):
                raise ValueError(
                    f"per_layer_config: layer {i} reads the cache of layer {out[-1]}, whose "
                    f"(head_dim, KV heads) {(theirs.head_dim, theirs.num_key_value_heads)} are "
                    f"not its own {shape}"
                )
    return out


class Gemma4Attention(nn.Module):
    """One layer's attention. ``source``: the layer whose cache a KV-shared layer reads (None: its
    own); ``feeds``: whether a later layer reads this one's cache (it then leaves this forward's
    keys and values in ``stored``). Loads its own weights (its heads' rows, this kind's sizes)."""

    def __init__(self, config, layer_id: int, shards: TPShards, source: Optional[int], feeds: bool):
        super().__init__()
        own = layer_config(config, layer_id)
        self.layer_id, self.kind = layer_id, config.layer_types[layer_id]
        self.source, self.feeds = source, feeds
        heads, kv, tp = config.num_attention_heads, own.num_key_value_heads, shards.attn
        try:
            self.heads = shard_range(heads, tp.rank, tp.size)
            self.kv_heads = kv_heads_for_rank(kv, heads, tp.rank, tp.size)
        except ValueError as e:
            raise ValueError(
                f"tp_size: {e} (layer {layer_id}: {heads} heads, {kv} KV heads)"
            ) from None
        self.total_kv_heads, self.head_dim = kv, own.head_dim
        self.num_heads = self.heads[1] - self.heads[0]
        self.num_kv_heads = self.kv_heads[1] - self.kv_heads[0]
        self.window = config.sliding_window if self.kind == SLIDING else None
        self.keys_are_values = bool(config.attention_k_eq_v) and self.kind != SLIDING
        self.bias = bool(config.attention_bias)
        hidden, eps, d = config.hidden_size, config.rms_norm_eps, self.head_dim
        q, kvs = self.num_heads * d, self.num_kv_heads * d
        if source is None:
            sizes = [q, kvs] if self.keys_are_values else [q, kvs, kvs]
            self.qkv_proj = MergedLinear(hidden, sizes, bias=self.bias)
            self.k_norm = Gemma4RMSNorm(d, eps)
            self.v_norm = Gemma4RMSNorm(d, eps, scale=False)
        else:
            self.q_proj = Linear(hidden, q, bias=self.bias)
        self.q_norm = Gemma4RMSNorm(d, eps)
        self.o_proj = RowParallelLinear(q, hidden, bias=self.bias, tp=tp)
        cache_layer = (layer_id if source is None else source) - shards.layers[0]
        self.attn = AttnLayer(cache_layer, 1.0, self.window, stores_kv=source is None)

    def forward(self, h: torch.Tensor, rope, fb: ForwardBatch, stored: dict) -> torch.Tensor:
        t, d = h.shape[0], self.head_dim
        cos, sin = rope
        if self.source is None:
            q, k, *v = self.qkv_proj.split(self.qkv_proj(h))
            k = k.view(t, self.num_kv_heads, d)
            v = self.v_norm(v[0].view(t, self.num_kv_heads, d) if v else k)  # k_eq_v: the keys
            k = apply_rotary(self.k_norm(k), cos, sin)
            if self.feeds:
                stored[self.layer_id] = (k, v)
        else:
            q = self.q_proj(h)
            k, v = stored[self.source]
        q = apply_rotary(self.q_norm(q.view(t, self.num_heads, d)), cos, sin)
        o = fb.attn_backend.forward(self.attn, q, k, v, fb)
        return self.o_proj(o.reshape(t, self.num_heads * d))

    # ---- weights -------------------------------------------------------------------------------
    def checkpoint_names(self) -> list[str]:
        projs = ["q_proj", "o_proj"]
        if self.source is None:
            projs += ["k_proj"] if self.keys_are_values else ["k_proj", "v_proj"]
        names = [f"{p}.weight" for p in projs] + [f"{p}.bias" for p in projs if self.bias]
        return names + ["q_norm.weight"] + (["k_norm.weight"] if self.source is None else [])

    def load_checkpoint(self, name: str, src: Any) -> None:
        proj, _, leaf = name.partition(".")
        if self.source is not None and proj in ("k_proj", "v_proj", "k_norm", "v_norm"):
            return  # a KV-shared layer's unused projections, which checkpoints may hold
        if name not in self.checkpoint_names():
            raise ValueError(f"unexpected attention weight {name!r}")
        d, (h0, h1), (k0, k1) = self.head_dim, self.heads, self.kv_heads
        if proj in ("q_norm", "k_norm"):
            target, part = getattr(self, proj).weight, src[:]
        elif proj == "o_proj":
            target = getattr(self.o_proj, leaf)
            part = src[:, h0 * d : h1 * d] if leaf == "weight" else src[:]
        elif self.source is not None:  # q_proj of a KV-shared layer
            target, part = getattr(self.q_proj, leaf), src[h0 * d : h1 * d]
        else:
            index = ("q_proj", "k_proj", "v_proj").index(proj)
            rows = (h0 * d, h1 * d) if proj == "q_proj" else (k0 * d, k1 * d)
            return self.qkv_proj.load_shard(index, leaf, src[rows[0] : rows[1]])
        if tuple(target.shape) != tuple(part.shape):
            raise ValueError(
                f"{name}: expected shape {tuple(target.shape)}, got {tuple(part.shape)}"
            )
        target.data.copy_(part)
