"""An encoder server (``pdserve serve --encoder-only``): a vision-language checkpoint's tower
alone, computing image embeddings for prefill servers (EPD: encoder / prefill / decode).

A prefill asks over ZMQ (``EncodeWant``: the image's patches and grid, and where in its
registered embedding pages to put the result, with its transfer backend's description); the
encoder runs the tower, writes the embeddings straight into those pages with the configured
transfer backend (``--disaggregation-transfer-backend``: the same engines as KV transfer) and
answers ``EncodeDone``. The prefill's port for it is ``--disaggregation-bootstrap-port``;
``--port`` answers ``/health`` and ``/server_info`` over HTTP.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

import numpy as np
import torch
import zmq

from pdserve.disagg.messages import ProtocolError
from pdserve.multimodal.epd_messages import EncodeDone, EncodeWant, EpdCodec

logger = logging.getLogger(__name__)


def load_tower(model_path: str, dtype: str):
    """The checkpoint's vision tower alone, its weights read from ``visual.*``."""
    from pdserve.layers.qwen_vision import Qwen25VisionTower
    from pdserve.models.loader import allocate, iter_safetensors, load_config, resolve_dtype

    config = load_config(model_path)
    vision = getattr(config, "vision_config", None)
    if vision is None:
        raise ValueError(f"--encoder-only: {model_path} has no vision tower")
    torch_dtype = resolve_dtype(config, dtype)
    with torch.device("meta"):
        tower = Qwen25VisionTower(vision)
    tower = allocate(tower, torch_dtype, "cpu")
    names = set(tower.checkpoint_names())
    for name, src in iter_safetensors(model_path):
        if name.startswith("visual."):
            tower.load_checkpoint(name[len("visual.") :], src)
            names.discard(name[len("visual.") :])
    if names:
        raise ValueError(f"{model_path}: the checkpoint lacks visual.{sorted(names)[0]}")
    if torch_dtype == torch.bfloat16:  # the matmuls on pdserve's kernels, as in a prefill
        from pdserve import kernels
        from pdserve.layers.linear import prepack_linears

        prepack_linears(tower, kernels.load(), dtype=torch_dtype)
    return tower.eval().requires_grad_(False)


class EncoderService:
    """The ZMQ side: one ROUTER socket; each request is encoded and written in turn."""

    def __init__(self, args, tower):
        from pdserve.disagg.transfer.base import get_backend

        self.args, self.tower = args, tower
        self.backend_name = args.disaggregation_transfer_backend
        self.backend = get_backend(self.backend_name)("prefill")
        self.staging: Optional[torch.Tensor] = None  # registered source of every write
        self.peers: set[str] = set()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(f"tcp://{args.host}:{args.disaggregation_bootstrap_port}")
        self.encoded = 0
        # seconds in the tower and in the writes, and bytes written (for /server_info)
        self.tower_s = self.write_s = 0.0
        self.bytes_written = 0

    def _stage(self, nbytes: int) -> torch.Tensor:
        if self.staging is None or self.staging.numel() < nbytes:
            size = max(nbytes, 1 << 20)
            self.staging = self.backend.buffer_allocator("cpu")(size, torch.device("cpu"))
            self.backend.register_regions([(self.staging.data_ptr(), size)])
        return self.staging

    def handle(self, want: EncodeWant) -> EncodeDone:
        try:
            grid = tuple(want.grid)
            patches = torch.frombuffer(bytearray(want.pixels), dtype=torch.float32)
            t0 = time.perf_counter()
            embeds = self.tower(patches.view(-1, want.patch_width), grid)
            t1 = time.perf_counter()
            out = embeds.to(getattr(torch, want.dtype)).contiguous()
            raw = out.view(torch.uint8).reshape(-1)
            if raw.numel() != sum(want.lengths):
                return EncodeDone(
                    room=want.room,
                    error=f"{raw.numel()} bytes of embeddings for {sum(want.lengths)} asked",
                )
            staging = self._stage(raw.numel())
            staging[: raw.numel()].copy_(raw)
            if want.session not in self.peers:
                regions = [tuple(r) for r in want.regions]
                self.backend.connect(want.session, want.backend_info, regions)
                self.peers.add(want.session)
            lengths = np.asarray(want.lengths, dtype=np.int64)
            src = staging.data_ptr() + np.concatenate([[0], np.cumsum(lengths)[:-1]])
            handle = self.backend.write(
                want.session, src.astype(np.int64), np.asarray(want.dst, dtype=np.int64), lengths
            )
            handle.wait()
            self.encoded += 1
            self.tower_s += t1 - t0
            self.write_s += time.perf_counter() - t1
            self.bytes_written += raw.numel()
            return EncodeDone(room=want.room)
        except Exception as e:  # the prefill's request fails, naming it; the server goes on
            logger.warning("encoding room %s failed: %s", want.room, e)
            return EncodeDone(room=want.room, error=f"{type(e).__name__}: {e}")

    def serve_forever(self) -> None:
        codec = EpdCodec(self.args.disaggregation_secret)
        while True:
            ident, *frames = self.sock.recv_multipart()
            try:
                msg = codec.read(frames)
            except ProtocolError as e:  # (AuthError too) dropped: the sender times out
                logger.warning("dropped a message from a prefill: %s", e)
                continue
            if isinstance(msg, EncodeWant):
                if msg.backend != self.backend_name:
                    done = EncodeDone(
                        room=msg.room,
                        error=f"transfer backend {msg.backend!r}, this encoder runs "
                        f"{self.backend_name!r}",
                    )
                else:
                    done = self.handle(msg)
                self.sock.send_multipart([ident, *codec.frames(done)])


def _http(args, service: EncoderService) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path not in ("/health", "/server_info"):
                self.send_error(404, "an encoder server answers /health and /server_info")
                return
            body = (
                b"{}"
                if self.path == "/health"
                else json.dumps(
                    {
                        "role": "encoder",
                        "model_path": args.model_path,
                        "encoder_port": args.disaggregation_bootstrap_port,
                        "transfer_backend": service.backend_name,
                        "images_encoded": service.encoded,
                        "tower_seconds": service.tower_s,
                        "write_seconds": service.write_s,
                        "bytes_written": service.bytes_written,
                    }
                ).encode()
            )
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    return ThreadingHTTPServer((args.host, args.port), Handler)


def run_encoder(args) -> int:
    if args.torch_num_threads:
        torch.set_num_threads(args.torch_num_threads)
    tower = load_tower(args.model_path, args.dtype)
    service = EncoderService(args, tower)
    httpd = _http(args, service)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    logger.info(
        "encoder server: the vision tower of %s; prefills on port %d, HTTP on %d",
        args.model_path,
        args.disaggregation_bootstrap_port,
        args.port,
    )
    try:
        service.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.shutdown()
        service.backend.close()
    return 0
