"""The text model of a multimodal checkpoint, served as a text model.

Several 2026 families are published only as image-text-to-text checkpoints (Qwen3.5's every
size): ``config.json`` names the multimodal class and nests the language model's configuration in
``text_config``; the language model's tensors are ``model.language_model.*`` and ``lm_head.*``,
beside the vision tower's (``model.visual.*``) and any multi-token-prediction layers. pdserve
serves such a checkpoint's text model: ``text_model_config`` gives the nested configuration under
the text class's architecture name (with the outer fields it needs: the dtype, the quantization,
the tied embeddings), and ``text_model_weights`` the language model's tensors under the text
checkpoint's names, every other tensor set aside. The vision-language architectures of
``VISION_LANGUAGE`` are served with their images: their configuration is the text one under the
outer name with the vision fields, and a nested one's tower tensors are read as ``visual.*``.
MiniMax M3's and Llama 4's published checkpoints keep the language model as
``language_model.model.*`` and ``language_model.lm_head.*`` (``TEXT_PREFIXES``), in the names
their text classes read (``models/minimax_m3.py``, ``models/llama4.py``).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Iterator

logger = logging.getLogger(__name__)

# multimodal architecture -> the text model's architecture (``models/registry.py``)
TEXT_MODELS = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
    "Gemma4ForConditionalGeneration": "Gemma4ForCausalLM",
    "MiniMaxM3SparseForConditionalGeneration": "MiniMaxM3VLForCausalLM",
    "Llama4ForConditionalGeneration": "Llama4ForCausalLM",
}
# vision-language architectures served with their images (the model class takes the tower):
# the text configuration under the outer architecture's name, with ``VISION_FIELDS`` copied in
VISION_LANGUAGE = (
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)
VISION_FIELDS = (
    "vision_config",
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
)
# where a multimodal checkpoint keeps its language model's tensors: prefix -> the text checkpoint's
DEFAULT_PREFIXES = {"model.language_model.": "model.", "lm_head.": "lm_head."}
# the vision-language ones of ``TEXT_MODELS``: their tower's tensors too, under ``visual.``
_WITH_TOWER = {**DEFAULT_PREFIXES, "model.visual.": "visual."}
TEXT_PREFIXES = {
    "Qwen3VLForConditionalGeneration": _WITH_TOWER,
    "Qwen3_5ForConditionalGeneration": _WITH_TOWER,
    "Qwen3_5MoeForConditionalGeneration": _WITH_TOWER,
    "MiniMaxM3SparseForConditionalGeneration": {
        "language_model.model.": "model.",
        "language_model.lm_head.": "lm_head.",
    },
    "Llama4ForConditionalGeneration": {
        "language_model.model.": "model.",
        "language_model.lm_head.": "lm_head.",
    },
}
# fields of the outer configuration that the text model's reads when its own does not set them
OUTER_FIELDS = ("dtype", "torch_dtype", "quantization_config")
# set on a text configuration taken from a multimodal one: the architecture it came from
SOURCE_FIELD = "multimodal_architecture"


def text_model_config(config) -> Any:
    """``config`` itself, or, for a multimodal architecture of ``TEXT_MODELS``, its text model's
    configuration named as the text class (``SOURCE_FIELD`` telling where it came from)."""
    archs = list(getattr(config, "architectures", None) or [])
    vlm = next((a for a in archs if a in VISION_LANGUAGE), None)
    if vlm is not None:
        return _vision_language_config(config, vlm)
    outer = next((a for a in archs if a in TEXT_MODELS), None)
    if outer is None:
        return config
    text = getattr(config, "text_config", None)
    if text is None:
        raise ValueError(f"{outer}: the configuration has no text_config")
    for field in OUTER_FIELDS:
        if getattr(text, field, None) is None and getattr(config, field, None) is not None:
            setattr(text, field, getattr(config, field))
    if getattr(config, "tie_word_embeddings", None) is not None:  # the outer class ties them
        text.tie_word_embeddings = config.tie_word_embeddings
    text.architectures = [TEXT_MODELS[outer]]
    setattr(text, SOURCE_FIELD, outer)
    return text


def _vision_language_config(config, arch: str) -> Any:
    text = getattr(config, "text_config", None)
    if text is None:
        raise ValueError(f"{arch}: the configuration has no text_config")
    for field in OUTER_FIELDS + ("tie_word_embeddings",):
        if getattr(text, field, None) is None and getattr(config, field, None) is not None:
            setattr(text, field, getattr(config, field))
    for field in VISION_FIELDS:
        setattr(text, field, getattr(config, field, None))
    text.architectures = [arch]
    if arch in TEXT_PREFIXES:  # the language model nested (model.language_model.*): renamed
        setattr(text, SOURCE_FIELD, arch)
    return text


def from_multimodal(config) -> bool:
    return getattr(config, SOURCE_FIELD, None) is not None


def text_name(name: str, source: str) -> str | None:
    """The text checkpoint's name of a tensor of a ``source`` checkpoint (a multimodal
    architecture); None when it is not the language model's."""
    for prefix, text in TEXT_PREFIXES.get(source, DEFAULT_PREFIXES).items():
        if name.startswith(prefix):
            return text + name[len(prefix) :]
    return None


def _renamed(items: Iterable[tuple[str, Any]], source: str, skipped: list[int]) -> Iterator:
    for name, value in items:
        renamed = text_name(name, source)
        if renamed is None:
            skipped[0] += 1
        else:
            yield renamed, value


def text_model_weights(
    weights: Iterable[tuple[str, Any]], source: str
) -> Iterator[tuple[str, Any]]:
    """The language model's tensors of a multimodal checkpoint under their text names; the rest
    (vision tower, projector, multi-token prediction) counted and set aside."""
    skipped = [0]
    yield from _renamed(weights, source, skipped)
    logger.info(
        "%s: the text model's weights loaded, %d other tensors set aside", source, skipped[0]
    )


def text_model_tensors(tensors: dict[str, Any], source: str) -> dict[str, Any]:
    """``text_model_weights`` over a checkpoint's header (name -> dtype and shape)."""
    return dict(_renamed(tensors.items(), source, [0]))
