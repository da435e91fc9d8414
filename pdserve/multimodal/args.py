"""The image server arguments (fields of ``ServerArgs``) checked at start-up, naming the flag."""

from __future__ import annotations

import os
from typing import Callable

from pdserve.multimodal.images import ImageLimits


def check_image_args(args, bad: Callable[[str, str], None]) -> None:
    for name in ("max_images_per_request", "max_image_bytes", "max_image_pixels"):
        if getattr(args, name) < 1:
            bad(name, f"must be >= 1, got {getattr(args, name)}")
    if args.encoder_pool_tokens < 64:
        bad("encoder_pool_tokens", f"must be >= 64 (one page), got {args.encoder_pool_tokens}")
    if not args.encoder_timeout > 0:
        bad("encoder_timeout", f"must be > 0, got {args.encoder_timeout}")
    if args.encoder_cache_images < 0:
        bad("encoder_cache_images", f"must be >= 0, got {args.encoder_cache_images}")
    if args.encoder_only and args.disaggregation_mode != "null":
        bad("encoder_only", "an encoder server has no prefill or decode role")
    if args.encoder_only and args.language_only:
        bad("encoder_only", "is the opposite of --language-only")
    path = args.allowed_local_media_path
    if path is not None and not os.path.isdir(path):
        bad("allowed_local_media_path", f"{path!r} is not a directory")


def image_limits(args) -> ImageLimits:
    return ImageLimits(
        max_images=args.max_images_per_request,
        max_bytes=args.max_image_bytes,
        max_pixels=args.max_image_pixels,
        local_path=args.allowed_local_media_path,
    )
