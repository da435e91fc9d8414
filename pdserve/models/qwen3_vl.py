"""Qwen3-VL (``Qwen3VLForConditionalGeneration``): Qwen3's decoder (q/k norms per head) with
interleaved multimodal RoPE (``mrope_section`` [24, 20, 20] of the 128 rotary dims) and the
tower of ``layers/qwen_vision.Qwen3VLVisionTower``, whose DeepStack features are added to the
image tokens' outputs of the decoder's first layers (``models/vision_language.py``). The
checkpoint nests the language model (``model.language_model.*``) beside the tower
(``model.visual.*``): read under the text checkpoint's names and ``visual.*``
(``models/multimodal.py``)."""

from __future__ import annotations

from pdserve.layers.qwen_vision import Qwen3VLVisionTower
from pdserve.models.llama import LlamaModel, Qwen3ForCausalLM
from pdserve.models.vision_language import VisionLanguageMixin, with_images


class Qwen3VLForConditionalGeneration(VisionLanguageMixin, Qwen3ForCausalLM):
    model_cls = with_images(LlamaModel, section=(24, 20, 20), interleaved=True)
    tower_cls = Qwen3VLVisionTower
