"""Rotary position embedding (rotate-half convention) with ``default``, ``linear``, ``llama3``,
``yarn``, ``longrope`` and ``proportional`` frequency scaling.

HF configs describe RoPE in two ways: transformers 4 writes ``rope_theta`` plus an optional
``rope_scaling`` dict (type under ``type`` or ``rope_type``); transformers 5 writes one
``rope_parameters`` dict that also holds ``rope_theta``. ``rope_parameters()`` turns either into the
transformers 5 form, which is what ``RotaryEmbedding`` takes.

The frequencies, and YaRN's attention factor (which multiplies cos and sin), are computed with the
same float32 and float64 steps as transformers' ``modeling_rope_utils``, so the tables match HF's
bit for bit. GPT-OSS rotates the two halves of each head (``torch.chunk(x, 2)``): the rotate-half
convention, with the same products and sums.

LongRoPE (Phi-3 128k, Phi-4-mini; ``su`` in older configs) has two sets of frequencies: the short
ones while a sequence fits the original context, the long ones for the whole sequence once it is
longer. HF's Phi-3 computes a prompt longer than the original context with the long set, and when
a shorter sequence grows past that length while decoding it drops its cache and recomputes every
token with the long set. ``LongRopeEmbedding`` keeps that rule per request, whatever the batching
and chunking: a request's tokens use the long set when its whole sequence (``full_lens``) is longer
than the original context. The two sets give different KV for the same tokens, so the prefix
cache keeps them in two namespaces (``variant``, the model's ``prefix_namespace``), and a request
whose KV is of the short set when its sequence passes the length is recomputed (the scheduler's
``recompute``), as HF does.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

# rope_type -> fields it needs besides rope_theta
_ROPE_FIELDS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    # also beta_fast, beta_slow, truncate, mscale, mscale_all_dim, attention_factor (all optional)
    "yarn": ("factor", "original_max_position_embeddings"),
    # also factor (default: max_position_embeddings / original) and attention_factor
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    # also partial_rotary_factor and factor (both default 1): Gemma 4's full-attention layers
    "proportional": (),
}
# older names HF still reads
_ROPE_ALIASES = {"su": "longrope", "mrope": "default"}
SUPPORTED_ROPE_TYPES = tuple(_ROPE_FIELDS)
DEFAULT_ROPE_THETA = 10000.0


def _field(config: Any, name: str) -> Any:
    if isinstance(config, dict):
        return config.get(name)
    return getattr(config, name, None)


def rope_parameters(config: Any) -> dict:
    """Normalised RoPE settings of an HF config (object or dict): a dict with ``rope_type``,
    ``rope_theta`` and the scaling fields of that type."""
    params = _field(config, "rope_parameters")
    if params and any(isinstance(v, dict) for v in params.values()):
        raise ValueError(
            f"rope_parameters: per-layer-type RoPE settings are not supported: {params}"
        )
    out = dict(params or {})
    # transformers 4 fields fill what rope_parameters does not say
    for key, value in (_field(config, "rope_scaling") or {}).items():
        out.setdefault(key, value)
    if "type" in out:
        out.setdefault("rope_type", out.pop("type"))
    out.setdefault("rope_type", "default")
    out["rope_type"] = _ROPE_ALIASES.get(out["rope_type"], out["rope_type"])
    if out.get("rope_theta") is None:
        theta = _field(config, "rope_theta")
        out["rope_theta"] = float(theta) if theta is not None else DEFAULT_ROPE_THETA
    if out["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type: {out['rope_type']!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    if out["rope_type"] in ("llama3", "yarn", "longrope"):
        # as transformers' standardize_rope_params: the config's own field wins, else the model's
        # length
        original = _field(config, "original_max_position_embeddings")
        if original is not None:
            out["original_max_position_embeddings"] = original
        elif out.get("original_max_position_embeddings") is None:
            out["original_max_position_embeddings"] = _field(config, "max_position_embeddings")
    if out["rope_type"] == "yarn" and out.get("factor") is None:
        longest = _field(
            config, "max_position_embeddings"
        )  # DeepSeek-V3 style: the context's growth
        if longest is not None and out.get("original_max_position_embeddings"):
            out["factor"] = longest / out["original_max_position_embeddings"]
    if out["rope_type"] == "longrope" and out.get("factor") is None:
        # Phi-3: the ratio of the two lengths, not a field of its own
        longest = _field(config, "max_position_embeddings")
        if longest is not None and out.get("original_max_position_embeddings"):
            out["factor"] = longest / out["original_max_position_embeddings"]
    missing = [f for f in _ROPE_FIELDS[out["rope_type"]] if out.get(f) is None]
    if missing:
        raise ValueError(
            f"rope_parameters: rope_type {out['rope_type']!r} needs {missing}; got {out}"
        )
    return out


def inv_frequencies(head_dim: int, params: dict, long: bool = False) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies after scaling (LongRoPE: the short set, or
    the long one with ``long``)."""
    if params["rope_type"] == "longrope":
        factors = params["long_factor" if long else "short_factor"]
        if len(factors) != head_dim // 2:
            raise ValueError(
                f"rope_parameters: {'long' if long else 'short'}_factor has {len(factors)} "
                f"entries; the {head_dim} rotary dims need {head_dim // 2}"
            )
        shape = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        return 1.0 / (
            torch.tensor(factors, dtype=torch.float32, device="cpu") * params["rope_theta"] ** shape
        )
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    kind = params["rope_type"]
    if kind == "linear":
        return inv_freq / params["factor"]
    if kind == "llama3":
        # Frequencies with wavelengths longer than the original context are slowed by `factor`,
        # short ones are kept, and the band between is interpolated smoothly.
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_ctx = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        in_band = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(in_band, blended, scaled)
    if kind == "yarn":
        return _yarn_inv_frequencies(head_dim, params)
    if kind == "proportional":
        # the first partial_rotary_factor of the frequencies, the rest 0 (cos 1, sin 0: those
        # dims pass unturned), over the whole head_dim
        turned = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
        inv_freq[turned:] = 0.0
        return inv_freq / params.get("factor", 1.0)
    return inv_freq


def _yarn_inv_frequencies(head_dim: int, params: dict) -> torch.Tensor:
    """YaRN: dimensions that turn fewer than ``beta_slow`` times over the original context are
    interpolated (frequency / factor), those that turn more than ``beta_fast`` times are kept, and a
    linear ramp over the dimension index blends the ones between."""
    base, factor = params["rope_theta"], params["factor"]
    old_ctx = params["original_max_position_embeddings"]
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def dim_of(
        rotations: float,
    ) -> float:  # the dimension that turns `rotations` times over old_ctx
        return (head_dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    # on the CPU explicitly: models are built under a meta-device context, where tensors hold no
    # data
    ramp = torch.clamp(
        (torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1
    )
    pos_freqs = base ** (
        torch.arange(0, head_dim, 2, device="cpu").to(dtype=torch.float) / head_dim
    )
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: the original frequency, 0: the interpolated one
    return interpolation * (1 - keep) + extrapolation * keep


def attention_factor(params: dict) -> float:
    """The factor that multiplies cos and sin: YaRN's ``attention_factor``, by default
    ``0.1 * ln(factor) + 1`` (with ``mscale`` / ``mscale_all_dim``: the ratio of two such terms);
    LongRoPE's, by default ``sqrt(1 + ln(factor) / ln(original length))``; 1 for the other types."""
    if params["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if params.get("attention_factor") is not None:
        return params["attention_factor"]
    if params["rope_type"] == "longrope":
        factor = params.get("factor") or 1.0
        if factor <= 1.0:
            return 1.0
        return math.sqrt(
            1 + math.log(factor) / math.log(params["original_max_position_embeddings"])
        )
    factor, mscale, mscale_all_dim = (
        params["factor"],
        params.get("mscale"),
        params.get("mscale_all_dim"),
    )

    def mscale_of(scale: float, m: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return float(mscale_of(factor, mscale) / mscale_of(factor, mscale_all_dim))
    return mscale_of(factor)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions ``[0, capacity)``, kept in float32 (not buffers, so casting
    the model to bf16 leaves them exact), times ``attention_factor(params)``. Built on first use on
    the device that asks, grown by doubling when a longer sequence comes."""

    def __init__(self, head_dim: int, params: dict, initial_positions: int, long: bool = False):
        super().__init__()
        self.head_dim = head_dim
        self.params = params
        self.inv_freq = inv_frequencies(head_dim, params, long)
        self.scaling = attention_factor(params)
        self._initial = max(1, initial_positions)
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return 0 if self._cos is None else self._cos.shape[0]

    def reserve(self, num_positions: int, device: torch.device) -> None:
        """Make positions ``[0, num_positions)`` available on ``device``."""
        if num_positions > self.capacity or self._cos.device != device:
            n = max(self.capacity, self._initial)
            while n < num_positions:
                n *= 2
            positions = torch.arange(n, dtype=torch.float32, device=device)
            freqs = torch.outer(positions, self.inv_freq.to(device))  # [n, head_dim / 2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [n, head_dim]
            self._cos, self._sin = emb.cos(), emb.sin()
            if self.scaling != 1.0:
                self._cos, self._sin = self._cos * self.scaling, self._sin * self.scaling

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: float32 [T, head_dim] for ``positions`` [T] (after ``reserve``)."""
        return self._cos[positions], self._sin[positions]

    def tables(self, fb) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of a ``ForwardBatch``'s tokens."""
        self.reserve(max(fb.seq_lens), fb.positions.device)
        return self(fb.positions)

    def variant(self, seq_len: int) -> int:
        """Which tables a sequence of ``seq_len`` tokens computes its KV with (0: the only
        ones)."""
        return 0


class LongRopeEmbedding(RotaryEmbedding):
    """LongRoPE: the short tables, and the long ones for every token of a request whose whole
    sequence is longer than the original context (module docstring)."""

    def __init__(self, head_dim: int, params: dict, initial_positions: int):
        super().__init__(head_dim, params, initial_positions)
        self.original = int(params["original_max_position_embeddings"])
        self.long = RotaryEmbedding(head_dim, params, initial_positions, long=True)

    def reserve(self, num_positions: int, device: torch.device) -> None:
        super().reserve(num_positions, device)
        self.long.reserve(num_positions, device)

    def variant(self, seq_len: int) -> int:
        return int(seq_len > self.original)

    def tables(self, fb) -> tuple[torch.Tensor, torch.Tensor]:
        self.reserve(max(fb.seq_lens), fb.positions.device)
        lens = fb.full_lens if fb.full_lens is not None else fb.seq_lens
        long_rows = [n > self.original for n in lens]
        if not any(long_rows):
            return self(fb.positions)
        if all(long_rows):
            return self.long(fb.positions)
        rows = torch.tensor(long_rows, device=fb.positions.device)
        pick = rows.repeat_interleave(torch.tensor(fb.extend_lens, device=rows.device))[:, None]
        (cos, sin), (long_cos, long_sin) = self(fb.positions), self.long(fb.positions)
        return torch.where(pick, long_cos, cos), torch.where(pick, long_sin, sin)


def rotary_embedding(head_dim: int, params: dict, initial_positions: int) -> RotaryEmbedding:
    """The rotary module of ``params``' type."""
    cls = LongRopeEmbedding if params["rope_type"] == "longrope" else RotaryEmbedding
    return cls(head_dim, params, initial_positions)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``: [T, heads, head_dim]; ``cos``/``sin``: [T, head_dim] in ``x``'s dtype."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs (x0, x1), (x2, x3), ...; the result holds the pairs' first
    elements, then their second ones (the same dot products as re-interleaving, one copy less).
    ``cos``/``sin`` [T, r] hold each pair's angle twice (``cat(freqs, freqs)``)."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]  # x: [T, heads, r]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def mrope_axes(section: list[int], interleaved: bool) -> torch.Tensor:
    """Which position axis (0: time, 1: height, 2: width) turns each frequency of M-RoPE: in
    consecutive runs of ``section`` (Qwen2-VL, Qwen2.5-VL), or interleaved t, h, w, t, h, w, ...
    within three times each spatial section (Qwen3-VL's ``mrope_interleaved``)."""
    half = sum(section)
    if not interleaved:
        return torch.cat([torch.full((n,), i % 3, device="cpu") for i, n in enumerate(section)])
    axes = torch.zeros(half, dtype=torch.long, device="cpu")
    for axis in (1, 2):
        axes[axis : section[axis] * 3 : 3] = axis
    return axes


class MRopeEmbedding(RotaryEmbedding):
    """Multimodal RoPE: each token has a (time, height, width) position; frequency j turns by
    the axis ``mrope_axes`` gives it. A text token's three positions are equal, so a batch
    without image tokens (``ForwardBatch.rope_positions`` None) takes the plain tables."""

    def __init__(self, head_dim: int, params: dict, initial_positions: int, section, interleaved):
        super().__init__(head_dim, params, initial_positions)
        if sum(section) != head_dim // 2:
            raise ValueError(
                f"mrope_section: {list(section)} sums to {sum(section)}; the rotary dims "
                f"({head_dim}) need {head_dim // 2}"
            )
        # [head_dim], as the tables repeat their halves (a list: the model is built on the meta
        # device)
        half = mrope_axes(list(section), interleaved).tolist()
        self.axes = half + half

    def tables(self, fb) -> tuple[torch.Tensor, torch.Tensor]:
        positions = getattr(fb, "rope_positions", None)
        if positions is None:
            self.reserve(max(int(fb.positions.max()) + 1, 1), fb.positions.device)
            return self(fb.positions)
        self.reserve(int(positions.max()) + 1, positions.device)
        tokens = torch.arange(positions.shape[1], device=positions.device)[:, None]
        axes = torch.tensor(self.axes, device=positions.device)[None, :]
        dims = torch.arange(self.head_dim, device=positions.device)[None, :]
        picked = positions[axes, tokens]  # [T, head_dim]: each dim's axis position
        return self._cos[picked, dims], self._sin[picked, dims]
