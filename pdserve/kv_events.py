"""KV cache events: what a server's radix cache stores and evicts, published over ZMQ in the
wire format vLLM and SGLang use (so existing consumers, e.g. KV-aware routers, read them).

- A block is one KV page of ``page_size`` tokens. Its hash chains from its parent's:
  ``block_hash(parent, tokens)`` = the first 8 bytes of BLAKE2b over the parent's hash (8 bytes,
  big-endian; none for the first block) and the tokens as little-endian int32, as a
  non-negative 63-bit int. A run of block hashes therefore names a prefix of tokens.
- Messages (msgpack): a batch ``[ts, events, data_parallel_rank]`` (array-like, defaults
  omitted); events are tagged array-like structs ``BlockStored``, ``BlockRemoved``,
  ``AllBlocksCleared`` (the tag is the class name).
- Transport: a PUB socket sends each batch as ``[topic, seq (8 bytes, big-endian), payload]``,
  ``seq`` counting batches from 0; a ROUTER replay socket answers ``[b"", start_seq]`` with every
  buffered batch from ``start_seq`` on and then an end marker whose seq is -1, so a subscriber
  that sees a gap catches up; ``snapshot()`` (``GET /kv_events/snapshot``) gives the cache's
  whole content for one that starts late or lost too much.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import time
from array import array
from collections import deque
from typing import Optional, Union

import msgspec
import zmq

logger = logging.getLogger(__name__)

REPLAY_BUFFER = 10_000  # batches kept for replay
END_OF_REPLAY = -1


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """A change to the cache (the tag is the class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]  # the tokens of all the blocks, in order
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = None
    lora_name: Optional[str] = None  # the LoRA adapter the blocks were computed under


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: Optional[str] = None


class AllBlocksCleared(KVCacheEvent):
    pass


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: Optional[int] = None


def block_hash(parent: Optional[int], tokens) -> int:
    h = hashlib.blake2b(digest_size=8)
    if parent is not None:
        h.update(parent.to_bytes(8, "big"))
    h.update(array("i", tokens).tobytes())
    return int.from_bytes(h.digest(), "big") >> 1


# a LoRA adapter's namespace is a multiple of this; the model's own namespaces (LongRoPE's)
# stay below it, so a namespace is an adapter's plus the model's
LORA_NAMESPACE_STRIDE = 16


def lora_namespace(key: bytes) -> int:
    """A LoRA adapter's prefix-cache namespace from ``key`` (the servers': a digest of its files;
    the router's: its name): a positive multiple of the stride under 2^31, since a namespace is
    hashed as a 32-bit token id."""
    digest = hashlib.blake2b(key, digest_size=3).digest()
    return (int.from_bytes(digest, "big") + 1) * LORA_NAMESPACE_STRIDE


def lora_namespace_of(namespace: int) -> int:
    """The adapter's part of a namespace (0: the base model's)."""
    return namespace - namespace % LORA_NAMESPACE_STRIDE


def namespace_hash(namespace: int) -> Optional[int]:
    """The parent of a prefix-cache namespace's first blocks (None: the default namespace). Token
    ids are never negative, so no block of tokens hashes to it."""
    return None if namespace == 0 else block_hash(None, (-1, namespace))


def chain_hashes(parent: Optional[int], tokens, page_size: int) -> list[int]:
    """The hashes of the full pages of ``tokens``, chained from ``parent``."""
    out = []
    for i in range(0, len(tokens) - page_size + 1, page_size):
        parent = block_hash(parent, tokens[i : i + page_size])
        out.append(parent)
    return out


def offset_port(endpoint: Optional[str], offset: int) -> Optional[str]:
    """``tcp://host:port`` with ``port + offset`` (each DP group publishes on its own port)."""
    if not endpoint or not offset:
        return endpoint
    head, _, port = endpoint.rpartition(":")
    return f"{head}:{int(port) + offset}" if port.isdigit() else endpoint


class KVEventPublisher:
    """Publishes batches of events (one per scheduler step that changed the cache)."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: Optional[str] = None,
        topic: str = "",
        dp_rank: Optional[int] = None,
    ):
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.pub.bind(endpoint)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topic = topic.encode()
        self.dp_rank = dp_rank
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BUFFER)
        self.lock = threading.Lock()
        self.encoder = msgspec.msgpack.Encoder()
        self.replay = None
        self._stop = threading.Event()
        if replay_endpoint:
            self.replay = self.ctx.socket(zmq.ROUTER)
            self.replay.bind(replay_endpoint)
            self.replay_endpoint = self.replay.getsockopt_string(zmq.LAST_ENDPOINT)
            self._replay_thread = threading.Thread(
                target=self._serve_replay, name="kv-events-replay", daemon=True
            )
            self._replay_thread.start()
        logger.info(
            "KV events on %s%s",
            self.endpoint,
            f" (replay {self.replay_endpoint})" if self.replay is not None else "",
        )

    def publish(self, events: list[Event]) -> None:
        if not events:
            return
        payload = self.encoder.encode(
            KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.dp_rank)
        )
        with self.lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def _serve_replay(self) -> None:
        poller = zmq.Poller()
        poller.register(self.replay, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                frames = self.replay.recv_multipart()
                client, start = frames[0], frames[-1]
                start_seq = int.from_bytes(start, "big") if len(start) == 8 else 0
                with self.lock:
                    batches = [(s, p) for s, p in self.buffer if s >= start_seq]
                for s, p in batches:
                    self.replay.send_multipart([client, b"", self.topic, s.to_bytes(8, "big"), p])
                self.replay.send_multipart(
                    [client, b"", b"", struct.pack(">q", END_OF_REPLAY), b""]
                )
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                logger.exception("KV events replay failed")

    def close(self) -> None:
        self._stop.set()
        if self.replay is not None:
            self._replay_thread.join(
                1.0
            )  # it polls the replay socket: stop it before the socket goes
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)
        self.ctx.term()
