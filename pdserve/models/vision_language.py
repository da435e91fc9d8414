"""What a vision-language model adds to its language model (``qwen2_5_vl.py``, ``qwen3_5.py``):

- ``with_images(decoder_cls)``: the decoder whose embeddings take the images' rows
  (``ForwardBatch.image_embeds``) and whose RoPE is multimodal (``layers/rotary.MRopeEmbedding``:
  ``mrope_section`` of the configuration's RoPE settings, interleaved or in runs);
- ``VisionLanguageMixin``, before the language model's class: the vision tower (``tower_cls``;
  none with ``language_only``, a decode server or an EPD prefill), ``image_tokens``,
  ``encode_image`` and ``rope_index`` (Qwen2-VL's rule, module docstring of ``qwen2_5_vl.py``),
  and the tower's weights under ``visual.`` (``models/weights.py`` self-loading module,
  replicated on every TP rank).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from pdserve.distributed import SINGLE, TPGroup
from pdserve.forward_batch import ForwardBatch
from pdserve.layers.rotary import MRopeEmbedding

VISUAL = "visual."


def with_images(decoder_cls: type, section: tuple = (16, 24, 24), interleaved: bool = False):
    """``decoder_cls`` (a ``LlamaModel``) with image rows spliced in and multimodal RoPE: in runs
    of ``mrope_section`` (``section`` where the configuration gives none), or ``interleaved`` (the
    family's fixed layout, whatever the configuration says, as HF's classes do). Rows wider than
    the model (Qwen3-VL's DeepStack features after the embeddings' part) are added to the outputs
    of the first layers, one part each."""

    class ImageDecoder(decoder_cls):
        def __init__(self, config, shards, **attn_kwargs):
            super().__init__(config, shards, **attn_kwargs)
            raw = getattr(config, "rope_parameters", None) or {}
            old = self.rotaries["default"]  # its parameters as the family normalised them
            self.rotaries["default"] = MRopeEmbedding(
                old.head_dim,
                old.params,
                old._initial,
                raw.get("mrope_section") or list(section),
                interleaved,
            )
            self.deepstack: Optional[tuple[torch.Tensor, list[torch.Tensor]]] = None

        def forward(self, fb: ForwardBatch) -> torch.Tensor:
            h = self.embed_tokens(fb.input_ids)
            self.deepstack = None
            if fb.image_embeds is not None:
                rows, embeds = fb.image_embeds
                width = h.shape[-1]
                h[rows] = embeds[:, :width].to(h.dtype)
                if embeds.shape[-1] > width:
                    self.deepstack = (rows, list(embeds[:, width:].split(width, dim=-1)))
            h, residual = self.forward_layers(fb, h, None)
            self.deepstack = None
            h, _ = self.norm(h, residual)
            return h

        def after_layer(self, layer: int, h: torch.Tensor) -> torch.Tensor:
            if self.deepstack is not None and layer < len(self.deepstack[1]):
                rows, parts = self.deepstack
                h[rows] += parts[layer].to(h.dtype)
            return h

    ImageDecoder.__name__ = ImageDecoder.__qualname__ = f"{decoder_cls.__name__}WithImages"
    return ImageDecoder


class VisionLanguageMixin:
    tower_cls: type

    def __init__(self, config, tp: TPGroup = SINGLE, par=None, moe: Any = None):
        if par is not None and par.pp_size > 1:
            raise ValueError(
                f"pp_size: {type(self).__name__}'s image embeddings enter the first stage's "
                "forward, which pipeline stages do not run yet; serve it with --tp-size"
            )
        super().__init__(config, tp=tp, par=par, moe=moe)
        self.image_token_id = config.image_token_id
        self.merge = config.vision_config.spatial_merge_size
        language_only = bool(getattr(config, "language_only", False))
        # the tower runs where prompts are computed: the first pipeline stage, unless decode-only
        self.visual = (
            self.tower_cls(config.vision_config)
            if self.shards.embeds and not language_only
            else None
        )
        # an image's rows: the embeddings, and DeepStack's features (Qwen3-VL) beside them
        deepstack = len(getattr(config.vision_config, "deepstack_visual_indexes", None) or [])
        self.image_width = config.hidden_size * (1 + deepstack)

    def image_tokens(self, grid: Iterable[int]) -> int:
        t, h, w = grid
        return t * h * w // (self.merge * self.merge)

    def encode_image(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's embeddings [tokens, hidden_size] from its patches."""
        if self.visual is None:
            raise ValueError(
                "images: this server runs the language model only (--language-only); "
                "its prompts' KV must come from a prefill server"
            )
        return self.visual(pixels, grid)

    def rope_index(
        self, input_ids: list[int], images: list[tuple[int, tuple[int, int, int]]]
    ) -> tuple[torch.Tensor, int]:
        """(positions [3, len(input_ids)], delta) of a prompt whose images start at the given
        token offsets with the given (t, h, w) patch grids: text counts up on every axis; an
        image starting at position p gives its tokens (p + frame, p + row, p + column) of its
        merged squares, and the text after it resumes at p + max(rows, columns)."""
        pieces, pos, at = [], 0, 0
        for offset, (t, h, w) in sorted(images):
            if offset > at:  # text before the image
                pieces.append(torch.arange(pos, pos + offset - at).expand(3, -1))
                pos += offset - at
            gh, gw = h // self.merge, w // self.merge
            tt, hh, ww = torch.meshgrid(
                torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij"
            )
            pieces.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
            at = offset + t * gh * gw
            pos += max(gh, gw)
        if len(input_ids) > at:
            pieces.append(torch.arange(pos, pos + len(input_ids) - at).expand(3, -1))
        positions = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)
        delta = int(positions.max()) + 1 - len(input_ids) if len(input_ids) else 0
        return positions, delta

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The checkpoint's weights; the tower's only where it is built."""
        if self.visual is None:
            weights = ((n, w) for n, w in weights if not n.startswith(VISUAL))
        super().load_weights(weights)
