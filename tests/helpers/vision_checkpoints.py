"""Tiny vision-language checkpoints, as their makers publish them: the model's weights, a
tokenizer with the image tokens and a chat template that places them, and the image processor's
``preprocessor_config.json`` (patches of 4 pixels here, so test images stay small)."""

from __future__ import annotations

import base64
import io
import os
import shutil

import torch
import transformers

from tests.helpers.checkpoints import _COMMON, _RECIPE_VERSION, _cached, smollm2_tokenizer_dir

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2-VL's way of placing an image: its tokens where the part was, inside the turn
CHAT_TEMPLATE = (
    "{%- for message in messages -%}<|im_start|>{{ message['role'] }}\n"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') or 'image' in part -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)
# the language model and tower of the tiny Qwen2.5-VL and Qwen3-VL checkpoints: the tiny text
# models' sizes
_TEXT_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "initializer_range",
)
TINY_TEXT = {k: _COMMON[k] for k in _TEXT_FIELDS}
TINY_TOWER = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
PROCESSOR = dict(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=256, max_pixels=4096)


def write_qwen2_5_vl(
    tmp: str,
    text: dict,
    vision: dict,
    processor: dict,
    dtype: torch.dtype = torch.float32,
    drawn: bool = True,
    family: str = "Qwen2_5_VL",
) -> None:
    """A Qwen2.5-VL (or, with ``family`` "Qwen3_5", a Qwen3.5) checkpoint in ``tmp``: the SmolLM2
    tokenizer with the image tokens and ``CHAT_TEMPLATE``, the language model of ``text``'s
    fields and the tower of ``vision``'s, random (``drawn``: norms and biases drawn too, so one
    skipped shows), and the image processor of ``processor``'s fields."""
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = CHAT_TEMPLATE
    ids = tok.convert_tokens_to_ids(VISION_TOKENS)
    text = dict(vocab_size=len(tok), bos_token_id=1, eos_token_id=2, pad_token_id=2, **text)
    vision = dict(
        patch_size=processor["patch_size"],
        spatial_merge_size=processor["merge_size"],
        temporal_patch_size=processor["temporal_patch_size"],
        **vision,
    )
    config = getattr(transformers, f"{family}Config")(
        text_config=text,
        vision_config=vision,
        vision_start_token_id=ids[0],
        vision_end_token_id=ids[1],
        image_token_id=ids[2],
        video_token_id=ids[3],
        tie_word_embeddings=False,
    )
    config.architectures = [f"{family}ForConditionalGeneration"]
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForConditionalGeneration")(config).to(dtype)
    if drawn:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight") or "norm1" in name or "norm2" in name:
                    param.normal_(0.0 if family == "Qwen3_5" else 1.0, 0.2)  # 1 + w
                elif name.endswith("bias"):
                    param.normal_(0.0, 0.1)
                elif "visual" in name:
                    param.normal_(0.0, 0.1)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    module = transformers.models.qwen2_vl.image_processing_pil_qwen2_vl
    module.Qwen2VLImageProcessorPil(**processor).save_pretrained(tmp)


def build_qwen2_5_vl_checkpoint() -> str:
    """A 2-layer Qwen2.5-VL (float32) with a 2-block tower (one windowed, one whole-image) whose
    windows (16 pixels) cut a 32-pixel image in four."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text = dict(TINY_TEXT, rope_parameters=rope)
    vision = dict(
        TINY_TOWER,
        window_size=16,
        fullatt_block_indexes=[1],
        initializer_range=0.1,
    )
    return _cached(
        "qwen2_5_vl",
        [_RECIPE_VERSION, transformers.__version__, PROCESSOR, 1],
        lambda tmp: write_qwen2_5_vl(tmp, text, vision, PROCESSOR),
    )


def build_qwen3_5_vl_checkpoint() -> str:
    """Qwen3.5 with images: the tiny hybrid of ``tests/helpers/checkpoints.py`` (Gated DeltaNet
    and gated attention layers) with 32-dim heads, 8 of them turning by M-RoPE [2, 1, 1]
    (interleaved), and a 2-block tower with a learned position table of 4 x 4."""
    from tests.helpers.checkpoints import tiny_config

    text = tiny_config("qwen3_5").to_dict()
    for key in ("architectures", "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"):
        text.pop(key, None)
    text["head_dim"] = 32
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    }
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=text["hidden_size"],
        num_position_embeddings=16,
        initializer_range=0.1,
    )
    return _cached(
        "qwen3_5_vl",
        [_RECIPE_VERSION, transformers.__version__, PROCESSOR, text, 1],
        lambda tmp: write_qwen2_5_vl(tmp, text, vision, PROCESSOR, family="Qwen3_5"),
    )


def build_qwen3_vl_checkpoint() -> str:
    """Qwen3-VL: a 2-layer Qwen3 (q/k norms) with 16-dim heads turning by interleaved M-RoPE
    [4, 2, 2], and a 2-block tower whose both blocks give DeepStack features (added after the
    decoder's layers 0 and 1)."""
    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [4, 2, 2],
        "mrope_interleaved": True,
    }
    text = dict(TINY_TEXT, head_dim=16, rope_parameters=rope)
    vision = dict(
        TINY_TOWER,
        num_position_embeddings=16,
        deepstack_visual_indexes=[0, 1],
        initializer_range=0.1,
    )
    return _cached(
        "qwen3_vl",
        [_RECIPE_VERSION, transformers.__version__, PROCESSOR, 1],
        lambda tmp: write_qwen2_5_vl(tmp, text, vision, PROCESSOR, family="Qwen3VL"),
    )


def png(width: int, height: int, seed: int) -> bytes:
    """A PNG of random colours (RGB)."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(out, format="PNG")
    return out.getvalue()


def data_url(image: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(image).decode()}"


def hf_vl_inputs(path: str, messages: list[dict], images: list[bytes]) -> dict:
    """HF's processor inputs for a chat with ``images`` (in order of their parts)."""
    from PIL import Image

    tok = transformers.AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    module = transformers.models.qwen2_vl.image_processing_pil_qwen2_vl
    proc = module.Qwen2VLImageProcessorPil.from_pretrained(path)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    vis = proc(images=pil, return_tensors="pt") if pil else {}
    ids = tok(text, add_special_tokens=False)["input_ids"]
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    out, grids = [], iter(vis["image_grid_thw"].tolist() if pil else [])
    for t in ids:
        if t == image_id:
            g = next(grids)
            out.extend([image_id] * (g[0] * g[1] * g[2] // 4))
        else:
            out.append(t)
    return {"input_ids": torch.tensor([out]), **({k: v for k, v in vis.items()} if pil else {})}


def hf_vl_generate(
    path: str, inputs: dict, max_new_tokens: int, dtype: torch.dtype = torch.float32
) -> tuple[list[int], torch.Tensor]:
    """HF's greedy tokens and the logits of each step (float32 [n, vocab])."""
    arch = transformers.AutoConfig.from_pretrained(path).architectures[0]
    model = getattr(transformers, arch).from_pretrained(path, dtype=dtype).eval()
    ids = inputs["input_ids"]
    kwargs = {k: v for k, v in inputs.items() if k != "input_ids"}
    mm = (ids == model.config.image_token_id).int()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=mm,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            **kwargs,
        )
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    return tokens, torch.stack([step[0].float() for step in out.logits])


def hf_vl_greedy(path: str, inputs: dict, max_new_tokens: int) -> tuple[list[int], list[float]]:
    """HF's float32 greedy tokens and their logprobs."""
    tokens, logits = hf_vl_generate(path, inputs, max_new_tokens)
    logprobs = torch.log_softmax(logits, -1)
    return tokens, [logprobs[i, t].item() for i, t in enumerate(tokens)]


def without_vision_tower(path: str) -> str:
    """``path``'s checkpoint without the ``visual.*`` tensors: what a language-only server
    (``--language-only``) needs, so one that read the tower would fail to load."""
    from safetensors.torch import load_file, save_file

    def write(tmp: str) -> None:
        for name in os.listdir(path):
            if name != "model.safetensors" and not name.startswith("."):
                shutil.copy(os.path.join(path, name), tmp)
        tensors = load_file(os.path.join(path, "model.safetensors"))
        kept = {k: v for k, v in tensors.items() if not k.startswith(("visual.", "model.visual."))}
        save_file(kept, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})

    return _cached("qwen2_5_vl-language", [_RECIPE_VERSION, path], write)
