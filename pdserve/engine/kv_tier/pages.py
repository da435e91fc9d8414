"""A page's KV as bytes: every region of every cache group's pool for one logical page, read
out of the pools and written back into them; and the layout key that names that byte layout.

A paged pool is laid out region-major with the page axis next
(``KVPool``: ``[num_layers, 2, num_pages, ...]``, ``LatentPool``: ``[num_layers, num_pages, ...]``),
so as bytes it is ``[regions, num_pages, item_bytes]``: one item per (layer, K|V) and page. A
page's entry is its items of every region in pool order, group after group (an int8 cache's
scales are a pool's second such tensor: ``BaseKVPool.page_bytes``).
"""

from __future__ import annotations

import hashlib
import json
import re

import torch


class PageCodec:
    """Copies whole pages between the pools (one page id per group; every tensor of a pool
    holding page bytes) and flat byte rows."""

    def __init__(self, pools: list):
        held = [(g, v) for g, p in enumerate(pools) for v in p.page_bytes()]
        self.views = [v for _, v in held]
        self.owner = [g for g, _ in held]  # the group of each view
        self.widths = [v.shape[0] * v.shape[2] for v in self.views]  # bytes of a page per view
        self.page_nbytes = sum(self.widths)

    def read(self, pages: list[list[int]]) -> torch.Tensor:
        """``[n, page_nbytes]`` (on the CPU) for the ``n`` logical pages whose ids per group are
        ``pages[g]``."""
        rows = []
        for view, g in zip(self.views, self.owner):
            ids = pages[g]
            idx = torch.tensor(ids, dtype=torch.long, device=view.device)
            # [regions, n, item] -> [n, regions * item]
            rows.append(view.index_select(1, idx).transpose(0, 1).reshape(len(ids), -1))
        out = rows[0] if len(rows) == 1 else torch.cat(rows, dim=1)
        return out.cpu()

    def write(self, pages: list[list[int]], rows: torch.Tensor) -> None:
        """Store ``rows`` (``[n, page_nbytes]``, any device) into those pages."""
        start = 0
        for view, g, width in zip(self.views, self.owner, self.widths):
            ids = pages[g]
            idx = torch.tensor(ids, dtype=torch.long, device=view.device)
            part = rows[:, start : start + width].to(view.device)
            # [n, regions * item] -> [regions, n, item]
            view.index_copy_(1, idx, part.reshape(len(ids), view.shape[0], -1).transpose(0, 1))
            start += width


def layout_key(args, groups, pools, tp_rank: int, tp_size: int) -> str:
    """A name for the byte layout of a page of this server's pools: the model, then a digest of
    everything a page's bytes depend on (dtype, page size, each group's spec, layers and pool
    shape, the TP rank). Servers whose keys differ never read each other's entries."""
    model = (args.served_model_name or args.model_path).rstrip("/").rsplit("/", 1)[-1]
    model = re.sub(r"[^A-Za-z0-9._-]", "_", model)[:64] or "model"
    desc = {
        "model": args.model_path,
        "page_size": args.page_size,
        "tp": [tp_rank, tp_size],
        "groups": [
            {
                **g.describe(),
                "dtype": p.dtype_name,
                "shape": [[d for i, d in enumerate(v.shape) if i != 1] for v in p.page_bytes()],
            }
            for g, p in zip(groups, pools)
        ],
    }
    digest = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]
    return f"{model}-ps{args.page_size}-tp{tp_rank}of{tp_size}-{digest}"
