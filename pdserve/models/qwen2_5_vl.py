"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): Qwen2's decoder with multimodal RoPE and
the vision tower of ``layers/qwen_vision.py``.

- Images: each image's placeholder tokens (``image_token_id``, one per merged square of patches)
  take the tower's embeddings in place of the token embedding (``ForwardBatch.image_embeds``).
- Positions (``rope_index``, Qwen2-VL's rule): text tokens count up on all three axes; an image
  of t x h x w merged squares starting at position p gives its tokens (p + frame, p + row,
  p + column), and the text after it resumes at p + max(h, w). Past the prompt every axis is the
  token's slot plus the prompt's ``rope_delta`` (its largest position + 1 - its length), so
  decode needs only that number (it travels in PD's metadata).
- ``language_only`` (a decode server, ``--language-only``): no tower is built or read.

The checkpoint keeps the language model as a Qwen2 checkpoint does (``model.*``, ``lm_head.*``)
and the tower under ``visual.``.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from pdserve.distributed import SINGLE, TPGroup
from pdserve.forward_batch import ForwardBatch
from pdserve.layers.qwen_vision import Qwen25VisionTower
from pdserve.layers.rotary import MRopeEmbedding, rope_parameters
from pdserve.models.llama import LlamaModel, Qwen2ForCausalLM

VISUAL = "visual."


class VisionLanguageModel(LlamaModel):
    """The decoder with multimodal RoPE, whose embeddings take the images' rows."""

    def __init__(self, config, shards, **attn_kwargs):
        super().__init__(config, shards, **attn_kwargs)
        params = rope_parameters(config)
        section = params.get("mrope_section") or [16, 24, 24]
        old = self.rotaries["default"]
        self.rotaries["default"] = MRopeEmbedding(
            old.head_dim, params, old._initial, section, bool(params.get("mrope_interleaved"))
        )

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        h = self.embed_tokens(fb.input_ids)
        if fb.image_embeds is not None:
            rows, embeds = fb.image_embeds
            h[rows] = embeds.to(h.dtype)
        h, residual = self.forward_layers(fb, h, None)
        h, _ = self.norm(h, residual)
        return h


class Qwen2_5_VLForConditionalGeneration(Qwen2ForCausalLM):
    model_cls = VisionLanguageModel

    def __init__(self, config, tp: TPGroup = SINGLE, par=None, moe: Any = None):
        if par is not None and par.pp_size > 1:
            raise ValueError(
                "pp_size: Qwen2.5-VL's image embeddings enter the first stage's forward, which "
                "pipeline stages do not run yet; serve it with --tp-size"
            )
        super().__init__(config, tp=tp, par=par, moe=moe)
        self.image_token_id = config.image_token_id
        self.merge = config.vision_config.spatial_merge_size
        language_only = bool(getattr(config, "language_only", False))
        # the tower runs where prompts are computed: the first pipeline stage, unless decode-only
        self.visual = (
            Qwen25VisionTower(config.vision_config)
            if self.shards.embeds and not language_only
            else None
        )

    # ---- images -------------------------------------------------------------------------------
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
        token offsets with the given (t, h, w) patch grids (module docstring)."""
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

    # ---- weights ------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The checkpoint's weights; the tower's (replicated) only where it is built."""
        if self.visual is None:
            weights = ((n, w) for n, w in weights if not n.startswith(VISUAL))
        super().load_weights(weights)

    def vision_dtype(self) -> Optional[torch.dtype]:
        return None if self.visual is None else self.visual.merger.mlp[0].weight.dtype
