"""What a prefill and an encoder server say to each other (EPD; ``encoder_server.py``,
``encoder_queue.py``), msgpack over ZMQ."""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec


class EncodeWant(msgspec.Struct, tag="want", kw_only=True):
    """Encode one image and write its embeddings into the prefill's pages."""

    room: int  # the prefill's id of this image of this request
    session: str  # the prefill's transfer session (the encoder's peer id for it)
    backend: str  # the transfer backend both must run
    backend_info: dict[str, Any]  # the prefill backend's describe()
    regions: list[list[int]]  # the prefill's registered (address, bytes) regions
    dst: list[int]  # where each piece of the embeddings goes
    lengths: list[int]  # bytes of each piece, in the embeddings' row order
    dtype: str  # the embeddings' dtype there ("float32", "bfloat16")
    pixels: bytes  # float32 patches, row-major
    grid: list[int]
    patch_width: int


class EncodeDone(msgspec.Struct, tag="done", kw_only=True):
    room: int
    error: Optional[str] = None  # None: the embeddings are in place


_decoder = msgspec.msgpack.Decoder(Union[EncodeWant, EncodeDone])


def decode_message(payload: bytes) -> Union[EncodeWant, EncodeDone]:
    return _decoder.decode(payload)
