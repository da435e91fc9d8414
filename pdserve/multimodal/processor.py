"""A vision-language checkpoint's image processor: images -> patches, grids and the prompt's
placeholder tokens. The chat template places one placeholder per image; ``expand`` repeats it
once per merged square of that image's patches, as the model's processor does.

The processors are the checkpoint's own (``preprocessor_config.json``), run with transformers'
PIL backend (no torchvision needed), imported only by servers of such a model."""

from __future__ import annotations

import hashlib
import os
from typing import Any

from pdserve.multimodal.inputs import ImageInput

# architecture -> the image processor class that reads its preprocessor_config.json
_QWEN2_VL = (
    "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl",
    "Qwen2VLImageProcessorPil",
)
PROCESSORS = {
    "Qwen2_5_VLForConditionalGeneration": _QWEN2_VL,
    "Qwen3VLForConditionalGeneration": _QWEN2_VL,
    "Qwen3_5ForConditionalGeneration": _QWEN2_VL,
    "Qwen3_5MoeForConditionalGeneration": _QWEN2_VL,
}


def takes_images(hf_config) -> bool:
    return any(a in PROCESSORS for a in getattr(hf_config, "architectures", None) or [])


class ImageProcessor:
    def __init__(self, model_path: str, hf_config):
        arch = next(a for a in hf_config.architectures if a in PROCESSORS)
        if not os.path.exists(os.path.join(model_path, "preprocessor_config.json")):
            raise ValueError(f"{model_path}: a {arch} checkpoint needs preprocessor_config.json")
        import importlib

        module, name = PROCESSORS[arch]
        self.hf = getattr(importlib.import_module(module), name).from_pretrained(model_path)
        self.image_token_id = hf_config.image_token_id
        self.merge = hf_config.vision_config.spatial_merge_size

    def expand(
        self, input_ids: list[int], images: list[Any], keep_pixels: bool = True
    ) -> tuple[list[int], list[ImageInput]]:
        """The prompt with each image's placeholder repeated for its tokens, and the images as
        a request carries them (``keep_pixels`` False: without the patches, for a server that
        computes no prompt)."""
        found = sum(1 for t in input_ids if t == self.image_token_id)
        if found != len(images):
            raise ValueError(
                f"images: the prompt has {found} image placeholder(s) for {len(images)} image(s)"
            )
        if not images:
            return input_ids, []
        out = self.hf(images=images, return_tensors="np")
        pixels, grids = out["pixel_values"].astype("float32"), out["image_grid_thw"].tolist()
        ids: list[int] = []
        inputs, row, it = [], 0, iter(grids)
        for t in input_ids:
            if t != self.image_token_id:
                ids.append(t)
                continue
            grid = [int(g) for g in next(it)]
            patches = pixels[row : row + grid[0] * grid[1] * grid[2]]
            row += len(patches)
            raw = patches.tobytes()
            tokens = grid[0] * grid[1] * grid[2] // (self.merge * self.merge)
            inputs.append(
                ImageInput(
                    offset=len(ids),
                    tokens=tokens,
                    grid=grid,
                    digest=hashlib.sha256(raw + bytes(str(grid), "ascii")).hexdigest(),
                    pixels=raw if keep_pixels else None,
                    patch_width=int(patches.shape[1]),
                )
            )
            ids.extend([self.image_token_id] * tokens)
        return ids, inputs
