"""The MoE block: route, run the experts where they live, combine (``context.py`` explains the
layouts and the two dispatch backends).

``SparseMoE.run(h, dp)`` takes this DP group's tokens [T, H] and returns their outputs [T, H] in
the model dtype. The experts' weighted outputs are summed in float32 and rounded once (HF rounds
after each expert in bf16; the two agree exactly in float32). An optional shared expert
(``shared``, a ``GatedMLP``, registered as ``shared_name``) is added with weight 1, or
``sigmoid(shared_gate(x))`` when there is a gate (Qwen2-MoE). An optional ``expert_norm`` is
applied to the experts' input only, the router reading the tokens as they come (Gemma 4). With
``weights_on_input`` (Llama 4) a chosen expert takes the token times its weight and its output
counts as it is: each (token, choice) pair runs as a row of its own, summed over the choices.

Module names are the checkpoint's: the router is registered under ``router_name`` (``gate`` for
Qwen and Mixtral, ``router`` for GPT-OSS), the experts under ``experts``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from pdserve.layers.linear import Linear
from pdserve.layers.moe.context import MoEContext
from pdserve.layers.moe.experts import Experts
from pdserve.layers.moe.placement import to_physical
from pdserve.layers.moe.router import Router, Routing


class SparseMoE(nn.Module):
    def __init__(
        self,
        layer_id: int,
        router: Router,
        experts: Experts,
        ctx: MoEContext,
        router_name: str = "gate",
        shared: Optional[nn.Module] = None,
        shared_gate: Optional[Linear] = None,
        shared_name: str = "shared_expert",
    ):
        super().__init__()
        self.layer_id = layer_id
        self.router_name = router_name
        setattr(self, router_name, router)
        self.experts = experts
        self.ctx = ctx
        self.shared_name = (
            shared_name  # the checkpoint's: shared_expert (Qwen2-MoE), shared_experts (DeepSeek)
        )
        if shared is not None:
            setattr(self, shared_name, shared)
        if shared_gate is not None:
            self.shared_expert_gate = shared_gate
        self.has_shared = shared is not None
        self.has_shared_gate = shared_gate is not None
        self.expert_norm: Optional[nn.Module] = None  # set by a family that has one
        self.weights_on_input = False  # set by a family whose experts take the weight (Llama 4)
        self.slots_per_rank = ctx.placement.slots_per_rank
        # logical expert -> its physical slots; built on first use (the model is built on the meta
        # device, where a tensor made now would hold no data)
        self._dispatch: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def routing(self, x: torch.Tensor, token_ids: Optional[torch.Tensor] = None) -> Routing:
        """The router's choice for ``x`` (the router is registered as ``router_name``); a router
        that chooses by token id gets ``x``'s ``token_ids``."""
        router: Router = getattr(self, self.router_name)
        if router.needs_token_ids:
            if token_ids is None:
                raise ValueError(f"layer {self.layer_id}: its router needs the token ids")
            return router(x, token_ids)
        return router(x)

    def physical(self, ids: torch.Tensor) -> torch.Tensor:
        """Logical expert ids [T, K] -> physical slots (``placement.to_physical``)."""
        if self._dispatch is None:
            with torch.device("cpu"):
                table, counts = self.ctx.placement.dispatch_table(self.layer_id)
            self._dispatch = (table.to(ids.device), counts.to(ids.device))
        return to_physical(ids, *self._dispatch)

    # ---- the two dispatch paths --------------------------------------------------------------
    def run(
        self, h: torch.Tensor, dp: Optional[Any], token_ids: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """``token_ids``: ``h``'s tokens, for a router that chooses by them."""
        if self.ctx.a2a:
            return self._run_a2a(h, token_ids)
        x = dp.gather(h) if dp is not None else h
        if dp is not None and token_ids is not None:
            token_ids = dp.gather(token_ids[:, None])[:, 0]
        routing = self.routing(x, token_ids)
        self._observe(routing, counted=self.ctx.tp.rank == 0)
        if self.ctx.options.capture_routed_experts:
            self.ctx.captured[self.layer_id] = (
                dp.local(routing.ids) if dp is not None else routing.ids
            )
        slots = self.physical(routing.ids)
        first = self.ctx.ep_rank * self.slots_per_rank
        local = torch.where(
            (slots >= first) & (slots < first + self.slots_per_rank),
            slots - first,
            torch.full_like(slots, -1),
        )
        out = self.ctx.tp.all_reduce(
            self._experts(self.experts, self.expert_input(x), routing.weights, local)
        )
        y = self._with_shared(x, out.to(x.dtype))
        return dp.local(y) if dp is not None else y

    def expert_input(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.expert_norm is None else self.expert_norm(x)

    def _experts(self, run, x: torch.Tensor, weights: torch.Tensor, *choices: torch.Tensor):
        """``run(x, *choices, weights)`` (``choices``: [T, K] tensors saying where each choice
        runs) over the tokens, or with ``weights_on_input`` over one row per (token, choice): the
        token times its weight, weight 1 after; float32 [T, H] either way."""
        if not self.weights_on_input:
            return run(x, *choices, weights)
        t, k = weights.shape
        rows = (x[:, None, :] * weights[..., None].to(x.dtype)).reshape(t * k, x.shape[-1])
        ones = torch.ones((t * k, 1), dtype=weights.dtype, device=weights.device)
        flat = (c.reshape(t * k, 1) for c in choices)
        out = run(rows, *flat, ones)
        return out.view(t, k, out.shape[-1]).sum(dim=1)

    def _with_shared(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not self.has_shared:
            return y
        s = getattr(self, self.shared_name)(x)
        if self.has_shared_gate:
            s = torch.sigmoid(self.shared_expert_gate(x)) * s
        return y + s

    def _observe(self, routing: Routing, counted: bool) -> None:
        if counted:
            for observer in self.ctx.observers:
                observer(self.layer_id, routing.ids)

    def _run_a2a(self, h: torch.Tensor, token_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The ``torch`` backend: this rank's share of its group's tokens goes only where its
        experts are; outputs come back and are combined here, in a fixed order."""
        attn = self.ctx.par.attn
        t = h.shape[0]
        per = -(-t // attn.size) if attn.size > 1 else t
        start = min(t, attn.rank * per) if attn.size > 1 else 0
        mine = h[start : min(t, start + per)]
        routing = self.routing(
            mine, None if token_ids is None else token_ids[start : min(t, start + per)]
        )
        self._observe(routing, counted=True)
        slots = self.physical(routing.ids)
        dest = slots // self.slots_per_rank  # [n, K] the rank of each slot
        y = self._experts(
            lambda x, local, to, w: dispatch_combine(self.experts, x, local, to, w, self.ctx.tp),
            self.expert_input(mine),
            routing.weights,
            slots % self.slots_per_rank,
            dest,
        )
        out = self._with_shared(mine, y.to(h.dtype))
        if self.ctx.options.capture_routed_experts or attn.size > 1:
            ids = routing.ids
            if attn.size > 1:
                out, ids = gather_shares(out, t, per, attn), gather_shares(ids, t, per, attn)
            if self.ctx.options.capture_routed_experts:
                self.ctx.captured[self.layer_id] = ids
        return out


def dispatch_combine(
    experts: Experts,
    x: torch.Tensor,
    local: torch.Tensor,
    dest: torch.Tensor,
    weights: torch.Tensor,
    group,
) -> torch.Tensor:
    """All-to-all dispatch: each token goes once to every rank that holds one of its slots, with
    its K local slot ids (-1 for the slots elsewhere) and weights; each rank runs its experts on
    what it received and sends the float32 weighted sums back; they are added per token in rank
    order. Returns float32 [n, H]."""
    import torch.distributed as dist

    world = group.size
    n, k = local.shape
    hdim = x.shape[1]
    rows, blocks = [], []
    for r in range(world):  # rows for rank r, in token order
        on_r = dest == r
        tok = torch.nonzero(on_r.any(dim=1)).squeeze(1)
        ids = torch.where(on_r[tok], local[tok], torch.full_like(local[tok], -1)).to(torch.int32)
        w = weights[tok].float()
        rows.append(tok)
        blocks.append(pack_rows(x[tok], ids, w))
    dev = x.device  # NCCL on CUDA moves device tensors only
    send_counts = torch.tensor([len(t) for t in rows], dtype=torch.int64, device=dev)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group.group)
    row_bytes = hdim * x.element_size() + 8 * k
    send = torch.cat(blocks) if blocks else x.new_empty((0, row_bytes), dtype=torch.uint8)
    recv = torch.empty((int(recv_counts.sum()), row_bytes), dtype=torch.uint8, device=dev)
    dist.all_to_all_single(
        recv, send, [int(c) for c in recv_counts], [int(c) for c in send_counts], group=group.group
    )
    rx, rids, rw = unpack_rows(recv, hdim, k, x.dtype)
    ry = experts(rx, rids, rw).contiguous()
    n_sent = int(send_counts.sum())
    back = torch.empty((n_sent, hdim), dtype=torch.float32, device=dev)
    dist.all_to_all_single(
        back.view(-1).view(torch.uint8),
        ry.view(-1).view(torch.uint8),
        [int(c) * hdim * 4 for c in send_counts],
        [int(c) * hdim * 4 for c in recv_counts],
        group=group.group,
    )
    out = torch.zeros((n, hdim), dtype=torch.float32, device=dev)
    if n_sent:
        out.index_add_(0, torch.cat(rows), back)
    return out


def pack_rows(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[n, H] activations, [n, K] int32 slot ids and [n, K] float32 weights as [n, bytes] rows."""
    return (
        torch.cat(
            [
                x.contiguous().view(torch.uint8).view(x.shape[0], -1),
                ids.contiguous().view(torch.uint8),
                w.contiguous().view(torch.uint8),
            ],
            dim=1,
        )
        if x.shape[0]
        else torch.empty(
            (0, x.shape[1] * x.element_size() + 8 * ids.shape[1]),
            dtype=torch.uint8,
            device=x.device,
        )
    )


def unpack_rows(buf: torch.Tensor, hdim: int, k: int, dtype: torch.dtype):
    xb = hdim * torch.empty((), dtype=dtype).element_size()
    x = buf[:, :xb].contiguous().view(dtype)
    ids = buf[:, xb : xb + 4 * k].contiguous().view(torch.int32)
    w = buf[:, xb + 4 * k :].contiguous().view(torch.float32)
    return x, ids.long(), w


def gather_shares(part: torch.Tensor, total: int, per: int, attn) -> torch.Tensor:
    """The attention group's rows from each rank's share (rank r held rows [r*per, ...))."""
    import torch.distributed as dist

    buf = part.new_zeros((per,) + tuple(part.shape[1:]))
    buf[: part.shape[0]] = part
    wire = buf.view(torch.uint8) if buf.dtype != torch.int64 else buf
    parts = [torch.empty_like(wire) for _ in range(attn.size)]
    dist.all_gather(parts, wire.contiguous(), group=attn.group)
    return torch.cat([p.view(part.dtype) if wire is not buf else p for p in parts])[:total]
