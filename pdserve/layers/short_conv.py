"""LFM2's gated short convolution (the ``conv`` layers of ``Lfm2ForCausalLM``), in torch.

Per token, ``in_proj`` gives B, C and x (``hidden`` channels each); ``B * x`` goes through a
depthwise causal convolution of K taps (``conv_L_cache``, no activation) and the result is gated by
C; ``out_proj`` maps it back. A request's state is the convolution's last K - 1 inputs
([channels, K - 1], in the model's dtype, as HF keeps it), in its slot of the layer's
``StatePool``: an empty prefix starts from zeros, a chunk continues from the state its previous
chunk left, and with the prefix cache the state is copied at each page boundary a forward ends
(``state_snapshots.py``), as the Mamba2 mixer does. Under tensor parallelism each rank holds a
share of the channels (its rows of B, C and x, its channels of the convolution and of the state,
its columns of ``out_proj``, whose outputs are summed).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Optional

import torch
from torch import nn

from pdserve.distributed import SINGLE, TPGroup
from pdserve.forward_batch import ForwardBatch
from pdserve.kv_spec import RecurrentState
from pdserve.layers import state_snapshots as snapshots
from pdserve.layers.linear import Linear, RowParallelLinear
from pdserve.layers.mamba2 import (
    DepthwiseConv,
    causal_conv,
    copy_share,
    cpu_kernel_runs,
    extend_window,
    step_window,
)

STATE_KIND = RecurrentState.kind


class ShortConvMixer(nn.Module):
    """One short-convolution layer; ``kv_layer`` is its index among this stage's layers."""

    def __init__(self, hidden: int, kernel: int, bias: bool, kv_layer: int, tp: TPGroup = SINGLE):
        super().__init__()
        if hidden % tp.size:
            raise ValueError(
                f"tp_size: {tp.size} ranks cannot split a short convolution's {hidden} channels"
            )
        if kernel < 2:
            raise ValueError(f"conv_L_cache: {kernel}; a short convolution needs at least 2 taps")
        self.hidden, self.kernel, self.tp, self.kv_layer = hidden, kernel, tp, kv_layer
        self.channels = n = hidden // tp.size
        self.in_proj = Linear(hidden, 3 * n, bias=bias)
        self.conv = DepthwiseConv(n, kernel, bias)
        self.out_proj = RowParallelLinear(n, hidden, bias=bias, tp=tp)
        # pdserve's CPU kernels: the convolution of a chunk and of a decode step in one call each
        self.ops: Optional[ModuleType] = None

    def state_spec(self, conv_dtype: str) -> RecurrentState:
        return RecurrentState(
            parts=("conv",),
            shapes=((self.channels, self.kernel - 1),),
            dtypes=(conv_dtype,),
            ranks=self.tp.size,
        )

    # ---- weights -----------------------------------------------------------------------------
    def checkpoint_names(self) -> list[str]:
        return [n for n, _ in self.named_parameters()]

    def load_checkpoint(self, name: str, src: Any) -> None:
        params = dict(self.named_parameters())
        if name not in params:
            raise ValueError(f"unexpected short-convolution weight {name!r}")
        n, r = self.channels, self.tp.rank
        mine = slice(r * n, (r + 1) * n)
        if name.startswith("in_proj."):  # rows: B, C, x, each ``hidden``
            h = self.hidden
            t = torch.cat([src[k * h + r * n : k * h + (r + 1) * n] for k in range(3)])
        elif name.startswith("conv."):
            t = src[mine]
        elif name == "out_proj.weight":
            t = src[:, mine]
        else:  # out_proj.bias: whole, added once after the sum
            t = src[:]
        copy_share(params[name], t, name)

    # ---- compute -----------------------------------------------------------------------------
    def forward(self, h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        pool, index, _ = fb.state(self.kv_layer, STATE_KIND)
        state = pool.state("conv", index)  # [slots, channels, K - 1]
        b, c, x = self.in_proj(h).chunk(3, dim=-1)
        bx = b * x
        out = torch.empty_like(bx)

        def extend(rows: slice, position: int, slot: int) -> None:
            out[rows] = self._extend(bx[rows], position, state, slot)

        def step(rows: torch.Tensor, slots: torch.Tensor) -> None:
            out[rows] = self._step(bx[rows], state, slots)

        snapshots.run(fb, self.kv_layer, STATE_KIND, extend, step)
        return self.out_proj(c * out)

    def _extend(
        self, bx: torch.Tensor, prefix: int, state: torch.Tensor, slot: int
    ) -> torch.Tensor:
        """The convolution [n, C] (bx's dtype) of ``n`` new inputs of one request after ``prefix``
        tokens, from its window (zeros for an empty prefix), which it updates. With pdserve's CPU
        kernels one call computes causal_conv's sums, rounded once as it rounds them."""
        if cpu_kernel_runs(self.ops, bx, state):
            if not prefix:
                state[slot].zero_()
            out = torch.empty(bx.shape, dtype=bx.dtype)
            self.ops.short_conv_scan(out, bx, state, slot, self.conv.weight, self.conv.bias)
            return out
        window = extend_window(state, slot, bx, prefix)  # [C, K - 1 + n]
        return causal_conv(self.conv, window[None], bx.shape[0], silu=False)[0]

    def _step(self, bx: torch.Tensor, state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One new input of each of several requests (decode): [B, C], their windows at ``slots``
        updated (in one kernel call with pdserve's CPU kernels)."""
        if cpu_kernel_runs(self.ops, bx, state):
            out = torch.empty(bx.shape, dtype=bx.dtype)
            self.ops.short_conv_decode_step(
                out, bx.contiguous(), state, slots, self.conv.weight, self.conv.bias
            )
            return out
        window = step_window(state, slots, bx)
        return causal_conv(self.conv, window, 1, silu=False)[:, 0]
