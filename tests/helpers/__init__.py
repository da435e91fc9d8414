"""Test helpers: tiny checkpoints (``checkpoints``) and a minimal paged runner for model tests."""

from __future__ import annotations

import torch

from pdserve.engine.kv_pool import KVPool, PageAllocator
from pdserve.forward_batch import ForwardBatch, GroupTable
from pdserve.kv_spec import group_layers
from pdserve.layers.attention.torch_backend import TorchAttnBackend


class PagedRunner:
    """Runs a model over real ``KVPool``s (one per cache group) + ``TorchAttnBackend`` with
    hand-built ``ForwardBatch``es, tracking each sequence's pages and length (what the engine's
    cache manager does; here every group keeps every page, the masks do the windowing)."""

    def __init__(
        self, model, page_size: int, num_pages: int = 256, kv_dtype: torch.dtype | None = None
    ):
        param = next(model.parameters())
        self.model = model
        self.cache_groups = group_layers(model.kv_cache_specs(), model.first_layer)
        self.pools = [
            KVPool(
                len(g.layers),
                num_pages,
                page_size,
                g.spec.num_kv_heads,
                g.spec.head_dim,
                kv_dtype or param.dtype,
                param.device,
            )
            for g in self.cache_groups
        ]
        self.pool = self.pools[0]
        self.layer_group, self.layer_slot = [], []
        for layer in range(model.first_layer, model.first_layer + len(model.kv_cache_specs())):
            g = next(g for g in self.cache_groups if layer in g.layers)
            self.layer_group.append(g.id)
            self.layer_slot.append(g.layers.index(layer))
        self.allocator = PageAllocator(num_pages)  # one page id serves every group's pool
        self.backend = TorchAttnBackend()
        self.pages: dict[object, list[int]] = {}
        self.lens: dict[object, int] = {}

    @torch.inference_mode()
    def extend(self, chunks: dict[object, list[int]]) -> dict[object, torch.Tensor]:
        """One forward over ``{seq id: new tokens}``; returns ``{seq id: logits [len, vocab]}``."""
        page = self.pool.page_size
        ids, positions, out_pages, out_offsets, prefix_lens, extend_lens = [], [], [], [], [], []
        for sid, tokens in chunks.items():
            prefix = self.lens.get(sid, 0)
            seq_pages = self.pages.setdefault(sid, [])
            need = -(-(prefix + len(tokens)) // page) - len(seq_pages)
            got = self.allocator.alloc(need)
            assert got is not None, "test pool too small"
            seq_pages += got
            for pos in range(prefix, prefix + len(tokens)):
                positions.append(pos)
                out_pages.append(seq_pages[pos // page])
                out_offsets.append(pos % page)
            ids += tokens
            prefix_lens.append(prefix)
            extend_lens.append(len(tokens))
            self.lens[sid] = prefix + len(tokens)
        max_pages = max(len(self.pages[sid]) for sid in chunks)
        table = torch.zeros(len(chunks), max_pages, dtype=torch.long)
        for row, sid in enumerate(chunks):
            table[row, : len(self.pages[sid])] = torch.tensor(self.pages[sid])
        device = self.pool.device
        out_pages_t = torch.tensor(out_pages, dtype=torch.long, device=device)
        fb = ForwardBatch(
            input_ids=torch.tensor(ids, device=device),
            positions=torch.tensor(positions, device=device),
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            groups=[GroupTable(pool, table.to(device), out_pages_t) for pool in self.pools],
            layer_group=self.layer_group,
            layer_slot=self.layer_slot,
            out_offsets=torch.tensor(out_offsets, dtype=torch.long, device=device),
            logits_idx=torch.arange(len(ids), device=device),
            attn_backend=self.backend,
        )
        self.backend.init_forward(fb)
        hidden = self.model(fb)
        logits = self.model.compute_logits(hidden[fb.logits_idx])
        return dict(zip(chunks, logits.split(extend_lens)))

    def greedy(self, sid, prompt: list[int], max_new_tokens: int) -> list[int]:
        """Greedy-decode one sequence; returns the new tokens."""
        out = []
        tokens = prompt
        for _ in range(max_new_tokens):
            nxt = int(self.extend({sid: tokens})[sid][-1].argmax())
            out.append(nxt)
            tokens = [nxt]
        return out
