"""What each worker's KV cache holds, kept by the router from the workers' KV events
(``kv_events.py``), for ``cache_aware`` routing and ``--pd-policy conditional``.

One ``GroupFeed`` per publisher (a worker, or each DP group of one: group ``g`` publishes on the
worker's endpoint port + g) holds the set of block hashes the group stores. Its life:

- start: subscribe, then fetch ``GET /kv_events/snapshot`` (the blocks, and the seq of the last
  batch they reflect), then apply the batches that follow it;
- a batch with the next seq is applied; one further on is a gap: the missed batches are asked
  from the worker's replay socket, and if that cannot fill the gap the index is rebuilt from a
  snapshot; a seq that goes back means the publisher restarted: rebuilt likewise;
- the connection dropping (the worker died or restarted; seen through ZMQ's socket monitor)
  empties the index at once, and reconnecting rebuilds it from a snapshot;
- a batch that does not decode, or an event that does not hold up (hashes that do not chain
  from the tokens, a block size other than the worker's), is rejected and counted, and the
  index is rebuilt, since the batch may have said something the index now misses.

So an index is never stale for longer than one snapshot round trip after the router notices.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from typing import Optional

import httpx
import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pdserve.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    chain_hashes,
    lora_namespace,
    namespace_hash,
    offset_port,
)
from pdserve.router.workers import Worker

logger = logging.getLogger(__name__)

POOL_MEDIUM = "GPU"  # vLLM's medium of the device cache; pdserve's pool events carry none
REPLAY_TIMEOUT_S = 2.0
RESYNC_RETRY_S = 1.0
_END_OF_REPLAY = struct.pack(">q", -1)
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


class BadEvent(ValueError):
    """An event that cannot be applied; ``reason`` is its metric label."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _worker_endpoint(endpoint: str, host: str) -> str:
    """A published ``tcp://*:5557`` (or 0.0.0.0) as the router reaches it on the worker's host."""
    scheme, _, rest = endpoint.partition("://")
    where, _, port = rest.rpartition(":")
    if where in ("*", "0.0.0.0", "[::]", "::", ""):
        where = host
    return f"{scheme}://{where}:{port}"


class PromptBlocks:
    """A prompt's block hashes, computed once per block size; a prompt for a LoRA adapter
    (``adapter``: its name) chains them from the adapter's seed, so that it matches only what
    was sent for the same adapter."""

    def __init__(self, ids: list[int], adapter: Optional[str] = None):
        self.ids = ids
        self.adapter = adapter
        self.seed = None if adapter is None else namespace_hash(lora_namespace(adapter.encode()))
        self._hashes: dict[tuple, list[int]] = {}

    def hashes(self, block_size: int, seed: Optional[int] = None) -> list[int]:
        """``seed``: the adapter's seed as a worker's KV events show it (its blocks chain from
        its own key, which comes from the adapter's contents), instead of the name's."""
        seed = self.seed if seed is None else seed
        if (block_size, seed) not in self._hashes:
            self._hashes[block_size, seed] = chain_hashes(seed, self.ids, block_size)
        return self._hashes[block_size, seed]


class GroupFeed:
    """One publisher's blocks, kept up to date (see the module doc)."""

    def __init__(
        self,
        index: "KVIndex",
        worker: Worker,
        dp_rank: int,
        endpoint: str,
        replay: Optional[str],
        topic: bytes,
    ):
        self.index = index
        self.worker = worker
        self.dp_rank = dp_rank
        self.endpoint = endpoint
        self.replay = replay
        self.topic = topic
        self.hashes: set[int] = set()  # in the pool
        # a LoRA adapter's name -> the parent hash its first blocks chain from (its events')
        self.adapter_seeds: dict[str, int] = {}
        self.tiers: dict[str, set[int]] = {}  # below it, by KV events medium
        self.block_size: Optional[int] = None
        self.expected: Optional[int] = None  # the next seq; None: not in sync
        self.task: Optional[asyncio.Task] = None
        self._resync_needed: Optional[str] = None

    # ---- state --------------------------------------------------------------------------
    @property
    def synced(self) -> bool:
        return self.expected is not None

    def matched_blocks(self, prompt: PromptBlocks) -> int:
        if not self.synced or not self.block_size:
            return 0
        n = 0
        for h in prompt.hashes(self.block_size, self.adapter_seeds.get(prompt.adapter or "")):
            if h not in self.hashes:
                break
            n += 1
        return n

    def weighted_blocks(self, prompt: PromptBlocks, weights: dict[str, float]) -> float:
        """Leading blocks of ``prompt`` held in the pool (1 each) or a tier below it (its
        medium's weight, the best tier's when several hold it)."""
        if not self.synced or not self.block_size:
            return 0.0
        n = 0.0
        for h in prompt.hashes(self.block_size, self.adapter_seeds.get(prompt.adapter or "")):
            if h in self.hashes:
                n += 1.0
                continue
            w = max((weights.get(m, 0.0) for m, held in self.tiers.items() if h in held), default=0)
            if not w:
                break
            n += w
        return n

    def describe(self) -> dict:
        return {
            "dp_rank": self.dp_rank,
            "endpoint": self.endpoint,
            "synced": self.synced,
            "blocks": len(self.hashes),
            "tier_blocks": {m: len(held) for m, held in self.tiers.items()},
            "block_size": self.block_size,
            "next_seq": self.expected,
        }

    def drop(self) -> None:
        self.hashes.clear()
        self.tiers.clear()
        self.expected = None

    # ---- applying events ----------------------------------------------------------------
    def _held(self, medium: Optional[str]) -> set[int]:
        """The blocks of ``medium``: the pool's for none or "GPU" (vLLM's name for it)."""
        if medium is None or medium == POOL_MEDIUM:
            return self.hashes
        return self.tiers.setdefault(medium, set())

    def apply(self, events) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                self._check_stored(e)
                held = self._held(e.medium)
                parent = e.parent_block_hash
                if e.lora_name and not any(
                    parent in h for h in (self.hashes, *self.tiers.values())
                ):
                    self.adapter_seeds[e.lora_name] = parent  # an adapter's first blocks
                held.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                self._held(e.medium).difference_update(e.block_hashes)
            elif isinstance(e, AllBlocksCleared):  # the pool's cache reset; tiers report their own
                self.hashes.clear()

    def _check_stored(self, e: BlockStored) -> None:
        if e.block_size != self.block_size:
            raise BadEvent(
                "block_size", f"block size {e.block_size}, the worker's is {self.block_size}"
            )
        if len(e.token_ids) != len(e.block_hashes) * e.block_size:
            raise BadEvent(
                "token_count",
                f"{len(e.token_ids)} tokens for {len(e.block_hashes)} blocks of {e.block_size}",
            )
        if chain_hashes(e.parent_block_hash, e.token_ids, e.block_size) != e.block_hashes:
            raise BadEvent("hash_chain", "block hashes do not chain from the tokens")

    def on_batch(self, frames: list[bytes]) -> Optional[int]:
        """Apply one published batch; returns the seq of a gap's start (to be filled by replay),
        else None."""
        if len(frames) != 3 or len(frames[1]) != 8:
            raise BadEvent("frames", f"expected [topic, seq, payload], got {len(frames)} frames")
        seq = int.from_bytes(frames[1], "big")
        if not self.synced:
            return None
        if seq < self.expected:
            raise _Restarted(f"seq went back from {self.expected - 1} to {seq}")
        if seq > self.expected:
            return self.expected
        self._apply_payload(frames[2])
        self.expected = seq + 1
        return None

    def _apply_payload(self, payload: bytes) -> None:
        try:
            batch = _DECODER.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise BadEvent("undecodable", f"batch does not decode: {e}") from None
        self.apply(batch.events)
        self.index.metrics.kv_event_batches.labels(self.worker.url).inc()

    # ---- the loop -----------------------------------------------------------------------
    async def run(self) -> None:
        sub = self.index.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        connected_once = False
        self._resync_needed = "start"
        try:
            while True:
                if self._resync_needed:
                    await self._resync(sub, self._resync_needed)
                ready = dict(
                    await poller.poll(RESYNC_RETRY_S * 1000 if self._resync_needed else None)
                )
                if monitor in ready:
                    event = parse_monitor_message(await monitor.recv_multipart())["event"]
                    if event == zmq.EVENT_DISCONNECTED:
                        logger.info(
                            "KV events of %s (dp %d): disconnected; index dropped",
                            self.worker.url,
                            self.dp_rank,
                        )
                        self.drop()
                    elif event == zmq.EVENT_CONNECTED:
                        if connected_once:
                            self._resync_needed = "reconnected"
                        connected_once = True
                if sub in ready:
                    await self._receive(sub, await sub.recv_multipart())
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _receive(self, sub, frames: list[bytes]) -> None:
        try:
            gap_from = self.on_batch(frames)
            if gap_from is not None:
                await self._fill_gap(gap_from, frames)
        except BadEvent as e:
            self.index.metrics.kv_events_rejected.labels(self.worker.url, e.reason).inc()
            logger.warning(
                "KV events of %s (dp %d): rejected a batch (%s); rebuilding the index",
                self.worker.url,
                self.dp_rank,
                e,
            )
            self._resync_needed = "bad_event"
        except _Restarted as e:
            logger.info(
                "KV events of %s (dp %d): %s (publisher restarted); rebuilding the index",
                self.worker.url,
                self.dp_rank,
                e,
            )
            self._resync_needed = "restart"

    async def _fill_gap(self, start: int, trigger: list[bytes]) -> None:
        """Batches ``start`` .. the trigger's seq - 1 from the replay socket, then the trigger;
        a resync when the replay cannot give them all."""
        end = int.from_bytes(trigger[1], "big")
        if self.replay:
            with contextlib.suppress(asyncio.TimeoutError, zmq.ZMQError):
                await asyncio.wait_for(self._replay(start, end), REPLAY_TIMEOUT_S)
        if self.expected != end:
            self._resync_needed = "gap"
            return
        self.index.metrics.kv_index_resyncs.labels(self.worker.url, "replayed").inc()
        self.on_batch(trigger)

    async def _replay(self, start: int, end: int) -> None:
        dealer = self.index.ctx.socket(zmq.DEALER)
        try:
            dealer.connect(self.replay)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await dealer.recv_multipart()  # [b"", topic, seq, payload]
                if len(frames) != 4 or frames[2] == _END_OF_REPLAY:
                    return
                seq = int.from_bytes(frames[2], "big")
                if seq == self.expected and seq < end:
                    self._apply_payload(frames[3])
                    self.expected = seq + 1
        finally:
            dealer.close(linger=0)

    async def _resync(self, sub, reason: str) -> None:
        """Rebuild from a snapshot, then apply what arrived meanwhile. Retried (every second) until
        it works."""
        self.drop()
        try:
            snap = await self.index.snapshot(self.worker)
            group = next(g for g in snap["groups"] if g.get("dp_rank", 0) == self.dp_rank)
            self.block_size = int(snap["block_size"])
            stored = [
                BlockStored(
                    block_hashes=e["block_hashes"],
                    parent_block_hash=e["parent_block_hash"],
                    token_ids=e["token_ids"],
                    block_size=self.block_size,
                    medium=e.get("medium"),
                    lora_name=e.get("lora_name"),
                )
                for e in group["events"]
            ]
            self.apply(stored)
            seq = group["seq"]
        except BadEvent as e:
            self.index.metrics.kv_events_rejected.labels(self.worker.url, e.reason).inc()
            logger.warning(
                "KV events snapshot of %s (dp %d) rejected: %s", self.worker.url, self.dp_rank, e
            )
            self.drop()
            return
        except (httpx.HTTPError, ValueError, KeyError, TypeError, StopIteration) as e:
            logger.debug(
                "KV events snapshot of %s (dp %d) failed: %r", self.worker.url, self.dp_rank, e
            )
            self.drop()
            return
        self.expected = (seq if isinstance(seq, int) else -1) + 1
        self._resync_needed = None
        self.index.metrics.kv_index_resyncs.labels(self.worker.url, reason).inc()
        logger.info(
            "KV index of %s (dp %d) rebuilt (%s): %d blocks, next seq %d",
            self.worker.url,
            self.dp_rank,
            reason,
            len(self.hashes),
            self.expected,
        )
        while True:  # what was published while the snapshot was on its way
            try:
                frames = await sub.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if (
                len(frames) == 3
                and len(frames[1]) == 8
                and int.from_bytes(frames[1], "big") < self.expected
            ):
                continue  # already in the snapshot
            await self._receive(sub, frames)


class _Restarted(Exception):
    pass


class KVIndex:
    """Every worker's feeds; started for a worker when its server info names a KV events
    endpoint."""

    def __init__(self, metrics, client_factory, tier_weights: Optional[dict[str, float]] = None):
        self.metrics = metrics
        # what a block in a tier below the pool counts for, by medium (a pool block counts 1)
        self.tier_weights = tier_weights or {}
        self.ctx = zmq.asyncio.Context()
        self.feeds: dict[str, list[GroupFeed]] = {}  # by worker URL
        self._client_factory = client_factory  # the pool's HTTP client (created at start)

    async def snapshot(self, worker: Worker) -> dict:
        resp = await self._client_factory().get(worker.url + "/kv_events/snapshot")
        resp.raise_for_status()
        return resp.json()

    def attach(self, worker: Worker, info: dict) -> None:
        """(Re)start ``worker``'s feeds from its ``/server_info`` (nothing when it publishes no
        events)."""
        endpoint = info.get("kv_events_endpoint")
        if not isinstance(endpoint, str) or not endpoint:
            if worker.url not in self.feeds:
                logger.warning(
                    "%s %s publishes no KV events (start it with --kv-events-endpoint); "
                    "its cache is not known to the router",
                    worker.role,
                    worker.url,
                )
            self.detach(worker)
            return
        replay = info.get("kv_events_replay_endpoint") or None
        topic = str(info.get("kv_events_topic") or "").encode()
        dp_size = (
            info.get("dp_size")
            if isinstance(info.get("dp_size"), int) and info["dp_size"] >= 1
            else 1
        )
        wanted = [
            (
                g,
                _worker_endpoint(offset_port(endpoint, g), worker.host),
                replay and _worker_endpoint(offset_port(replay, g), worker.host),
            )
            for g in range(dp_size)
        ]
        current = self.feeds.get(worker.url)
        if current and [(f.dp_rank, f.endpoint, f.replay) for f in current] == wanted:
            return
        self.detach(worker)
        feeds = [GroupFeed(self, worker, g, ep, rep, topic) for g, ep, rep in wanted]
        for f in feeds:
            f.task = asyncio.create_task(f.run(), name=f"kv-events-{worker.url}-{f.dp_rank}")
        self.feeds[worker.url] = feeds
        logger.info(
            "following the KV events of %s %s on %s",
            worker.role,
            worker.url,
            ", ".join(f.endpoint for f in feeds),
        )

    def detach(self, worker: Worker) -> None:
        for f in self.feeds.pop(worker.url, []):
            if f.task is not None:
                f.task.cancel()

    async def stop(self) -> None:
        tasks = [f.task for feeds in self.feeds.values() for f in feeds if f.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.feeds.clear()
        self.ctx.term()

    def matched_tokens(
        self, worker: Worker, prompt: Optional[PromptBlocks]
    ) -> tuple[int, Optional[int]]:
        """(tokens of ``prompt``'s longest prefix that one of ``worker``'s groups holds, that
        group)."""
        if prompt is None:
            return 0, None
        best, group = 0, None
        for f in self.feeds.get(worker.url, []):
            n = f.matched_blocks(prompt) * (f.block_size or 0)
            if n > best:
                best, group = n, f.dp_rank
        return best, group

    def weighted_tokens(self, worker: Worker, prompt: Optional[PromptBlocks]) -> float:
        """``matched_tokens`` counting a prefix held below the pool at its tier's weight (the
        prompt tokens ``worker``'s best group is spared computing, as cache_aware weighs them)."""
        if prompt is None:
            return 0.0
        return max(
            (
                f.weighted_blocks(prompt, self.tier_weights) * (f.block_size or 0)
                for f in self.feeds.get(worker.url, [])
            ),
            default=0.0,
        )

    def group_weighted(self, worker: Worker, prompt: PromptBlocks) -> dict[int, float]:
        """``weighted_tokens`` of each of ``worker``'s DP groups."""
        return {
            f.dp_rank: f.weighted_blocks(prompt, self.tier_weights) * (f.block_size or 0)
            for f in self.feeds.get(worker.url, [])
        }

    def group_matches(self, worker: Worker, prompt: PromptBlocks) -> dict[int, int]:
        """Tokens of ``prompt``'s longest cached prefix in each of ``worker``'s DP groups."""
        return {
            f.dp_rank: f.matched_blocks(prompt) * (f.block_size or 0)
            for f in self.feeds.get(worker.url, [])
        }

    def known(self, worker: Worker) -> bool:
        return any(f.synced for f in self.feeds.get(worker.url, []))

    def describe(self) -> dict:
        return {url: [f.describe() for f in feeds] for url, feeds in self.feeds.items()}

    def blocks(self) -> dict[str, int]:
        return {url: sum(len(f.hashes) for f in feeds) for url, feeds in self.feeds.items()}
