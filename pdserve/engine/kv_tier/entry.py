"""The framing of a tier entry: a header the tier writes and checks, whatever the backend.

Little-endian::

    magic "PDKV" (4) | header length (u32) | payload length (u64) | crc32 (u32)
    | parent block hash (i64, -1: none) | tokens (u32) | layout key length (u32)
    | layout key (utf-8) | tokens (i32 each) | payload

The payload is one page's KV, every region of every cache group; the tokens and the parent's
hash are the page's block (what ``kv_events.block_hash`` hashes), so the tier can check an entry
against the prompt it is meant for and a restarted server can announce the blocks it finds on
disk. The crc32 covers the layout key, the tokens and the payload. An entry whose magic, lengths,
layout key or checksum does not match is corrupt: ``unpack`` returns None for it.
"""

from __future__ import annotations

import struct
import zlib
from array import array
from dataclasses import dataclass
from typing import Optional

MAGIC = b"PDKV"
_FIXED = struct.Struct("<4sIQIqII")  # magic, header len, payload len, crc, parent, tokens, key len


@dataclass
class Entry:
    parent: Optional[int]  # the block hash of the page before (None: the first page)
    tokens: list[int]
    payload: memoryview


def header_nbytes(layout_key: str, page_size: int) -> int:
    return _FIXED.size + len(layout_key.encode()) + 4 * page_size


def pack(layout_key: str, parent: Optional[int], tokens, payload) -> bytes:
    key = layout_key.encode()
    toks = array("i", tokens).tobytes()
    crc = zlib.crc32(payload, zlib.crc32(toks, zlib.crc32(key)))
    header = _FIXED.pack(
        MAGIC,
        _FIXED.size + len(key) + len(toks),
        len(payload),
        crc,
        -1 if parent is None else parent,
        len(tokens),
        len(key),
    )
    return b"".join((header, key, toks, payload))


def _parse(layout_key: str, data) -> Optional[tuple[int, int, int, Optional[int], list[int]]]:
    """(header length, payload length, crc, parent, tokens) of ``data``'s header, or None."""
    if len(data) < _FIXED.size:
        return None
    magic, header_len, length, crc, parent, ntok, nkey = _FIXED.unpack_from(data)
    key = layout_key.encode()
    if (
        magic != MAGIC
        or nkey != len(key)
        or header_len != _FIXED.size + nkey + 4 * ntok
        or len(data) < header_len
        or bytes(data[_FIXED.size : _FIXED.size + nkey]) != key
    ):
        return None
    tokens = array("i")
    tokens.frombytes(bytes(data[_FIXED.size + nkey : header_len]))
    return header_len, length, crc, None if parent < 0 else parent, tokens.tolist()


def read_block(layout_key: str, header: bytes) -> Optional[tuple[Optional[int], list[int], int]]:
    """(parent, tokens, total length) from the start of an entry (its payload not checked)."""
    got = _parse(layout_key, header)
    return None if got is None else (got[3], got[4], got[0] + got[1])


def unpack(layout_key: str, data) -> Optional[Entry]:
    """The entry ``data`` holds, or None if it is not an intact entry of ``layout_key``."""
    got = _parse(layout_key, data)
    if got is None:
        return None
    header_len, length, crc, parent, tokens = got
    if header_len + length != len(data):
        return None
    view = memoryview(data)
    payload = view[header_len:]
    key_and_tokens = view[_FIXED.size : header_len]
    if zlib.crc32(payload, zlib.crc32(key_and_tokens)) != crc:
        return None
    return Entry(parent, tokens, payload)
