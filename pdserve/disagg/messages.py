"""Decode rank <-> prefill rank control-plane messages (ZMQ PUSH/PULL), msgpack via msgspec.

Every message carries the protocol version ``v`` and its type tag ``type``; ``decode_message``
checks the version before anything else and raises ``ProtocolError`` naming what it got.

Decode -> prefill rank: ``Register`` (once per connection), ``TransferRequest`` (per room and
generation), ``Abort``, ``Heartbeat``.
Prefill rank -> decode: ``RegisterAck``, ``TransferStatus``, ``AbortAck``, ``Heartbeat`` (ack).

Authentication: with a shared secret (``--disaggregation-secret``) every message carries in
``auth`` an HMAC-SHA256 over the message encoded with ``auth=b""``. ``MessageCodec`` is the one
place that signs and verifies; a side with a secret rejects messages without a valid tag
(``AuthError``). Replays of a captured message within a session are not detected: every message
is fenced by session, room and generation, so a replay can only repeat what was already asked.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any, Optional, Union

import msgspec

from pdserve.kv_region import Region

# 2: KV regions tagged by cache group and layer, destination pages per group
# 3: one list of typed regions (kv_region.Region: group, layer, part, final, split); no state slots
PROTOCOL_VERSION = 3


class ProtocolError(ValueError):
    """A control-plane message this side cannot accept (bad version, type or shape)."""


class AuthError(ProtocolError):
    """A control-plane message without a valid HMAC on a side that has a secret."""


class Message(msgspec.Struct, tag_field="type", kw_only=True):
    v: int = PROTOCOL_VERSION
    auth: bytes = b""  # HMAC hook, see the module docstring


class BufferDesc(msgspec.Struct):
    """Where a rank's registered buffers live in its own address space (KVArgs subset)."""

    regions: list[Region]  # KVArgs.regions
    aux_data_ptrs: list[int]
    aux_data_lens: list[int]
    aux_item_lens: list[int]
    gpu_id: int = 0
    device: str = "cpu"

    @classmethod
    def from_kv_args(cls, a) -> "BufferDesc":
        return cls(
            regions=list(a.regions),
            aux_data_ptrs=list(a.aux_data_ptrs),
            aux_data_lens=list(a.aux_data_lens),
            aux_item_lens=list(a.aux_item_lens),
            gpu_id=a.gpu_id,
            device=a.device,
        )

    def spans(self) -> list[tuple[int, int]]:
        """Every (ptr, nbytes) of the buffers."""
        return [(r.ptr, r.nbytes) for r in self.regions] + list(
            zip(self.aux_data_ptrs, self.aux_data_lens)
        )


class Register(Message, tag="register"):
    session_id: str  # one per decode KVManager; names the connection on the prefill side
    decode_rank: int
    decode_tp_size: int
    reply_endpoint: str  # tcp://ip:port of the decode rank's PULL socket
    buffers: BufferDesc
    compat: dict[str, Any]  # KVArgs.compat_info() of the decode rank
    backend: str
    backend_info: dict[str, Any] = {}  # opaque to everyone but the backend (e.g. shm segments)


class RegisterAck(Message, tag="register_ack"):
    session_id: str
    prefill_rank: int
    ok: bool = True
    error: str = ""


class TransferRequest(Message, tag="transfer_request"):
    session_id: str
    room: int
    generation: int  # fences writes: a newer generation of the same room replaces the older
    # per cache group: decode page i receives the i-th page prefill sends of that group (the
    # request's page transfer_start + i: decode_prefix_pages on, or the window's first page on)
    dst_pages: list[list[int]]
    aux_slot: int  # -1: no metadata row (dummy destination)
    required_dst_info_num: int = 1  # decode ranks that will ask this prefill rank for the room
    decode_prefix_pages: int = 0  # leading pages decode already holds; prefill skips them
    reply_endpoint: str = ""  # lets prefill answer even when it does not know the session


class TransferStatus(Message, tag="transfer_status"):
    room: int
    generation: int  # 0 on a Failed status means "every generation" (prefill did not know decode's)
    state: int  # KVPoll value: Success, Failed, or Transferring ("queued or in progress here")
    prefill_rank: int
    reason: str = ""
    # Failed only: a write of the room failed or timed out in the backend, so some of its bytes
    # may still be queued on the way (decode frees the pages only after fencing the session)
    unsettled: bool = False


class Abort(Message, tag="abort"):
    session_id: str
    room: int
    generation: int
    reason: str = ""
    reply_endpoint: str = ""


class AbortAck(Message, tag="abort_ack"):
    """Sent after the prefill rank stopped writing for (room, generation)."""

    room: int
    generation: int
    prefill_rank: int


class Heartbeat(Message, tag="heartbeat"):
    session_id: str
    seq: int
    reply_endpoint: str = ""  # where the ack goes (set by decode)
    ack: bool = False
    prefill_rank: int = -1  # set on acks
    known: bool = True  # on acks: False when the prefill rank does not know the session (restarted)


AnyMessage = Union[
    Register, RegisterAck, TransferRequest, TransferStatus, Abort, AbortAck, Heartbeat
]
MESSAGE_TYPES = {cls.__struct_config__.tag: cls for cls in AnyMessage.__args__}


class _Header(msgspec.Struct):
    v: Any = None
    type: Any = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMessage)
_header_decoder = msgspec.msgpack.Decoder(_Header)


def message_tag(secret: bytes, data: bytes) -> bytes:
    return hmac.new(secret, data, hashlib.sha256).digest()


class MessageCodec:
    """Encodes/decodes control messages, signing and verifying them when given a secret."""

    def __init__(self, secret: Optional[bytes] = None):
        self.secret = secret or None

    def encode(self, msg: Message) -> bytes:
        if self.secret is None:
            return _encoder.encode(msg)
        unsigned = msgspec.structs.replace(msg, auth=b"")
        return _encoder.encode(
            msgspec.structs.replace(msg, auth=message_tag(self.secret, _encoder.encode(unsigned)))
        )

    def decode(self, data: bytes) -> AnyMessage:
        try:
            header = _header_decoder.decode(data)
        except msgspec.DecodeError as e:
            raise ProtocolError(f"malformed control message: {e}") from None
        if header.v != PROTOCOL_VERSION:
            raise ProtocolError(
                f"unsupported control protocol version {header.v!r} (this side speaks "
                f"{PROTOCOL_VERSION})"
            )
        if header.type not in MESSAGE_TYPES:
            raise ProtocolError(f"unknown control message type {header.type!r}")
        try:
            msg = _decoder.decode(data)
        except msgspec.ValidationError as e:
            raise ProtocolError(f"invalid {header.type} message: {e}") from None
        if self.secret is not None:
            if not msg.auth:
                raise AuthError(
                    f"unauthenticated {header.type} message (this side requires "
                    "--disaggregation-secret)"
                )
            expected = message_tag(
                self.secret, _encoder.encode(msgspec.structs.replace(msg, auth=b""))
            )
            if not hmac.compare_digest(expected, msg.auth):
                raise AuthError(
                    f"{header.type} message with a bad HMAC (forged, tampered, "
                    "or a different secret)"
                )
        return msg


_default_codec = MessageCodec()


def encode_message(msg: Message) -> bytes:
    return _default_codec.encode(msg)


def decode_message(data: bytes) -> AnyMessage:
    return _default_codec.decode(data)


# ---- completion notices carried by a backend write (NIXL notifications) ----------------------

NOTICE_PREFIX = b"pdserve-done:"


def completion_notice(room: int, generation: int, rank: int) -> bytes:
    """The backend notification carried by a room's last write (see ``parse_completion_notice``)."""
    return NOTICE_PREFIX + f"{room}:{generation}:{rank}".encode()


def parse_completion_notice(msg: bytes) -> Optional[tuple[int, int, int]]:
    """(room, generation, prefill rank) of a completion notice, or None for anything else."""
    if not msg.startswith(NOTICE_PREFIX):
        return None
    try:
        room, generation, rank = (int(x) for x in msg[len(NOTICE_PREFIX) :].split(b":"))
    except ValueError:
        return None
    return room, generation, rank
