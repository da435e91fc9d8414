"""``ModelRunner``: owns the model, the KV pool and the attention backend of one rank."""

from __future__ import annotations

import gc
import logging
import os
from typing import Optional, Sequence

import torch

from pdserve import kernels
from pdserve.config import ServerArgs
from pdserve.distributed import SINGLE_RANK, Parallel
from pdserve.engine import routed_experts
from pdserve.engine.cache_kinds import make_pool
from pdserve.engine.dp_attention import DPGather
from pdserve.engine.kv_budget import PageRider, RiderSource, page_counts, scratch_pages
from pdserve.engine.kv_pool import BaseKVPool, BufferAllocator, default_allocator
from pdserve.engine.kv_quant import check_quantizable, checkpoint_kv_scales, kv_quant_for
from pdserve.engine.pipeline import pipeline_forward
from pdserve.engine.precision import choose_compute_dtype, choose_kv_cache_dtype
from pdserve.forward_batch import ForwardBatch, GroupTable
from pdserve.kv_spec import (
    DTYPE_BYTES,
    CacheGroup,
    FullAttention,
    anchor_group,
    group_layers,
    specs_of,
)
from pdserve.layers.attention.base import attention_backend_class, get_attention_backend
from pdserve.lora.layer import active as lora_rows
from pdserve.quantization.base import check_int8_activation_flags

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        args: ServerArgs,
        kv_allocator: BufferAllocator = default_allocator,
        par: Parallel = SINGLE_RANK,
        model_cls: Optional[type] = None,
        page_riders: Sequence[RiderSource] = (),
    ):
        """``page_riders``: what other parts of the server keep with the pages (a draft model's
        KV), counted in the memory budget."""
        from pdserve.models.loader import context_length, load_config, load_model, model_fingerprint
        from pdserve.quantization.registry import weight_format

        self.args = args
        self.par = par
        self.page_riders = list(page_riders)
        self.device = torch.device(args.device)
        # pdserve's CPU kernels (None on CUDA, or when they cannot be built: the PyTorch paths run)
        self.ops = kernels.load() if self.device.type == "cpu" else None
        hf_config = load_config(args.model_path)
        fmt = weight_format(hf_config)  # a quantized checkpoint: what it cannot be served with
        if fmt is not None:
            fmt.check_flags(args)
        else:
            check_int8_activation_flags(args)
        if args.quantization is not None:
            self._check_quantization_possible()
            self.dtype, why = torch.bfloat16, f"--quantization {args.quantization} computes in bf16"
        else:
            self.dtype, why = self._agree_on_dtype(hf_config)
        logger.info("compute dtype %s: %s", str(self.dtype).replace("torch.", ""), why)
        self.model, self.hf_config = load_model(
            args.model_path,
            dtype=str(self.dtype).replace("torch.", ""),
            device=args.device,
            load_format=args.load_format,
            seed=args.random_seed,
            par=par,
            moe=args.moe_options(),
            model_cls=model_cls,
            language_only=args.language_only,
            fmt=fmt,
        )
        if self.ops is not None:
            self.model.use_cpu_kernels(self.ops)
        deterministic = args.enable_deterministic_inference
        if deterministic:
            self._check_deterministic_possible()
        if fmt is not None and self.ops is not None and args.load_format != "dummy":
            held = fmt.use_kernels(self.model, self.ops, batch_invariant=deterministic)
            if held:
                logger.info(
                    "%s weights on pdserve's CPU kernels (ISA %s): %.1f MiB",
                    fmt.describe(),
                    self.ops.isa(),
                    held / 2**20,
                )
        if self.device.type == "cpu" and (self.dtype == torch.bfloat16 or deterministic):
            packed = self.model.prepack(self.ops, args.quantization, batch_invariant=deterministic)
            onednn = kernels.onednn_bf16()[0]
            what = (
                f"{args.quantization} (int8 weights, LM head bf16)"
                if args.quantization
                else "float32 (batch invariant)"
                if self.dtype == torch.float32
                else "bf16 (GEMV at every batch size: batch invariant)"
                if deterministic
                else ("bf16 (oneDNN" + (" + GEMV)" if self.ops else ")"))
                if onednn
                else f"bf16 (pdserve's kernels at every batch size, ISA {self.ops.isa()}: "
                "no oneDNN bf16 here)"
                if self.ops
                else "bf16 (PyTorch's own matmuls: neither oneDNN bf16 nor pdserve's kernels here)"
            )
            logger.info("matmul weights prepacked for %s: %.1f MiB", what, packed / 2**20)
        self.lora = None  # the LoRA adapters this rank holds (pdserve/lora/), --enable-lora
        if args.enable_lora:
            from pdserve.lora.manager import LoraManager

            self.lora = LoraManager(self.model, args.max_lora_rank, args.max_loaded_loras)
        self.kv_dtype = choose_kv_cache_dtype(args.kv_cache_dtype, self.dtype)
        self.kv_quant = kv_quant_for(args.kv_cache_dtype)  # None: a float cache
        self.fingerprint = model_fingerprint(self.hf_config)
        model_ctx = context_length(self.hf_config)
        self.context_length = args.context_length or model_ctx
        self.vocab_size = self.model.vocab_size
        specs = [specs_of(entry) for entry in self.model.kv_cache_specs()]  # per layer: its caches
        if args.disable_hybrid_swa_memory:  # windows by masking over full pages
            specs = [
                tuple(
                    FullAttention(s.num_kv_heads, s.head_dim, total_kv_heads=s.total_kv_heads)
                    if isinstance(s, FullAttention)
                    else s
                    for s in entry
                )
                for entry in specs
            ]
        self.cache_groups: list[CacheGroup] = group_layers(specs, self.model.first_layer)
        check_quantizable(
            self.kv_quant,
            {g.kind for g in self.cache_groups},
            ",".join(getattr(self.hf_config, "architectures", None) or ["this model"]),
        )
        self.kv_tensor_scales = self._load_kv_tensor_scales()
        # per layer of this stage and cache kind it keeps: its group and its slot in that group's
        # pool
        first = self.model.first_layer
        self.layer_caches = [
            {
                g.spec.key: (g.id, g.layers.index(first + i))
                for g in self.cache_groups
                if first + i in g.layers
            }
            for i in range(len(specs))
        ]
        # the group and slot of each layer's first cache (-1: a layer that keeps none)
        first_cache = [
            self.layer_caches[i][entry[0].key] if entry else (-1, -1)
            for i, entry in enumerate(specs)
        ]
        self.layer_group = [g for g, _ in first_cache]
        self.layer_slot = [slot for _, slot in first_cache]
        try:
            self.anchor = anchor_group(self.cache_groups)  # its pool stands for the cache's layout
        except ValueError as e:
            if self.par.pp_size == 1:
                raise
            last = first + len(specs) - 1
            raise ValueError(
                f"pp_size: pipeline stage {self.par.pp_rank} (layers {first}..{last}) keeps no "
                "per-token cache: all its layers are linear-attention or MLP-only layers, and a "
                "stage's pages need an attention layer to count them; choose a pp_size whose "
                f"every stage holds an attention layer ({e})"
            ) from None
        # --enable-return-routed-experts: the ids of every token, kept with the pages of one group
        self.routed_spec = (
            routed_experts.plan(self.model, self.cache_groups)
            if args.enable_return_routed_experts
            else None
        )
        self._allocate_kv(self._num_pages(), kv_allocator)
        # a speculative draft model's runner, its KV in the pages of group ``draft_host``
        # (engine/speculative/draft_model.py)
        self.draft: Optional["ModelRunner"] = None
        self.draft_host = -1
        # keep each forward's final hidden states (``last_hidden``, [T, hidden]) for a draft head
        self.capture_hidden = False
        self.last_hidden: Optional[torch.Tensor] = None
        self.attn_backend_name = self._attention_backend()
        self.attn_backend = get_attention_backend(
            self.attn_backend_name,
            **(
                {"ops": self.ops, "compute_dtype": self.dtype, "deterministic": deterministic}
                if self.attn_backend_name == "cpu"
                else {}
            ),
        )
        if deterministic and self.attn_backend_name != "cpu":
            raise ValueError(
                "enable_deterministic_inference: this model's attention runs on the 'torch' "
                "backend (SDPA), whose rows are not independent of the batch; it needs the 'cpu' "
                f"backend, which does not support it: {self._why_not_cpu_attention()}"
            )
        arch = ",".join(getattr(self.hf_config, "architectures", None) or ["?"])
        self.attn_backend.check_supported(self.attention_kinds, self.model.attention_layers(), arch)
        if self.attn_backend_name == "cpu" and self.dtype == torch.bfloat16 and not self.kv_quant:
            # when the model offers one for its configuration (its kernel reads a float cache)
            self.model.enable_decode_stack(self.ops, batch_invariant=deterministic)
        logger.info(
            "model %s loaded: %d layers, dtype %s, KV cache %s in %s, attention %s",
            os.path.basename(args.model_path.rstrip("/")),
            len(specs),
            self.dtype,
            self.kv_dtype,
            "; ".join(
                f"{len(g.layers)} {g.kind} layer(s): {p.num_pages} pages x {args.page_size} tokens "
                f"({p.nbytes / 2**20:.1f} MiB)"
                for g, p in zip(self.cache_groups, self.pools)
            ),
            self.attn_backend_name,
        )

    @property
    def attention_kinds(self) -> set[str]:
        """The cache kinds the attention backend serves: the paged groups' (a per-request state
        is its layers' own business, a position ledger holds nothing)."""
        return {g.kind for g in self.cache_groups if g.spec.attended and not g.spec.per_request}

    def _allocate_kv(self, counts: list[int], kv_allocator: BufferAllocator) -> None:
        """The pools of the cache groups (``counts`` pages each) and the routed experts' store."""
        self.pools = [
            self._make_pool(g, n, kv_allocator) for g, n in zip(self.cache_groups, counts)
        ]
        self.pool = self.pools[self.anchor]
        if (self.args.speculative_eagle_topk or 1) > 1:  # a tree's tokens need scratch pages
            for g, pool in zip(self.cache_groups, self.pools):
                if not g.spec.per_request:
                    n = scratch_pages(self.args, pool.page_size)
                    if n >= pool.allocator.num_free():
                        raise ValueError(
                            f"speculative_eagle_topk: a tree's rows need {n} scratch pages of "
                            f"cache group {g.id}, and its pool has {pool.allocator.capacity}: "
                            "raise --max-total-tokens or build smaller trees"
                        )
                    pool.scratch = tuple(pool.allocator.set_aside(n))
        self.routed: Optional[routed_experts.RoutedExpertsStore] = None
        if self.routed_spec is not None:
            spec = self.routed_spec
            self.routed = routed_experts.RoutedExpertsStore(
                spec,
                self.pools[spec.group].num_pages,
                self.args.page_size,
                self.model.moe_blocks()[0].ctx,
                self.device,
                kv_allocator,
            )

    def reallocate_kv(self, kv_allocator: BufferAllocator) -> None:
        """Empty pools of the same sizes from ``kv_allocator`` (a role switch: a decode's must be
        visible to its transfer backend). The old ones are dropped first, so that their memory is
        not held twice; the caller holds no reference to them."""
        counts = [p.num_pages for p in self.pools]
        self.pools, self.pool, self.routed = [], None, None
        self.attn_backend.drop_forward_state()
        gc.collect()  # what held the old pools may sit in reference cycles (a closed KV manager's)
        self._allocate_kv(counts, kv_allocator)
        if self.draft is not None:
            self.draft.reallocate_kv(kv_allocator)
            self.draft.share_scratch(self.pools[self.draft_host])

    def share_scratch(self, host: BaseKVPool) -> None:
        """A draft's pools, indexed by the host group's page ids, use its scratch pages."""
        for pool in self.pools:
            pool.scratch = host.scratch

    def _make_pool(
        self, group: CacheGroup, num_pages: int, allocator: BufferAllocator
    ) -> BaseKVPool:
        pool = make_pool(
            group,
            num_pages,
            self.args.page_size,
            self.kv_dtype,
            self.device,
            allocator,
            self.kv_quant,
        )
        if self.kv_quant is not None and not self.kv_quant.per_token:
            one = (1.0, 1.0)
            pool.set_tensor_scales([self.kv_tensor_scales.get(i, one) for i in group.layers])
        return pool

    def _load_kv_tensor_scales(self) -> dict[int, tuple[float, float]]:
        """fp8 KV: the checkpoint's per-layer (k_scale, v_scale) (1.0 where it has none)."""
        if self.kv_quant is None or self.kv_quant.per_token:
            return {}
        scales = checkpoint_kv_scales(self.args.model_path)
        logger.info(
            "KV cache %s: k_scale/v_scale %s",
            self.kv_quant.name,
            f"of {len(scales)} layers from the checkpoint"
            if scales
            else "1.0 (none in the checkpoint)",
        )
        return scales

    def _agree_on_dtype(self, hf_config) -> tuple[torch.dtype, str]:
        """Rank 0's choice on every rank (a measurement could differ between ranks)."""
        if self.par.world.rank == 0:
            dtype, why = choose_compute_dtype(
                self.args.dtype, self.device.type, hf_config, self.ops
            )
            choice = f"{str(dtype).replace('torch.', '')}|{why}"
        else:
            choice = None
        name, _, why = self.par.world.broadcast_object_str(choice).partition("|")
        return getattr(torch, name), why

    def _check_deterministic_possible(self) -> None:
        if self.device.type != "cpu":
            raise ValueError(
                "enable_deterministic_inference: implemented for CPU serving only (batch-invariant "
                "GEMMs and attention are pdserve's CPU kernels); it is not available on "
                f"{self.device.type}"
            )
        if self.ops is None:
            raise ValueError(
                "enable_deterministic_inference: needs pdserve's CPU kernels (batch-invariant "
                f"GEMMs and attention), which are not available ({kernels.unavailable_reason()})"
            )

    def _why_not_cpu_attention(self) -> str:
        if self.args.attention_backend == "torch":
            return "--attention-backend torch was asked for"
        cpu = attention_backend_class("cpu")
        missing = cpu.missing_features(self.model.attention_layers())
        missing += sorted(self.attention_kinds - cpu.cache_kinds)
        return (
            f"the model's attention uses {', '.join(missing)}"
            if missing
            else "the kernels are not available"
        )

    def _check_quantization_possible(self) -> None:
        if self.ops is None:
            raise ValueError(
                f"quantization: {self.args.quantization!r} needs pdserve's CPU kernels, which are "
                f"not available ({kernels.unavailable_reason()})"
            )
        if not self.ops.has_int8_dot():
            raise ValueError(
                f"quantization: {self.args.quantization!r} needs SIMD int8 dot products (AVX2, "
                "AVX-VNNI or AVX512-VNNI on x86-64, NEON on Arm), which this CPU (or "
                f"PDSERVE_CPU_ISA={self.ops.isa()}) does not offer"
            )

    def _attention_backend(self) -> str:
        name = self.args.attention_backend
        if (
            name == "auto"
        ):  # the kernels where they run and support every cache kind and layer feature
            cpu = attention_backend_class("cpu")
            fits = (
                not cpu.missing_features(self.model.attention_layers())
                and self.attention_kinds <= cpu.cache_kinds
            )
            return "cpu" if self.device.type == "cpu" and self.ops is not None and fits else "torch"
        if name == "cpu" and self.ops is None:
            raise ValueError(
                f"attention_backend: 'cpu' needs pdserve's CPU kernels, which are not available "
                f"({kernels.unavailable_reason()})"
            )
        return name

    def _num_pages(self) -> list[int]:
        """Pages of each group's pool on this rank; every rank takes the smallest rank's counts
        (the ranks of a group must take the same scheduling decisions, so their pools must be
        equal)."""
        counts = self._local_num_pages()
        if self.par.world.size > 1:
            import torch.distributed as dist

            t = torch.tensor(counts, dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.par.world.cpu_group)
            counts = [int(x) for x in t.tolist()]
        return counts

    def _local_num_pages(self) -> list[int]:
        """This rank's page counts (``kv_budget.page_counts``): a page of a group holds its
        layers' KV, a float32 scale per K/V row of a per-token quantized cache, and the riders
        (the routed experts' ids; what the server's other parts add, ``page_riders``)."""
        args = self.args
        item = DTYPE_BYTES[str(self.kv_dtype).replace("torch.", "")]
        per_page = [
            len(g.layers) * g.spec.page_bytes(args.page_size, item) for g in self.cache_groups
        ]
        if self.kv_quant is not None and self.kv_quant.per_token:
            per_page = [
                n + len(g.layers) * g.spec.page_bytes(args.page_size, 4) // g.spec.head_dim
                for n, g in zip(per_page, self.cache_groups)
            ]
        riders = []
        if self.routed_spec is not None:
            spec = self.routed_spec
            riders.append(PageRider(spec.group, spec.bytes_per_page(args.page_size), "experts"))
        if args.max_total_tokens is None:
            riders += [source(self.cache_groups, item) for source in self.page_riders]
        return page_counts(args, self.cache_groups, per_page, riders, self.device)

    @property
    def max_total_tokens(self) -> int:
        """Tokens the largest paged group's pool holds (the full-attention tokens of a mixed
        model)."""
        return (
            max(
                p.num_pages - 1
                for g, p in zip(self.cache_groups, self.pools)
                if not g.spec.per_request
            )
            * self.args.page_size
        )

    def make_forward_batch(
        self,
        input_ids: list[int],
        positions: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        page_lists: list[list[list[int]]],
        logits_idx: list[int],
        dp_counts: Optional[list[int]] = None,
        full_lens: Optional[list[int]] = None,
        trees: Optional[dict] = None,
    ) -> ForwardBatch:
        """``page_lists[i][g]``: request i's pages of cache group g (0: not kept);
        ``full_lens[i]``: its whole sequence's length (``ForwardBatch.full_lens``); ``trees``:
        the rows of speculative trees (``ForwardBatch.trees``)."""
        dev = self.device
        page = self.args.page_size
        max_pages = max(len(ids) for p in page_lists for ids in p)
        token_page: list[int] = []  # logical page of each new token, as row * max_pages + page
        out_offsets: list[int] = []
        for i in range(len(page_lists)):
            for pos in range(prefix_lens[i], prefix_lens[i] + extend_lens[i]):
                token_page.append(i * max_pages + pos // page)
                out_offsets.append(pos % page)
        where = torch.tensor(token_page, dtype=torch.long)
        groups = []
        for g, pool in enumerate(self.pools):
            table = torch.zeros((len(page_lists), max_pages), dtype=torch.long)
            for i, pages in enumerate(page_lists):
                table[i, : len(pages[g])] = torch.tensor(pages[g], dtype=torch.long)
            paged = not self.cache_groups[g].spec.per_request
            # a per-request group writes its slot (column 0), not pages
            out = table.view(-1)[where] if paged else torch.empty(0, dtype=torch.long)
            groups.append(GroupTable(pool, table.to(dev), out.to(dev), paged))
        fb = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            groups=groups,
            layer_group=self.layer_group,
            layer_slot=self.layer_slot,
            layer_caches=self.layer_caches,
            anchor=self.anchor,
            page_size=page,
            out_offsets=torch.tensor(out_offsets, dtype=torch.long, device=dev),
            logits_idx=torch.tensor(logits_idx, dtype=torch.long, device=dev),
            attn_backend=self.attn_backend,
            dp=DPGather(self.par, dp_counts) if dp_counts is not None else None,
            full_lens=full_lens,
            trees=trees or None,
        )
        if self.par.pp_size > 1:  # the pipeline splits the batch into micro-batches
            fb.parts = (
                input_ids,
                positions,
                prefix_lens,
                extend_lens,
                page_lists,
                logits_idx,
                full_lens,
            )
        return fb

    def move_tokens(self, pages: list[list[int]], src: list[int], dst: list[int]) -> None:
        """Copy one request's KV at positions ``src`` to positions ``dst`` in every paged group
        (``pages``: its pages per group): a speculative tree's accepted path moved to the
        sequence's slots."""
        page = self.args.page_size

        def where(ids: list[int], positions: list[int]):
            return (
                torch.tensor([ids[p // page] for p in positions], device=self.device),
                torch.tensor([p % page for p in positions], device=self.device),
            )

        for g, pool in enumerate(self.pools):
            if not self.cache_groups[g].spec.per_request:
                pool.move(where(pages[g], src), where(pages[g], dst))

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Run the model; return float32 logits for the rows ``fb.logits_idx``: [N, vocab] (on every
        pipeline stage: the last one computes them and broadcasts them)."""
        if self.par.pp_size > 1:
            return pipeline_forward(self, fb)
        self.attn_backend.init_forward(fb)
        if self.routed is not None:
            self.routed.begin_forward()
        with lora_rows(fb.adapters, fb.extend_lens):
            hidden = self.model(fb)
        if self.capture_hidden:  # a draft head reads every position's hidden state
            aux = getattr(self.model, "aux_hidden", None)
            self.last_hidden = hidden if aux is None else aux(hidden)
        if self.routed is not None:
            self.routed.write(fb)
        if fb.logits_idx.numel() == 0:
            return hidden.new_empty((0, self.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden[fb.logits_idx])

    @torch.inference_mode()
    def idle_forward(self, dp_counts: list[int]) -> None:
        """DP attention: this group has no tokens but another has; join the MLPs' collectives."""
        self.model.idle_forward(DPGather(self.par, dp_counts))
