"""A prefill's side of EPD: requests whose images an encoder server computes wait here until
every image's embeddings are in this server's memory, then go on as any request.

For each such image (``ImageInput.encoder`` set by the router) the queue takes pages of its
embedding pool (``--encoder-pool-tokens`` rows of the model's width, in pages of ``PAGE`` rows,
registered with the transfer backend, the written side as decode's KV pool is), and sends the
encoder the patches with the pages' addresses (``EncodeWant``); the encoder writes the
embeddings there with the transfer backend and answers ``EncodeDone``. The rows are copied out
to the request (``Req.image_embeds``) and the pages freed. Embeddings are also kept by image
digest (``--encoder-cache-images`` of them, least recently used first out), so the same image
needs no encoder the next time. An encoder that fails an image or does not answer within
``--encoder-timeout`` is left out for ``DOWN_S`` seconds and the image goes to the next of its
``fallbacks``; with none left the request ends with a 503 naming the encoders.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import torch
import zmq

from pdserve.disagg.messages import ProtocolError
from pdserve.engine.request import FinishKind, FinishReason, Req
from pdserve.multimodal.epd_messages import EncodeDone, EncodeWant, EpdCodec

logger = logging.getLogger(__name__)

PAGE = 64  # embedding rows per page
DOWN_S = 30.0  # how long an encoder that failed is left out


@dataclass
class _Image:
    req: Req
    index: int  # the image's index in the request
    pages: list[int]
    deadline: float
    encoder: str


@dataclass
class _Waiting:
    req: Req
    rooms: set[int] = field(default_factory=set)
    error: Optional[str] = None
    tried: set[str] = field(default_factory=set)  # encoders that failed one of its images


class EncoderQueue:
    def __init__(self, args, hidden: int, dtype: torch.dtype):
        self.args = args
        self.backend_name = args.disaggregation_transfer_backend
        self.backend = None  # with the pool, at the first request that needs it
        self.hidden, self.dtype = hidden, dtype
        self.num_pages = max(1, args.encoder_pool_tokens // PAGE)
        row = hidden * torch.empty((), dtype=dtype).element_size()
        self.page_bytes = PAGE * row
        self.free_pages = list(range(self.num_pages))
        self.timeout_s = args.encoder_timeout
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.cache_size = args.encoder_cache_images
        self.session = f"epd-{os.getpid()}-{id(self):x}"
        self.window = None
        self.ctx = zmq.Context.instance()
        self.sockets: dict[str, zmq.Socket] = {}
        self.rooms = itertools.count(1)
        self.images: dict[int, _Image] = {}  # room -> an image in flight
        self.held: dict[Req, _Waiting] = {}  # request -> what it waits for
        self.backlog: list[Req] = []  # requests waiting for free pages
        self.codec = EpdCodec(args.disaggregation_secret)
        self.stats = {"encoded": 0, "cache_hits": 0, "failed": 0, "failovers": 0}
        self.down: dict[str, float] = {}  # encoder -> until when it is left out

    # ---- the scheduler's side ---------------------------------------------------------------
    @staticmethod
    def accepts(req: Req) -> bool:
        return any(im.encoder for im in req.images or ())

    @property
    def has_work(self) -> bool:
        """Requests held, or answers still due (an aborted request's pages come back with them)."""
        return bool(self.held or self.backlog or self.images)

    def queued(self) -> list[Req]:
        return list(self.held) + self.backlog

    def _ensure_pool(self) -> None:
        """The embedding pages, registered with the transfer backend as the written side."""
        if self.backend is not None:
            return
        from pdserve.disagg.transfer.base import get_backend

        backend = get_backend(self.backend_name)("decode")
        nbytes = self.num_pages * self.page_bytes
        self.buffer = backend.buffer_allocator("cpu")(nbytes, torch.device("cpu"))
        self.pool = self.buffer[:nbytes].view(self.dtype).view(self.num_pages, PAGE, self.hidden)
        backend.register_regions([(self.buffer.data_ptr(), nbytes)])
        self.window = backend.open_window(self.session)
        self.backend = backend
        logger.info(
            "encoder pool: %d pages of %d embedding rows (%.1f MiB), %s transfer backend",
            self.num_pages,
            PAGE,
            nbytes / 2**20,
            self.backend_name,
        )

    def add(self, req: Req) -> None:
        self._ensure_pool()
        self.held[req] = _Waiting(req)
        if not self._ask(req):
            self.backlog.append(req)

    def poll(self) -> tuple[list[Req], list[tuple[Req, FinishReason]]]:
        """(requests whose embeddings are all here, (request, why) of those that failed)."""
        for addr, sock in self.sockets.items():
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    msg = self.codec.read(frames)
                except ProtocolError as e:  # its image times out and fails over
                    logger.warning("dropped a message from encoder %s: %s", addr, e)
                    continue
                if isinstance(msg, EncodeDone):
                    self._done(msg, addr)
        now = time.monotonic()
        for room, image in list(self.images.items()):
            if now > image.deadline:
                self._fail_image(
                    room, f"encoder {image.encoder} sent no embeddings in {self.timeout_s:g} s"
                )
        still = []
        for req in self.backlog:
            if req in self.held and not self._ask(req):
                still.append(req)
        self.backlog = still
        ready, failed = [], []
        for req, w in list(self.held.items()):
            if w.error is not None and not w.rooms:
                del self.held[req]
                self.stats["failed"] += 1
                failed.append(
                    (req, FinishReason(FinishKind.ABORT, message=w.error, status_code=503))
                )
            elif w.error is None and not w.rooms and req not in self.backlog:
                del self.held[req]
                ready.append(req)
        return ready, failed

    def integrity(self) -> dict:
        """The embedding pages: free, in flight, and kept out of use after a timeout."""
        flight = sum(len(im.pages) for im in self.images.values())
        return {
            "encoder_pages_total": self.num_pages,
            "encoder_pages_free": len(self.free_pages),
            "encoder_pages_in_flight": flight,
            "encoder_pages_quarantined": self.num_pages - len(self.free_pages) - flight,
            "encoder_held_requests": len(self.held),
        }

    def drop(self, req: Req) -> None:
        """Forget ``req`` (aborted); its images' pages come back when their answers do."""
        self.held.pop(req, None)
        if req in self.backlog:
            self.backlog.remove(req)

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close(linger=0)
        if self.backend is not None:
            self.backend.close()

    # ---- images -----------------------------------------------------------------------------
    def _ask(self, req: Req) -> bool:
        """Send every image of ``req`` not yet asked for; False when the pool lacks pages."""
        w = self.held[req]
        for i, image in enumerate(req.images):
            if (
                not image.encoder
                or i in req.image_embeds
                or any(im.req is req and im.index == i for im in self.images.values())
            ):
                continue
            hit = self.cache.get(image.digest)
            if hit is not None:
                self.cache.move_to_end(image.digest)
                req.image_embeds[i] = hit
                self.stats["cache_hits"] += 1
                continue
            need = -(-image.tokens // PAGE)
            if need > self.num_pages:
                w.error = (
                    f"images[{i}]: {image.tokens} embedding rows, more than the encoder pool's "
                    f"{self.num_pages * PAGE} (--encoder-pool-tokens)"
                )
                continue
            if need > len(self.free_pages):
                return False
            now = time.monotonic()
            if self.down.get(image.encoder, 0.0) > now:  # in turn, one that is up
                up = [a for a in image.fallbacks if self.down.get(a, 0.0) <= now]
                if up:
                    image.fallbacks.remove(up[0])
                    image.fallbacks.append(image.encoder)
                    image.encoder = up[0]
            pages = [self.free_pages.pop() for _ in range(need)]
            room = next(self.rooms)
            self.images[room] = _Image(req, i, pages, now + self.timeout_s, image.encoder)
            w.rooms.add(room)
            self._send(image.encoder, self._want(room, image, pages))
        return True

    def _want(self, room: int, image, pages: list[int]) -> EncodeWant:
        row = self.page_bytes // PAGE
        dst, lengths, left = [], [], image.tokens * row
        for p in pages:
            addr = self.pool[p].data_ptr()
            dst.append(self.window.translate(addr) if self.window is not None else addr)
            lengths.append(min(left, self.page_bytes))
            left -= lengths[-1]
        regions = [(self.buffer.data_ptr(), self.num_pages * self.page_bytes)]
        if self.window is not None:
            regions = self.window.regions(regions)
        return EncodeWant(
            room=room,
            session=self.session,
            backend=self.backend_name,
            backend_info=self.backend.describe(),
            regions=[list(r) for r in regions],
            dst=dst,
            lengths=lengths,
            dtype=str(self.dtype).replace("torch.", ""),
            pixels=image.pixels,
            grid=list(image.grid),
            patch_width=image.patch_width,
        )

    def _send(self, addr: str, want: EncodeWant) -> None:
        sock = self.sockets.get(addr)
        if sock is None:
            sock = self.sockets[addr] = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(addr)
        sock.send_multipart(self.codec.frames(want))

    def _done(self, msg: EncodeDone, addr: str) -> None:
        image = self.images.pop(msg.room, None)
        if image is None:
            return  # timed out already
        w = self.held.get(image.req)
        if msg.error is None and w is not None:
            rows = self.pool[image.pages].reshape(-1, self.hidden)
            tokens = image.req.images[image.index].tokens
            embeds = rows[:tokens].clone()
            image.req.image_embeds[image.index] = embeds
            self._remember(image.req.images[image.index].digest, embeds)
            self.stats["encoded"] += 1
        self.free_pages.extend(image.pages)
        if w is not None:
            w.rooms.discard(msg.room)
            if msg.error is not None:
                self._failed(image, f"encoder {addr}: {msg.error}")

    def _fail_image(self, room: int, why: str) -> None:
        image = self.images.pop(room)
        # the pages stay out of use: a late write may still land there
        w = self.held.get(image.req)
        if w is not None:
            w.rooms.discard(room)
            self._failed(image, why)

    def _failed(self, image: _Image, why: str) -> None:
        """Leave the image's encoder out for a while and send the image to the next one up, or
        fail its request when none is left."""
        self.down[image.encoder] = time.monotonic() + DOWN_S
        req, w = image.req, self.held[image.req]
        spec = req.images[image.index]
        w.tried.add(image.encoder)
        untried = [a for a in spec.fallbacks if a not in w.tried]
        logger.warning("request %s, image %d: %s", req.rid, image.index, why)
        if not untried:
            w.error = f"{why}; no other encoder left for images[{image.index}]"
            return
        spec.fallbacks = [a for a in spec.fallbacks if a != untried[0]] + [spec.encoder]
        spec.encoder = untried[0]
        self.stats["failovers"] += 1
        if not self._ask(req) and req not in self.backlog:
            self.backlog.append(req)

    def _remember(self, digest: str, embeds: torch.Tensor) -> None:
        if self.cache_size <= 0:
            return
        self.cache[digest] = embeds
        self.cache.move_to_end(digest)
        while len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
