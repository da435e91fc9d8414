"""The framing of a tier entry: a header the tier writes and checks, whatever the backend.

``MAGIC (4) | header length (u32) | payload length (u64) | crc32 of payload (u32) | layout key
(utf-8)`` then the payload (one page's KV, every region). Little-endian. An entry whose magic,
layout key, length or checksum does not match is corrupt: ``unpack`` returns None for it.
"""

from __future__ import annotations

import struct
import zlib
from typing import Optional

MAGIC = b"PDKV"
_FIXED = struct.Struct("<4sIQI")  # magic, header length, payload length, crc32


def pack(layout_key: str, payload: bytes) -> bytes:
    key = layout_key.encode()
    header = _FIXED.pack(MAGIC, _FIXED.size + len(key), len(payload), zlib.crc32(payload))
    return header + key + payload


def unpack(layout_key: str, data: bytes) -> Optional[memoryview]:
    """The payload of ``data``, or None if it is not an intact entry of ``layout_key``."""
    if len(data) < _FIXED.size:
        return None
    magic, header_len, length, crc = _FIXED.unpack_from(data)
    if magic != MAGIC or header_len < _FIXED.size or header_len + length != len(data):
        return None
    if bytes(data[_FIXED.size : header_len]) != layout_key.encode():
        return None
    payload = memoryview(data)[header_len:]
    if zlib.crc32(payload) != crc:
        return None
    return payload
