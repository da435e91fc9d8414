"""Images in the engine: a request's multimodal RoPE positions, set once when it arrives
(``prepare``), and, per forward, the rows of its image tokens with their embeddings
(``splice``). A model takes images when it has ``encode_image``, ``image_tokens`` and
``rope_index`` (``models/qwen2_5_vl.py``); the scheduler and the PD queues see requests only.

An image's embeddings are computed by the model's vision tower the first time a forward covers
one of its tokens and kept on the request until the prompt is past the image (a prompt in
several chunks computes each image once; a retracted request computes it again)."""

from __future__ import annotations

from typing import Optional

import torch

from pdserve.engine.request import Req


def prepare(req: Req, model, computes_prompts: bool = True, encoders: bool = False) -> None:
    """Check ``req.images`` against its prompt and ``model``, and set its RoPE positions
    (``ValueError`` naming what is wrong); ``computes_prompts``: this server computes prompts
    (not a decode server), so it needs the images' patches and the vision tower, or, with
    ``encoders`` (EPD on), encoder servers for the images a router gave one."""
    if not encoders:  # the tower here computes every image
        for image in req.images or ():
            image.encoder = None
    rope_index = getattr(model, "rope_index", None)
    if req.images and getattr(model, "image_tokens", None) is None:
        raise ValueError(f"images: {type(model).__name__} takes no images")
    if req.images and computes_prompts:
        local = [im for im in req.images if im.encoder is None]  # the others: EPD
        if local and getattr(model, "visual", None) is None:
            raise ValueError(
                "images: this server has no vision tower (--language-only); send requests "
                "with images to a server that computes their prompts, or through encoder "
                "servers (a router with --encoder)"
            )
        if any(im.pixels is None for im in req.images):
            raise ValueError("images: a server that computes prompts needs each image's pixels")
    if not req.images or rope_index is None:
        return
    at = 0
    for i, image in enumerate(req.images):
        if len(image.grid) != 3 or any(g <= 0 for g in image.grid):
            raise ValueError(f"images[{i}].grid: three positive sizes, got {image.grid}")
        want = model.image_tokens(image.grid)
        if image.tokens != want:
            raise ValueError(
                f"images[{i}]: grid {image.grid} gives {want} tokens, not {image.tokens}"
            )
        if image.offset < at or image.end > req.prompt_len:
            raise ValueError(
                f"images[{i}]: tokens [{image.offset}, {image.end}) overlap another image or "
                f"pass the prompt's end ({req.prompt_len})"
            )
        placeholders = set(req.input_ids[image.offset : image.end])
        if placeholders != {model.image_token_id}:
            raise ValueError(
                f"images[{i}]: the prompt's tokens [{image.offset}, {image.end}) are not all the "
                f"image token {model.image_token_id}"
            )
        at = image.end
    req.rope_positions, req.rope_delta = rope_index(
        req.input_ids, [(im.offset, tuple(im.grid)) for im in req.images]
    )


def unavailable(req: Req, model) -> Optional[str]:
    """Why ``req``'s images past its cached prefix cannot be computed here (a decode server
    without the tower that preempted the request), or None."""
    for i, image in enumerate(req.images or ()):
        if image.end <= req.kv_len or i in req.image_embeds:
            continue
        if image.pixels is None or getattr(model, "visual", None) is None:
            return (
                f"images[{i}]: this server was short of memory, preempted the request and "
                "cannot compute its images again (no vision tower or no pixels here)"
            )
    return None


def positions(req: Req, start: int, ext: int) -> tuple[list[int], Optional[torch.Tensor]]:
    """The positions of slots ``[start, start + ext)``, and their three axes [3, ext] where an
    image token is among them (None otherwise)."""
    n = req.prompt_len
    if req.rope_positions is None or start >= n:  # past the prompt (decode): a shift only
        return list(range(start + req.rope_delta, start + ext + req.rope_delta)), None
    inside = req.rope_positions[:, start : min(start + ext, n)]
    past = torch.arange(max(start, n), max(start + ext, n)) + req.rope_delta
    three = torch.cat([inside, past.expand(3, -1)], dim=1)
    images = any(im.offset < start + ext and im.end > start for im in req.images or ())
    return three[0].tolist(), three if images else None


def splice(
    rows: list[tuple[Req, int, int, int]], model
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(rows of the forward's tokens that are image tokens, their embeddings) for ``rows``
    (request, first slot, tokens, the row's first index in the forward); None when none is."""
    index, embeds = [], []
    for req, start, ext, first in rows:
        for i, image in enumerate(req.images or ()):
            lo, hi = max(image.offset, start), min(image.end, start + ext)
            if lo >= hi:
                continue
            rows_of = req.image_embeds.get(i)
            if rows_of is None:
                rows_of = req.image_embeds[i] = _encode(model, image)
            index.append(torch.arange(first + lo - start, first + hi - start))
            embeds.append(rows_of[lo - image.offset : hi - image.offset])
            if hi == image.end and image.encoder is None:
                # the image's last token: its rows are no longer needed (an encoder's are kept:
                # this server may have no tower to compute them again after a retraction)
                del req.image_embeds[i]
    if not index:
        return None
    return torch.cat(index), torch.cat(embeds)


def _encode(model, image) -> torch.Tensor:
    if image.pixels is None:
        raise ValueError(
            "images: this request's image patches were not sent; a server that computes "
            "prompts needs them"
        )
    grid = tuple(image.grid)
    patches = torch.frombuffer(bytearray(image.pixels), dtype=torch.float32)
    return model.encode_image(patches.view(-1, image.patch_width), grid)
