"""What a prefill and an encoder server say to each other (EPD; ``encoder_server.py``,
``encoder_queue.py``), msgpack over ZMQ, each message one frame, followed with
``--disaggregation-secret`` by a second frame: its HMAC-SHA256 under the secret (as the KV control
plane signs its messages, ``disagg/messages.py``)."""

from __future__ import annotations

import hmac
from typing import Any, Optional, Union

import msgspec

from pdserve.disagg.messages import AuthError, ProtocolError, message_tag


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


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Union[EncodeWant, EncodeDone])


class EpdCodec:
    """Messages to frames and back, signed and checked when there is a secret."""

    def __init__(self, secret: Optional[str] = None):
        self.secret = secret.encode() if secret else None

    def frames(self, msg: Union[EncodeWant, EncodeDone]) -> list[bytes]:
        payload = _encoder.encode(msg)
        return [payload] if self.secret is None else [payload, message_tag(self.secret, payload)]

    def read(self, frames: list[bytes]) -> Union[EncodeWant, EncodeDone]:
        """The message of ``frames`` (``ProtocolError`` if malformed, ``AuthError`` if unsigned
        or signed with another secret where this side has one)."""
        if not frames or len(frames) > 2:
            raise ProtocolError(f"an EPD message is 1 or 2 frames, got {len(frames)}")
        if self.secret is not None:
            if len(frames) != 2:
                raise AuthError("unsigned EPD message (this side requires --disaggregation-secret)")
            if not hmac.compare_digest(message_tag(self.secret, frames[0]), frames[1]):
                raise AuthError("EPD message with a bad HMAC (forged, tampered, or another secret)")
        try:
            return _decoder.decode(frames[0])
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ProtocolError(f"malformed EPD message: {e}") from None
