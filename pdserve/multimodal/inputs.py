"""What a request carries of each image, from the front end to the scheduler (and between
servers): where its placeholder tokens start, its patch grid, a digest of its pixels, and the
patches themselves (none where the server computes no prompt: a language-only decode)."""

from __future__ import annotations

from typing import Optional

import msgspec


class ImageInput(msgspec.Struct, kw_only=True):
    offset: int  # its first placeholder token's index in the prompt
    tokens: int  # its placeholder tokens (one per merged square of patches)
    grid: list[int]  # (frames, rows, columns) in patches
    digest: str  # sha256 of the patches' bytes and the grid (hex)
    # float32 patches [frames * rows * columns, patch_width], row-major; None: not sent
    pixels: Optional[bytes] = None
    patch_width: int = 0
    # the encoder server that computes its embeddings (EPD: "tcp://host:port"); None: this server
    encoder: Optional[str] = None
    # the other encoder servers it may go to, in order, if that one fails
    fallbacks: list[str] = msgspec.field(default_factory=list)

    @property
    def end(self) -> int:
        return self.offset + self.tokens

    @property
    def cache_key(self) -> int:
        """The token its placeholders stand for in prefix-cache keys: negative (no vocabulary
        id), 32-bit (KV events hash ids as int32), one per distinct image."""
        return -1 - int(self.digest[:15], 16) % (2**31 - 1)
