"""Reading a request's images: ``data:`` URLs (base64), and local files under the one folder
``--allowed-local-media-path`` names (``file://`` URLs); nothing is fetched over the network.
Each image is checked against the server's limits before it is decoded (its encoded size, then
its pixel count from the header) and any fault is a ``ValueError`` naming the image's field."""

from __future__ import annotations

import base64
import binascii
import io
import os
from dataclasses import dataclass
from typing import Any, Optional
from urllib.parse import unquote, urlparse


@dataclass
class ImageLimits:
    max_images: int = 8  # per request
    max_bytes: int = 20 * 2**20  # encoded, per image
    max_pixels: int = 8192 * 8192  # decoded width x height, per image
    local_path: Optional[str] = None  # the folder file:// URLs may read (None: none)


def image_url_of(part: Any, where: str) -> str:
    """The URL of an OpenAI ``image_url`` content part (``{"url": ...}`` or the URL itself)."""
    url = part.get("image_url") if isinstance(part, dict) else None
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise ValueError(f"{where}.image_url.url: must be a non-empty string")
    return url


def read_image_bytes(url: str, limits: ImageLimits, where: str) -> bytes:
    """The encoded bytes of the image at ``url``."""
    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise ValueError(f"{where}: a data URL must be 'data:image/...;base64,<data>'")
        mime = head[5:-7]
        if mime and not mime.startswith("image/"):
            raise ValueError(f"{where}: data URL of type {mime!r}, not an image")
        if len(payload) * 3 // 4 > limits.max_bytes:
            raise ValueError(f"{where}: image larger than {limits.max_bytes} bytes")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{where}: the data URL's base64 does not decode") from None
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https"):
        raise ValueError(
            f"{where}: this server fetches no http(s) URLs; send the image as a data URL "
            "(data:image/png;base64,...)"
        )
    if parsed.scheme != "file":
        raise ValueError(f"{where}: an image URL must be a data: or file: URL, got {url[:40]!r}")
    if limits.local_path is None:
        raise ValueError(
            f"{where}: file URLs are off on this server (start it with --allowed-local-media-path)"
        )
    root = os.path.realpath(limits.local_path)
    path = os.path.realpath(unquote(parsed.path))
    if os.path.commonpath([root, path]) != root:
        raise ValueError(f"{where}: {parsed.path!r} is outside --allowed-local-media-path")
    try:
        size = os.path.getsize(path)
        if size > limits.max_bytes:
            raise ValueError(f"{where}: image larger than {limits.max_bytes} bytes")
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{where}: cannot read {parsed.path!r}: {e.strerror}") from None


def decode_image(data: bytes, limits: ImageLimits, where: str):
    """A PIL image in RGB, after checking its pixel count from the header."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > limits.max_pixels:
            raise ValueError(
                f"{where}: {width}x{height} pixels, more than the {limits.max_pixels} allowed"
            )
        image.load()
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
        raise ValueError(f"{where}: not a readable image ({type(e).__name__})") from None
    return image.convert("RGB")


def load_images(urls: list[tuple[str, str]], limits: ImageLimits) -> list:
    """(url, field) pairs -> PIL images, within the per-request count."""
    if len(urls) > limits.max_images:
        raise ValueError(f"images: {len(urls)} in one request, at most {limits.max_images}")
    return [decode_image(read_image_bytes(u, limits, w), limits, w) for u, w in urls]
