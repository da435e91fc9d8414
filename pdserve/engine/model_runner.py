"""``ModelRunner``: owns the model, the KV pool and the attention backend of one rank."""

from __future__ import annotations

import logging
import os

import torch

from pdserve.config import ServerArgs
from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.kv_pool import BufferAllocator, KVPool, default_allocator
from pdserve.layers.attention.base import get_attention_backend

logger = logging.getLogger(__name__)

# Default share of available host memory for KV on CPU (servers often share one host).
CPU_DEFAULT_KV_FRACTION = 0.1


def cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_bf16" in f.read()
    except OSError:
        return False


def compute_dtype(args: ServerArgs) -> str:
    """``auto`` keeps the checkpoint's dtype, except on CPUs without AMX: there PyTorch's bf16/fp16
    matmuls run at about half the speed of fp32 ones, so the weights are upcast to fp32."""
    if args.dtype == "auto" and args.device == "cpu" and not cpu_has_amx():
        return "float32"
    return args.dtype


def _available_host_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


class ModelRunner:
    def __init__(self, args: ServerArgs, kv_allocator: BufferAllocator = default_allocator):
        from pdserve.models.loader import context_length, load_model, model_fingerprint

        self.args = args
        self.device = torch.device(args.device)
        self.model, self.hf_config = load_model(
            args.model_path, dtype=compute_dtype(args), device=args.device, load_format=args.load_format,
            seed=args.random_seed,
        )
        self.dtype = next(self.model.parameters()).dtype
        self.fingerprint = model_fingerprint(self.hf_config, self.dtype)
        model_ctx = context_length(self.hf_config)
        self.context_length = args.context_length or model_ctx
        self.vocab_size = self.model.vocab_size
        num_pages = self._num_pages()
        self.pool = KVPool(
            num_layers=self.model.num_layers, num_pages=num_pages, page_size=args.page_size,
            kv_heads=self.model.num_kv_heads, head_dim=self.model.head_dim, dtype=self.dtype,
            device=self.device, allocator=kv_allocator,
        )
        self.attn_backend = get_attention_backend("torch")
        logger.info(
            "model %s loaded: %d layers, dtype %s, KV pool %d pages x %d tokens (%.1f MiB)",
            os.path.basename(args.model_path.rstrip("/")), self.model.num_layers, self.dtype, num_pages,
            args.page_size, self.pool.buffer.numel() * self.pool.buffer.element_size() / 2**20,
        )

    def _num_pages(self) -> int:
        args = self.args
        per_page = KVPool.bytes_per_page(
            self.model.num_layers, args.page_size, self.model.num_kv_heads, self.model.head_dim, self.dtype
        )
        if args.max_total_tokens is not None:
            return (args.max_total_tokens + args.page_size - 1) // args.page_size + 1
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * args.mem_fraction_static)
        else:
            budget = int(_available_host_bytes() * min(args.mem_fraction_static, CPU_DEFAULT_KV_FRACTION))
        return max(2, budget // per_page + 1)

    @property
    def max_total_tokens(self) -> int:
        return (self.pool.num_pages - 1) * self.pool.page_size

    def make_forward_batch(
        self,
        input_ids: list[int],
        positions: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        page_lists: list[list[int]],
        logits_idx: list[int],
    ) -> ForwardBatch:
        dev = self.device
        page = self.pool.page_size
        max_pages = max(len(p) for p in page_lists)
        table = torch.zeros((len(page_lists), max_pages), dtype=torch.long)
        out_pages: list[int] = []
        out_offsets: list[int] = []
        for i, pages in enumerate(page_lists):
            table[i, : len(pages)] = torch.tensor(pages, dtype=torch.long)
            for pos in range(prefix_lens[i], prefix_lens[i] + extend_lens[i]):
                out_pages.append(pages[pos // page])
                out_offsets.append(pos % page)
        fb = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            page_table=table.to(dev),
            out_pages=torch.tensor(out_pages, dtype=torch.long, device=dev),
            out_offsets=torch.tensor(out_offsets, dtype=torch.long, device=dev),
            logits_idx=torch.tensor(logits_idx, dtype=torch.long, device=dev),
            kv_pool=self.pool,
            attn_backend=self.attn_backend,
        )
        return fb

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Run the model; return float32 logits for the rows ``fb.logits_idx``: [N, vocab]."""
        self.attn_backend.init_forward(fb)
        hidden = self.model(fb)
        if fb.logits_idx.numel() == 0:
            return hidden.new_empty((0, self.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden[fb.logits_idx])
