"""Test helpers: tiny checkpoints (``checkpoints``) and a minimal paged runner for model tests."""

from __future__ import annotations

import torch

from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.kv_pool import KVPool
from pdserve.layers.attention.torch_backend import TorchAttnBackend


class PagedRunner:
    """Runs a model over a real ``KVPool`` + ``TorchAttnBackend`` with hand-built ``ForwardBatch``es,
    tracking each sequence's pages and length (what the scheduler does in the engine)."""

    def __init__(self, model, page_size: int, num_pages: int = 256, kv_dtype: torch.dtype | None = None):
        param = next(model.parameters())
        self.model = model
        self.pool = KVPool(
            model.num_layers, num_pages, page_size, model.num_kv_heads, model.head_dim,
            kv_dtype or param.dtype, param.device,
        )
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
            got = self.pool.allocator.alloc(need)
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
        fb = ForwardBatch(
            input_ids=torch.tensor(ids, device=device),
            positions=torch.tensor(positions, device=device),
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            page_table=table.to(device),
            out_pages=torch.tensor(out_pages, device=device),
            out_offsets=torch.tensor(out_offsets, device=device),
            logits_idx=torch.arange(len(ids), device=device),
            kv_pool=self.pool,
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
