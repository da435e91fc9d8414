"""Routed experts of every token the model ran (``--enable-return-routed-experts``, SGLang's
``return_routed_experts``): for reinforcement learning that replays the rollout's routing.

The ids live with the KV pages. ``RoutedExpertsStore`` holds one row per token slot of one cache
group that keeps every page (a full-attention group), addressed by that group's page ids:

    rows: [num_pages, page_size, num_moe_layers, top_k]   (int16, or int32 past 32767 experts)

Every forward writes the logical expert ids its tokens were routed to (``MoEContext.captured``,
each MoE layer's [T, K] in the batch's token order) at the tokens' (page, offset), for every
request, whether it asked or not. So a page's ids are there whenever its KV is: a prefix-cache
hit reads the ids of the request that computed the page, a chunked prefill's chunks and a
retracted request's recomputation land where their KV does, and in PD the rows travel as one
more transfer region paired with the group's pages (``disagg/kv_args.py``), written by prefill
during its forwards and sent with every chunk, so decode's copy of a page (received now, or held
in its own prefix cache) carries the ids prefill computed for it.

A request that asked gets, when it finishes, the rows of its tokens ``[start, kv_len)``: the
prompt and every generated token but the last (never fed back), in token order, laid out as
SGLang's ``meta_info["routed_experts"]``: little-endian int32 ``[tokens, num_hidden_layers,
top_k]``, whose rows of dense (non-MoE) layers are 0, as SGLang leaves them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from pdserve.engine.kv_pool import BufferAllocator, default_allocator
from pdserve.kv_region import Region
from pdserve.routed_experts_args import FLAG

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoutedExpertsSpec:
    """What the store holds: which layers, how many experts per token, in which cache group."""

    moe_layers: tuple[int, ...]  # global ids of the MoE layers, ascending
    num_layers: int  # the model's hidden layers (the output's layer axis)
    top_k: int
    num_experts: int
    group: int  # the cache group whose page ids address the rows

    @property
    def dtype(self) -> torch.dtype:
        return torch.int16 if self.num_experts <= torch.iinfo(torch.int16).max else torch.int32

    def bytes_per_page(self, page_size: int) -> int:
        return (
            page_size
            * len(self.moe_layers)
            * self.top_k
            * torch.empty((), dtype=self.dtype).element_size()
        )

    def describe(self) -> dict:
        """What a PD peer must agree on, and what the front end needs to validate requests."""
        return {
            "num_layers": self.num_layers,
            "moe_layers": list(self.moe_layers),
            "top_k": self.top_k,
            "dtype": str(self.dtype).replace("torch.", ""),
        }


def plan(model, cache_groups: Sequence) -> Optional[RoutedExpertsSpec]:
    """The store a model needs, or None when it has no MoE layer. ValueError when the ids of
    every token cannot be kept: a model without a cache group that keeps every page. (Pipeline
    stages, which see only their own layers, are refused with the flag in ``ServerArgs``.)"""
    blocks = model.moe_blocks()
    if not blocks:
        logger.warning(
            "%s: the model has no MoE layers; requests that ask for routed experts get 400", FLAG
        )
        return None
    routers = [getattr(m, m.router_name) for m in blocks]
    ks = {r.top_k for r in routers}
    if len(ks) != 1:
        raise ValueError(
            f"enable_return_routed_experts: the MoE layers route to different numbers of experts "
            f"{sorted(ks)}"
        )
    group = next((g.id for g in cache_groups if g.spec.keeps_every_page), None)
    if group is None:
        raise ValueError(
            f"enable_return_routed_experts: {FLAG} keeps the ids with the KV pages of a cache "
            "group that keeps every page; every layer of this model has a sliding window (start "
            "with --disable-hybrid-swa-memory)"
        )
    return RoutedExpertsSpec(
        tuple(m.layer_id for m in blocks),
        int(model.total_layers),
        ks.pop(),
        max(r.num_experts for r in routers),
        group,
    )


class RoutedExpertsStore:
    """The rows of one rank's pages (see the module docstring). Written by ``write`` after every
    forward, read by ``collect`` when a request finishes; only the scheduler loop touches it (and
    the transfer layer, through ``region``, the pages of rooms in flight)."""

    def __init__(
        self,
        spec: RoutedExpertsSpec,
        num_pages: int,
        page_size: int,
        ctx,
        device: torch.device,
        allocator: BufferAllocator = default_allocator,
    ):
        self.spec = spec
        self.page_size = page_size
        self.ctx = ctx  # the model's MoEContext: ``captured`` holds the last forward's ids
        self.device = torch.device(device)
        nbytes = num_pages * spec.bytes_per_page(page_size)
        raw = allocator(nbytes, self.device)
        # [num_pages, page_size, num_moe_layers, top_k]
        self.rows = raw.view(spec.dtype).view(
            num_pages, page_size, len(spec.moe_layers), spec.top_k
        )
        self._cols = torch.tensor(spec.moe_layers, dtype=torch.long)

    @property
    def num_pages(self) -> int:
        return self.rows.shape[0]

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    def region(self) -> Region:
        """The one transfer region: a row per page of the spec's cache group, the same on every
        rank of an attention group (replicated), so decode reads it from one prefill rank."""
        return Region(
            ptr=self.rows.data_ptr(),
            nbytes=self.nbytes,
            item_bytes=self.rows[0].numel() * self.rows.element_size(),
            group=self.spec.group,
            part="routed_experts",
            split="replicated",
        )

    def begin_forward(self) -> None:
        self.ctx.captured.clear()

    def write(self, fb) -> None:
        """Store the ids the forward just captured at its tokens' slots."""
        n = int(fb.input_ids.shape[0])
        if n == 0:
            return
        cols = []
        for layer in self.spec.moe_layers:
            ids = self.ctx.captured.get(layer)
            if ids is None or tuple(ids.shape) != (n, self.spec.top_k):
                got = None if ids is None else tuple(ids.shape)
                raise RuntimeError(
                    f"routed experts of MoE layer {layer}: the forward of {n} tokens captured "
                    f"{got}, expected ({n}, {self.spec.top_k})"
                )
            cols.append(ids)
        ids = torch.stack(cols, dim=1).to(self.device, self.spec.dtype)  # [T, moe_layers, K]
        self.rows[fb.groups[self.spec.group].out_pages, fb.out_offsets] = ids

    def read(self, pages: Sequence[int], start: int, end: int) -> torch.Tensor:
        """The ids of token positions ``start .. end`` of a sequence held in ``pages`` (the
        group's page of each logical page): int32 [end - start, num_layers, top_k] on the CPU,
        0 in the dense layers."""
        pos = torch.arange(start, end, dtype=torch.long)
        table = torch.tensor(list(pages), dtype=torch.long)
        if len(pos) and int(pos[-1]) // self.page_size >= len(table):
            raise AssertionError(
                f"positions up to {end} need {end // self.page_size + 1} pages, "
                f"the request holds {len(table)}"
            )
        page = table[pos // self.page_size].to(self.device)
        compact = self.rows[page, (pos % self.page_size).to(self.device)].to("cpu", torch.int32)
        out = torch.zeros((len(pos), self.spec.num_layers, self.spec.top_k), dtype=torch.int32)
        out[:, self._cols] = compact
        return out

    def collect(self, req) -> bytes:
        """What ``req`` gets: the rows of every token it ran from ``routed_experts_start_len``,
        as SGLang encodes them before base64 (little-endian int32)."""
        end = req.kv_len
        start = min(max(req.routed_experts_start_len, 0), end)
        return encode(self.read(req.kv.pages[self.spec.group], start, end))


def encode(ids: torch.Tensor) -> bytes:
    return np.ascontiguousarray(ids.numpy(), dtype="<i4").tobytes()


def decode(data: bytes, num_layers: int, top_k: int) -> np.ndarray:
    """The inverse of ``encode``: [tokens, num_layers, top_k] int32 (for clients and tests)."""
    return np.frombuffer(data, dtype="<i4").reshape(-1, num_layers, top_k)
