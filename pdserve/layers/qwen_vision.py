"""The Qwen2.5-VL vision tower: a ViT over 14x14 patches (two frames deep) with 2-D RoPE,
attention within windows of ``window_size`` pixels on most blocks and over the whole image on
``fullatt_block_indexes``, and a merger that folds each ``spatial_merge_size``^2 square of
patches into one embedding of the language model's width.

Input: an image's patches as the image processor flattens them ([patches, channels x frames x
patch x patch], in merge-square order) and its grid (t, h, w) in patches. Output: one row per
merged square, in the order of the image's placeholder tokens. Weights keep the checkpoint's
names under ``visual.`` (``patch_embed.proj``, ``blocks.N.{norm1,norm2,attn.qkv,attn.proj,
mlp.{gate,up,down}_proj}``, ``merger.{ln_q,mlp.0,mlp.2}``). The tower is replicated on every
tensor-parallel rank: it runs once per image, on prefill only.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.layers.linear import Linear
from pdserve.layers.norm import RMSNorm


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = Linear(dim, 3 * dim, bias=True)
        self.proj = Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, bounds: list[int], cos, sin) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, self.head_dim).unbind(1)
        # RoPE in float32, as HF turns the tower's queries and keys
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, n, head_dim]
        out = torch.empty_like(q)
        for lo, hi in zip(bounds[:-1], bounds[1:]):  # each window (or image) sees itself only
            out[:, lo:hi] = F.scaled_dot_product_attention(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi])
        return self.proj(out.transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = Linear(dim, hidden, bias=True)
        self.up_proj = Linear(dim, hidden, bias=True)
        self.down_proj = Linear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.norm1 = RMSNorm(dim, 1e-6)
        self.norm2 = RMSNorm(dim, 1e-6)
        self.attn = VisionAttention(dim, heads)
        self.mlp = VisionMLP(dim, hidden)

    def forward(self, x: torch.Tensor, bounds: list[int], cos, sin) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), bounds, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, out_dim: int, dim: int, merge: int):
        super().__init__()
        self.width = dim * merge * merge
        self.ln_q = RMSNorm(dim, 1e-6)
        self.mlp = nn.Sequential(
            Linear(self.width, self.width, bias=True),
            nn.GELU(),
            Linear(self.width, out_dim, bias=True),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class Qwen25VisionTower(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.dim, self.heads = vc.hidden_size, vc.num_heads
        self.patch_size, self.merge = vc.patch_size, vc.spatial_merge_size
        self.temporal_patch_size, self.in_channels = vc.temporal_patch_size, vc.in_channels
        self.window_size = vc.window_size
        self.full_blocks = set(vc.fullatt_block_indexes)
        theta = (getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        self.theta = float(theta)
        patch = vc.in_channels * vc.temporal_patch_size * vc.patch_size * vc.patch_size
        self.patch_embed = nn.Module()
        # a Conv3d whose kernel is its stride: one matmul over each flattened patch
        self.patch_embed.proj = nn.Conv3d(
            vc.in_channels,
            self.dim,
            kernel_size=[vc.temporal_patch_size, vc.patch_size, vc.patch_size],
            stride=[vc.temporal_patch_size, vc.patch_size, vc.patch_size],
            bias=False,
        )
        self.patch_width = patch
        self.blocks = nn.ModuleList(
            VisionBlock(self.dim, self.heads, vc.intermediate_size) for _ in range(vc.depth)
        )
        self.merger = PatchMerger(vc.out_hidden_size, self.dim, self.merge)

    @property
    def unit(self) -> int:
        return self.merge * self.merge

    def tokens(self, grid: Iterable[int]) -> int:
        """Placeholder tokens of an image whose grid is (t, h, w) patches."""
        t, h, w = grid
        return t * h * w // self.unit

    def _embed_patches(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """The patch embedding (a Conv3d whose kernel is its stride: one matmul per patch)."""
        n = grid[0] * grid[1] * grid[2]
        if pixels.shape != (n, self.patch_width):
            raise ValueError(
                f"image patches: expected [{n}, {self.patch_width}] for grid {list(grid)}, "
                f"got {list(pixels.shape)}"
            )
        proj = self.patch_embed.proj
        return F.linear(pixels.to(proj.weight.dtype), proj.weight.reshape(self.dim, -1), proj.bias)

    def _rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """2-D RoPE of patches at (row, column) ``pos`` [n, 2]: rows and columns each turn a
        quarter of a head (float32 cos, sin [n, 1, head_dim])."""
        half = self.dim // self.heads // 2
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
        freqs = (pos[..., None].float() * inv_freq).flatten(1)
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
        return emb.cos(), emb.sin()

    def _positions(self, t: int, h: int, w: int) -> torch.Tensor:
        """(row, column) of every patch [t * h * w, 2], in merge-square order."""
        m = self.merge
        hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // m, m, w // m, m)
        hh = hh.reshape(shape).transpose(1, 2).flatten()
        ww = ww.reshape(shape).transpose(1, 2).flatten()
        return torch.stack([hh, ww], dim=-1).repeat(t, 1)

    def _windows(self, t: int, h: int, w: int) -> tuple[torch.Tensor, list[int]]:
        """The merged squares' order grouped by window, and each window's length in patches."""
        side = self.window_size // self.merge // self.patch_size
        gh, gw = h // self.merge, w // self.merge
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        ph, pw = -gh % side, -gw % side
        padded = F.pad(index, (0, pw, 0, ph), value=-1)
        nh, nw = (gh + ph) // side, (gw + pw) // side
        padded = (
            padded.reshape(t, nh, side, nw, side).permute(0, 1, 3, 2, 4).reshape(t, -1, side**2)
        )
        lengths = (padded >= 0).sum(-1).flatten()
        order = padded.flatten()
        return order[order >= 0], [int(n) * self.unit for n in lengths if n > 0]

    @torch.no_grad()
    def forward(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's embeddings [tokens, out_hidden] from its patches [t * h * w, patch]."""
        t, h, w = grid
        n = t * h * w
        x = self._embed_patches(pixels, grid)
        order, window_lens = self._windows(t, h, w)
        x = x.view(n // self.unit, self.unit, -1)[order].reshape(n, -1)
        pos = self._positions(t, h, w).view(n // self.unit, self.unit, 2)[order].reshape(n, 2)
        cos, sin = self._rope(pos)
        frame = h * w
        full = [i * frame for i in range(t + 1)]  # frames attend within themselves
        windows = [0]
        for length in window_lens:
            windows.append(windows[-1] + length)
        for i, block in enumerate(self.blocks):
            x = block(x, full if i in self.full_blocks else windows, cos, sin)
        merged = self.merger(x)
        return merged[torch.argsort(order)]

    # ---- weights: every rank holds the whole tower (models/weights.py's self-loading modules)
    def checkpoint_names(self) -> list[str]:
        return [name for name, _ in self.named_parameters()]

    def load_checkpoint(self, name: str, src) -> None:
        param = dict(self.named_parameters()).get(name)
        if param is None:
            raise ValueError("not a weight of the Qwen2.5-VL vision tower")
        tensor = src if isinstance(src, torch.Tensor) else src[:]
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"shape {list(tensor.shape)}, expected {list(param.shape)}")
        param.data.copy_(tensor)


# ---- Qwen3.5's tower ---------------------------------------------------------------------------
class GeluMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, approximate: str):
        super().__init__()
        self.linear_fc1 = Linear(dim, hidden, bias=True)
        self.linear_fc2 = Linear(hidden, dim, bias=True)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class LayerNormBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, approximate: str):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, heads)
        self.mlp = GeluMLP(dim, hidden, approximate)

    def forward(self, x: torch.Tensor, bounds: list[int], cos, sin) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), bounds, cos, sin)
        return x + self.mlp(self.norm2(x))


class NormMerger(nn.Module):
    """Each patch layer-normed (``post_shuffle``: each merge square, its patches side by side),
    the square's patches side by side, then an MLP."""

    def __init__(self, out_dim: int, dim: int, merge: int, post_shuffle: bool = False):
        super().__init__()
        self.width = dim * merge * merge
        self.post_shuffle = post_shuffle
        self.norm = nn.LayerNorm(self.width if post_shuffle else dim, eps=1e-6)
        self.linear_fc1 = Linear(self.width, self.width, bias=True)
        self.linear_fc2 = Linear(self.width, out_dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.post_shuffle else self.norm(x)
        return self.linear_fc2(F.gelu(self.linear_fc1(x.view(-1, self.width))))


class Qwen35VisionTower(Qwen25VisionTower):
    """Qwen3.5's tower: Qwen2.5-VL's patches, 2-D RoPE and merge order, with a learned position
    table (a square of ``num_position_embeddings``, resized bilinearly to each image's grid),
    LayerNorm blocks with a GELU MLP attending over the whole image, a patch embedding with a
    bias, and a merger that norms each patch before folding."""

    def __init__(self, vc):
        nn.Module.__init__(self)
        self.dim, self.heads = vc.hidden_size, vc.num_heads
        self.patch_size, self.merge = vc.patch_size, vc.spatial_merge_size
        self.temporal_patch_size, self.in_channels = vc.temporal_patch_size, vc.in_channels
        theta = (getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        self.theta = float(theta)
        self.patch_width = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(
            vc.in_channels,
            self.dim,
            kernel_size=[vc.temporal_patch_size, vc.patch_size, vc.patch_size],
            stride=[vc.temporal_patch_size, vc.patch_size, vc.patch_size],
            bias=True,
        )
        self.side = int(vc.num_position_embeddings**0.5)
        self.pos_embed = nn.Embedding(vc.num_position_embeddings, self.dim)
        approximate = "tanh" if "tanh" in getattr(vc, "hidden_act", "gelu") else "none"
        self.blocks = nn.ModuleList(
            LayerNormBlock(self.dim, self.heads, vc.intermediate_size, approximate)
            for _ in range(vc.depth)
        )
        self.merger = NormMerger(vc.out_hidden_size, self.dim, self.merge)

    def _table(self, h: int, w: int) -> torch.Tensor:
        """The position table resized to h x w (bilinear, corners aligned), in merge order."""
        table = self.pos_embed.weight.float().view(self.side, self.side, -1).permute(2, 0, 1)
        grid = F.interpolate(table[None], size=(h, w), mode="bilinear", align_corners=True)[0]
        m = self.merge
        grid = grid.permute(1, 2, 0).reshape(h // m, m, w // m, m, -1).permute(0, 2, 1, 3, 4)
        return grid.reshape(h * w, -1)

    @torch.no_grad()
    def forward(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        t, h, w = grid
        x = self._embed_patches(pixels, grid)
        x = x + self._table(h, w).repeat(t, 1).to(x.dtype)
        cos, sin = self._rope(self._positions(t, h, w))
        frames = [i * h * w for i in range(t + 1)]
        features = []  # Qwen3-VL's DeepStack: some blocks' outputs, merged apart
        for i, block in enumerate(self.blocks):
            x = block(x, frames, cos, sin)
            features += self.deepstack(i, x)
        return torch.cat([self.merger(x), *features], dim=-1)

    def deepstack(self, block: int, x: torch.Tensor) -> list[torch.Tensor]:
        return []


class Qwen3VLVisionTower(Qwen35VisionTower):
    """Qwen3-VL's tower: Qwen3.5's, whose blocks of ``deepstack_visual_indexes`` also give their
    output through a merger of their own (normed per merge square); an image's rows are the
    final merger's then each of those, side by side ([tokens, out_hidden x (1 + k)]), for the
    decoder to add to its first k layers' outputs (``models/vision_language.with_images``)."""

    def __init__(self, vc):
        super().__init__(vc)
        self.deepstack_layers = list(vc.deepstack_visual_indexes)
        self.deepstack_merger_list = nn.ModuleList(
            NormMerger(vc.out_hidden_size, self.dim, self.merge, post_shuffle=True)
            for _ in self.deepstack_layers
        )

    def deepstack(self, block: int, x: torch.Tensor) -> list[torch.Tensor]:
        if block not in self.deepstack_layers:
            return []
        return [self.deepstack_merger_list[self.deepstack_layers.index(block)](x)]
