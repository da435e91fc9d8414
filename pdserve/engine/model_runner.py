"""``ModelRunner``: owns the model, the KV pool and the attention backend of one rank."""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from pdserve import kernels
from pdserve.config import ServerArgs
from pdserve.distributed import SINGLE_RANK, Parallel
from pdserve.engine.dp_attention import DPGather
from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.kv_pool import BufferAllocator, KVPool, default_allocator
from pdserve.engine.precision import choose_compute_dtype, choose_kv_cache_dtype
from pdserve.engine.pipeline import pipeline_forward
from pdserve.layers.attention.base import get_attention_backend

logger = logging.getLogger(__name__)

# Default share of available host memory for KV on CPU (servers often share one host).
CPU_DEFAULT_KV_FRACTION = 0.1


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
    def __init__(self, args: ServerArgs, kv_allocator: BufferAllocator = default_allocator,
                 par: Parallel = SINGLE_RANK):
        from pdserve.models.loader import context_length, load_config, load_model, model_fingerprint

        self.args = args
        self.par = par
        self.device = torch.device(args.device)
        # pdserve's CPU kernels (None on CUDA, or when they cannot be built: the PyTorch paths run)
        self.ops = kernels.load() if self.device.type == "cpu" else None
        hf_config = load_config(args.model_path)
        if args.quantization is not None:
            self._check_quantization_possible()
            self.dtype, why = torch.bfloat16, f"--quantization {args.quantization} computes in bf16"
        else:
            self.dtype, why = self._agree_on_dtype(hf_config)
        logger.info("compute dtype %s: %s", str(self.dtype).replace("torch.", ""), why)
        self.model, self.hf_config = load_model(
            args.model_path, dtype=str(self.dtype).replace("torch.", ""), device=args.device,
            load_format=args.load_format, seed=args.random_seed, par=par,
        )
        if self.ops is not None:
            self.model.use_cpu_kernels(self.ops)
        if self.device.type == "cpu" and self.dtype == torch.bfloat16:
            packed = self.model.prepack(self.ops, args.quantization)
            what = f"{args.quantization} (int8 weights, LM head bf16)" if args.quantization else \
                "bf16 (oneDNN" + (" + GEMV)" if self.ops else ")")
            logger.info("matmul weights prepacked for %s: %.1f MiB", what, packed / 2**20)
        self.kv_dtype = choose_kv_cache_dtype(args.kv_cache_dtype, self.dtype)
        self.fingerprint = model_fingerprint(self.hf_config)
        model_ctx = context_length(self.hf_config)
        self.context_length = args.context_length or model_ctx
        self.vocab_size = self.model.vocab_size
        num_pages = self._num_pages()
        self.pool = KVPool(
            num_layers=self.model.num_layers, num_pages=num_pages, page_size=args.page_size,
            kv_heads=self.model.num_kv_heads, head_dim=self.model.head_dim, dtype=self.kv_dtype,
            device=self.device, allocator=kv_allocator,
        )
        self.attn_backend_name = self._attention_backend()
        self.attn_backend = get_attention_backend(self.attn_backend_name, **(
            {"ops": self.ops, "compute_dtype": self.dtype} if self.attn_backend_name == "cpu" else {}))
        if self.attn_backend_name == "cpu" and self.dtype == torch.bfloat16:
            self.model.enable_decode_stack(self.ops)  # single-rank models only
        logger.info(
            "model %s loaded: %d layers, dtype %s, KV cache %s in %d pages x %d tokens (%.1f MiB), attention %s",
            os.path.basename(args.model_path.rstrip("/")), self.model.num_layers, self.dtype, self.kv_dtype, num_pages,
            args.page_size, self.pool.buffer.numel() * self.pool.buffer.element_size() / 2**20,
            self.attn_backend_name,
        )

    def _agree_on_dtype(self, hf_config) -> tuple[torch.dtype, str]:
        """Rank 0's choice on every rank (a measurement could differ between ranks)."""
        if self.par.world.rank == 0:
            dtype, why = choose_compute_dtype(self.args.dtype, self.device.type, hf_config, self.ops)
            choice = f"{str(dtype).replace('torch.', '')}|{why}"
        else:
            choice = None
        name, _, why = self.par.world.broadcast_object_str(choice).partition("|")
        return getattr(torch, name), why

    def _check_quantization_possible(self) -> None:
        if self.ops is None:
            raise ValueError(f"quantization: {self.args.quantization!r} needs pdserve's CPU kernels, which are not "
                             f"available ({kernels.unavailable_reason()})")
        if not self.ops.has_int8_dot():
            raise ValueError(f"quantization: {self.args.quantization!r} needs AVX512-VNNI int8 dot products, "
                             "which this CPU does not have")

    def _attention_backend(self) -> str:
        name = self.args.attention_backend
        if name == "auto":
            return "cpu" if self.device.type == "cpu" and self.ops is not None else "torch"
        if name == "cpu" and self.ops is None:
            raise ValueError(f"attention_backend: 'cpu' needs pdserve's CPU kernels, which are not available "
                             f"({kernels.unavailable_reason()})")
        return name

    def _num_pages(self) -> int:
        """Pages of this rank's pool; every rank takes the smallest rank's count (the ranks of a
        group must take the same scheduling decisions, so their pools must be equal)."""
        n = self._local_num_pages()
        if self.par.world.size > 1:
            import torch.distributed as dist

            t = torch.tensor([n], dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.par.world.cpu_group)
            n = int(t.item())
        return n

    def _local_num_pages(self) -> int:
        args = self.args
        per_page = KVPool.bytes_per_page(
            self.model.num_layers, args.page_size, self.model.num_kv_heads, self.model.head_dim, self.kv_dtype
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
        dp_counts: Optional[list[int]] = None,
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
            dp=DPGather(self.par, dp_counts) if dp_counts is not None else None,
        )
        if self.par.pp_size > 1:  # the pipeline splits the batch into micro-batches
            fb.parts = (input_ids, positions, prefix_lens, extend_lens, page_lists, logits_idx)
        return fb

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Run the model; return float32 logits for the rows ``fb.logits_idx``: [N, vocab] (on every
        pipeline stage: the last one computes them and broadcasts them)."""
        if self.par.pp_size > 1:
            return pipeline_forward(self, fb)
        self.attn_backend.init_forward(fb)
        hidden = self.model(fb)
        if fb.logits_idx.numel() == 0:
            return hidden.new_empty((0, self.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden[fb.logits_idx])

    @torch.inference_mode()
    def idle_forward(self, dp_counts: list[int]) -> None:
        """DP attention: this group has no tokens but another has; join the MLPs' collectives."""
        self.model.model.idle_forward(DPGather(self.par, dp_counts))
