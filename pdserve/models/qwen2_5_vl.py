"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): Qwen2's decoder with multimodal RoPE in
runs of ``mrope_section`` and the windowed vision tower of ``layers/qwen_vision.py``.

- Images: each image's placeholder tokens (``image_token_id``, one per merged square of patches)
  take the tower's embeddings in place of the token embedding (``models/vision_language.py``).
- Positions: ``VisionLanguageMixin.rope_index``. Past the prompt every axis is the token's slot
  plus the prompt's ``rope_delta`` (its largest position + 1 - its length), so decode needs only
  that number (it travels in PD's metadata).
- ``language_only`` (``--language-only``): no tower is built or read.

The checkpoint keeps the language model as a Qwen2 checkpoint does (``model.*``, ``lm_head.*``)
and the tower under ``visual.``.
"""

from __future__ import annotations

from pdserve.layers.qwen_vision import Qwen25VisionTower
from pdserve.models.llama import LlamaModel, Qwen2ForCausalLM
from pdserve.models.vision_language import VisionLanguageMixin, with_images


class Qwen2_5_VLForConditionalGeneration(VisionLanguageMixin, Qwen2ForCausalLM):
    model_cls = with_images(LlamaModel)
    tower_cls = Qwen25VisionTower
