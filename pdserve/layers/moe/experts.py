"""The experts of one MoE layer that this rank holds, and the reference ways to run them.

Weights: ``w13`` [S, 2*I, H] (rows [0, I) the gate projection, [I, 2I) the up projection, as
``nn.Linear`` stores them), ``w2`` [S, H, I], optional biases ``b13`` [S, 2*I] and ``b2`` [S, H],
for the S slots of this rank (``placement.py``) and its slice of the expert MLP's intermediate
dimension (TP inside an expert group: the down projection's partial sums add up over the
group, its bias is held by the group's first rank only).

``forward(x, ids, weights)`` takes the tokens' local slot ids [T, K] (-1: the expert is not on
this rank) and weights, and returns the float32 sum over slots of ``weight * expert(x)``: a
partial sum, completed over the ranks by the MoE block (``layer.py``). With
``round_each_expert`` the sum is taken as HF's eager loop takes it instead: each weighted output
rounded to the model dtype and added in that dtype, experts in ascending order (the ``loop``
runner; DeepSeek-V4, whose tiny bf16 networks part from HF's run at the first other rounding).
Runners:

- ``loop``: one ``F.linear`` pair per expert hit, in ascending slot order (HF's eager order);
- ``grouped_mm``: tokens sorted by expert, ``torch.nn.functional.grouped_mm`` over all of them
  (transformers' default; needs 16-byte aligned rows);
- ``fused``: pdserve's CPU kernel over prepacked bf16 or int8 weights (``fused.py``), set by
  ``prepack``.

Activations: ``silu`` (``silu(gate) * up``), ``swiglu_oai`` (GPT-OSS: gate clamped above at
``limit``, up clamped to ±``limit``, ``(up + 1) * gate * sigmoid(alpha * gate)``) and
``silu_clamped`` (DeepSeek-V4: the same clamps, ``silu(gate) * up``; the reference runners only);
``gelu_tanh`` (Gemma 4: ``gelu(gate) * up``, tanh approximation; the reference runners only).

Checkpoint formats (``fmt``): ``per_expert`` (``experts.E.{gate,up,down}_proj.weight``: Qwen,
DeepSeek), ``mixtral`` (``experts.E.{w1,w3,w2}.weight``), ``gpt_oss`` (3-D ``gate_up_proj``
[E, H, 2I] with gate and up interleaved, ``down_proj`` [E, I, H], and their biases; stored
transposed, de-interleaved here at load), ``granite`` (3-D ``input_linear`` [E, 2I, H], gate
then up, and ``output_linear`` [E, H, I]), ``fused``, the same 3-D layout under
transformers' own names (``gate_up_proj``, ``down_proj``: Mistral 4 as transformers saves it),
and ``llama4``: those names stored transposed, ``gate_up_proj`` [E, H, 2I] (gate then up along
the last axis) and ``down_proj`` [E, I, H] (Llama 4's published checkpoints).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = ("silu", "swiglu_oai", "silu_clamped", "gelu_tanh")
RUNNERS = ("loop", "grouped_mm")
FORMATS = {"per_expert": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}
# 3-D formats: (the [E, 2I, H] gate-then-up tensor, the [E, H, I] down one)
STACKED = {
    "granite": ("input_linear.weight", "output_linear.weight"),
    "fused": ("gate_up_proj", "down_proj"),
}


class Experts(nn.Module):
    def __init__(
        self,
        hidden: int,
        inter: tuple[int, int],
        slots: list[int],
        activation: str = "silu",
        bias: bool = False,
        fmt: str = "per_expert",
        alpha: float = 1.702,
        limit: float = 7.0,
        down_bias_here: bool = True,
        runner: str = "grouped_mm",
        round_each_expert: bool = False,
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"expert activation: {activation!r} is not supported; supported: {ACTIVATIONS}"
            )
        if fmt not in FORMATS and fmt not in STACKED and fmt not in ("gpt_oss", "llama4"):
            raise ValueError(f"expert checkpoint format {fmt!r} unknown")
        self.hidden = hidden
        self.inter = inter  # [start, end) of this rank's intermediate columns
        self.slots = list(slots)  # logical expert of each local slot
        self.activation, self.alpha, self.limit = activation, alpha, limit
        self.fmt = fmt
        self.down_bias_here = down_bias_here
        self.runner = "loop" if round_each_expert else runner
        self.round_each_expert = round_each_expert
        n, i = len(slots), inter[1] - inter[0]
        self.w13 = nn.Parameter(torch.empty(n, 2 * i, hidden))
        self.w2 = nn.Parameter(torch.empty(n, hidden, i))
        self.b13 = nn.Parameter(torch.empty(n, 2 * i)) if bias else None
        self.b2 = nn.Parameter(torch.empty(n, hidden)) if bias else None
        # "mxfp4": w13 / w2 hold MXFP4 codes, two a byte (quantization/mxfp4.py)
        self.weight_kind = ""
        # the fused kernel's prepacked weights (``prepack``); the plain ones are dropped then
        self.impl: Optional[Callable[..., torch.Tensor]] = None

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @property
    def intermediate(self) -> int:
        return self.inter[1] - self.inter[0]

    # ---- compute -----------------------------------------------------------------------------
    def act(self, gu: torch.Tensor) -> torch.Tensor:
        gate, up = gu.chunk(2, dim=-1)
        if self.activation == "silu":
            return F.silu(gate) * up
        if self.activation == "gelu_tanh":
            return F.gelu(gate, approximate="tanh") * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        if self.activation == "silu_clamped":
            return F.silu(gate) * up
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Float32 [T, H]: sum over k of ``weights[t, k] * expert_{ids[t, k]}(x[t])`` for the
        slots on this rank (``ids`` -1 elsewhere)."""
        if self.impl is not None:
            return self.impl(x, ids.to(torch.int32), weights.float())
        out = torch.zeros((x.shape[0], self.hidden), dtype=torch.float32, device=x.device)
        if x.shape[0] == 0:
            return out
        flat = ids.reshape(-1)
        pairs = torch.nonzero(flat >= 0).squeeze(1)
        if pairs.numel() == 0:
            return out
        k = ids.shape[1]
        if self.runner == "grouped_mm" and self._aligned(x):
            return self._grouped(x, flat, pairs, k, weights, out)
        return self._loop(x, ids, weights, out)

    def _aligned(self, x: torch.Tensor) -> bool:
        size = x.element_size()
        return (
            (self.hidden * size) % 16 == 0
            and (self.intermediate * size) % 16 == 0
            and x.dtype != torch.float64
        )

    def _loop(self, x, ids, weights, out, linears=None):
        """``linears``: per slot, the (gate/up, down) matmuls to use instead of ``F.linear``."""
        rounded = torch.zeros_like(x) if self.round_each_expert else None
        for slot in torch.unique(ids[ids >= 0]).tolist():  # ascending, as HF's eager loop
            tok, pos = torch.where(ids == slot)
            if linears is None:
                gu = F.linear(x[tok], self.w13[slot], None if self.b13 is None else self.b13[slot])
                y = F.linear(
                    self.act(gu), self.w2[slot], None if self.b2 is None else self.b2[slot]
                )
            else:
                w13, w2 = linears[slot]
                y = w2(self.act(w13(x[tok])))
            if rounded is not None:
                rounded.index_add_(0, tok, (y * weights[tok, pos, None].to(y.dtype)).to(x.dtype))
            else:
                out.index_add_(0, tok, y.float() * weights[tok, pos, None].float())
        return out if rounded is None else out.copy_(rounded)

    def _grouped(self, x, flat, pairs, k, weights, out):
        slot = flat[pairs]
        order = torch.argsort(slot, stable=True)
        pairs, slot = pairs[order], slot[order]
        tok = pairs // k
        offs = torch.cumsum(torch.bincount(slot, minlength=self.num_slots), 0).to(torch.int32)
        gu = F.grouped_mm(x[tok], self.w13.transpose(1, 2), offs=offs)
        if self.b13 is not None:
            gu = gu + self.b13[slot]
        y = F.grouped_mm(self.act(gu), self.w2.transpose(1, 2), offs=offs)
        if self.b2 is not None:
            y = y + self.b2[slot]
        out.index_add_(0, tok, y.float() * weights.reshape(-1)[pairs, None].float())
        return out

    # ---- weights -----------------------------------------------------------------------------
    def _local(self, expert: int) -> list[int]:
        return [s for s, e in enumerate(self.slots) if e == expert]

    def checkpoint_names(self) -> list[str]:
        """HF names (relative to this module) of the weights this rank needs."""
        if self.fmt == "gpt_oss":
            if self.weight_kind == "mxfp4":
                return [
                    f"{p}_{kind}"
                    for p in ("gate_up_proj", "down_proj")
                    for kind in ("blocks", "scales", "bias")
                ]
            return ["gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"]
        if self.fmt in STACKED:
            return list(STACKED[self.fmt])
        if self.fmt == "llama4":
            return ["gate_up_proj", "down_proj"]
        kinds = ("weight", "weight_scale_inv") if self.quantized else ("weight",)
        return [
            f"{e}.{p}.{kind}"
            for e in sorted(set(self.slots))
            for p in FORMATS[self.fmt]
            for kind in kinds
        ]

    @property
    def quantized(self) -> bool:
        """Quantized weights, their matmuls the weight format's: FP8 block weights
        (``quantization/fp8_block.py``: ``w13_scale`` / ``w2_scale`` hold each row's block scales)
        or MXFP4 (``quantization/mxfp4.py``: ``weight_kind`` "mxfp4", the scales as bytes)."""
        return getattr(self, "w13_scale", None) is not None

    def load_checkpoint(self, name: str, src: Any) -> None:
        """Copy HF weight ``name`` (relative to this module) into every slot holding its expert;
        a weight of an expert held elsewhere is skipped."""
        i0, i1 = self.inter
        if self.fmt == "gpt_oss":
            return self._load_gpt_oss(name, src)
        if self.fmt in STACKED:
            return self._load_stacked(name, src)
        if self.fmt == "llama4":
            return self._load_transposed(name, src)
        parts = name.split(".")
        kinds = ("weight", "weight_scale_inv") if self.quantized else ("weight",)
        if (
            len(parts) != 3
            or not parts[0].isdigit()
            or parts[1] not in FORMATS[self.fmt]
            or parts[2] not in kinds
        ):
            raise ValueError(f"unexpected expert weight {name!r}")
        gate, up, down = FORMATS[self.fmt]
        # an FP8 scale is seen in its weight's coordinates: it slices as the weight does
        w13, w2 = (self.w13, self.w2) if parts[2] == "weight" else (self.w13_scale, self.w2_scale)
        for s in self._local(int(parts[0])):
            if parts[1] == down:
                self._copy(w2.data[s], src[:, i0:i1], name)
            else:
                rows = slice(0, i1 - i0) if parts[1] == gate else slice(i1 - i0, 2 * (i1 - i0))
                self._copy(w13.data[s, rows], src[i0:i1], name)

    def _load_gpt_oss(self, name: str, src: Any) -> None:
        i0, i1 = self.inter
        n = i1 - i0
        if self.weight_kind == "mxfp4" and name.endswith(("_blocks", "_scales")):
            return self._load_mxfp4(name, src)
        for s, e in enumerate(self.slots):
            t = src[e : e + 1][0]
            if name == "gate_up_proj":  # [H, 2I], x @ W, gate and up interleaved
                self._copy(self.w13.data[s, :n], t[:, 0::2][:, i0:i1].t(), name)
                self._copy(self.w13.data[s, n:], t[:, 1::2][:, i0:i1].t(), name)
            elif name == "gate_up_proj_bias":
                self._copy(self.b13.data[s, :n], t[0::2][i0:i1], name)
                self._copy(self.b13.data[s, n:], t[1::2][i0:i1], name)
            elif name == "down_proj":  # [I, H]
                self._copy(self.w2.data[s], t[i0:i1].t(), name)
            elif name == "down_proj_bias":
                self.b2.data[s].copy_(t if self.down_bias_here else torch.zeros_like(t))
            else:
                raise ValueError(f"unexpected expert weight {name!r}")

    def _load_mxfp4(self, name: str, src: Any) -> None:
        """GPT-OSS's MXFP4 experts: ``*_blocks`` [E, rows, K/32, 16], ``*_scales`` [E, rows,
        K/32], rows the outputs (gate and up interleaved), stored as [rows, K/2] bytes and [rows,
        K/32] scales; this rank's intermediate columns of ``down_proj`` are whole groups (checked
        by the format)."""
        i0, i1 = self.inter
        n = i1 - i0
        proj, _, kind = name.rpartition("_")
        if proj not in ("gate_up_proj", "down_proj") or kind not in ("blocks", "scales"):
            raise ValueError(f"unexpected expert weight {name!r}")
        w13, w2 = (self.w13, self.w2) if kind == "blocks" else (self.w13_scale, self.w2_scale)
        for s, e in enumerate(self.slots):
            t = src[e : e + 1][0]
            if proj == "gate_up_proj":
                self._copy(w13.data[s, :n], t[0::2][i0:i1].reshape(n, -1), name)
                self._copy(w13.data[s, n:], t[1::2][i0:i1].reshape(n, -1), name)
            else:
                groups = t[:, i0 // 32 : i1 // 32]
                self._copy(w2.data[s], groups.reshape(groups.shape[0], -1), name)

    def _load_stacked(self, name: str, src: Any) -> None:
        i0, i1 = self.inter
        n = i1 - i0
        gate_up, down = STACKED[self.fmt]
        for s, e in enumerate(self.slots):
            t = src[e : e + 1][0]
            if name == gate_up:  # [2I, H]: the gate's rows, then the up's
                whole = t.shape[0] // 2
                self._copy(self.w13.data[s, :n], t[i0:i1], name)
                self._copy(self.w13.data[s, n:], t[whole + i0 : whole + i1], name)
            elif name == down:  # [H, I]
                self._copy(self.w2.data[s], t[:, i0:i1], name)
            else:
                raise ValueError(f"unexpected expert weight {name!r}")

    def _load_transposed(self, name: str, src: Any) -> None:
        i0, i1 = self.inter
        n = i1 - i0
        for s, e in enumerate(self.slots):
            t = src[e : e + 1][0]
            if name == "gate_up_proj":  # [H, 2I]: x @ W, the gate's columns, then the up's
                whole = t.shape[1] // 2
                self._copy(self.w13.data[s, :n], t[:, i0:i1].t(), name)
                self._copy(self.w13.data[s, n:], t[:, whole + i0 : whole + i1].t(), name)
            elif name == "down_proj":  # [I, H]
                self._copy(self.w2.data[s], t[i0:i1].t(), name)
            else:
                raise ValueError(f"unexpected expert weight {name!r}")

    @staticmethod
    def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
        if dst.shape != src.shape:
            raise ValueError(
                f"expert weight {name!r}: expected shape {tuple(dst.shape)}, got {tuple(src.shape)}"
            )
        dst.copy_(src)

    def finish_loading(self) -> None:
        """Biases of the down projection count once over the ranks that split an expert."""
        if self.b2 is not None and not self.down_bias_here and self.fmt != "gpt_oss":
            self.b2.data.zero_()

    # ---- CPU fast path -----------------------------------------------------------------------
    def prepack(
        self, ops, quantization: Optional[str] = None, batch_invariant: bool = False
    ) -> int:
        """Hand the weights to the fused kernel (bf16, or int8 with ``w8a8_int8``); returns the
        packed bytes. Without the kernels the reference runner stays. A float32 model with
        ``batch_invariant`` runs the loop over ``PackedF32`` matmuls (rows independent of each
        other, as the fused kernel's are)."""
        if self.quantized:  # its matmuls are the weight format's (set at load)
            return self.impl.nbytes
        if ops is None:
            return 0
        if self.w13.dtype == torch.float32:
            if not batch_invariant:
                return 0
            from pdserve.layers.linear import PackedF32

            linears = [
                (
                    PackedF32(
                        self.w13.data[s], None if self.b13 is None else self.b13.data[s], ops
                    ),
                    PackedF32(self.w2.data[s], None if self.b2 is None else self.b2.data[s], ops),
                )
                for s in range(self.num_slots)
            ]
            self.impl = lambda x, ids, weights: self._loop(
                x,
                ids,
                weights,
                torch.zeros((x.shape[0], self.hidden), dtype=torch.float32),
                linears,
            )
            for name in ("w13", "w2"):
                setattr(
                    self, name, nn.Parameter(getattr(self, name).new_empty(0), requires_grad=False)
                )
            return sum(a.nbytes + b.nbytes for a, b in linears)
        try:
            from pdserve.layers.moe.fused import ACTIVATIONS as FUSED
            from pdserve.layers.moe.fused import PackedExperts
        except ImportError:  # a build of the kernels without the MoE kernel
            return 0
        if self.activation not in FUSED or self.round_each_expert:  # the reference loop keeps them
            return 0

        self.impl = PackedExperts(
            self.w13.data,
            self.w2.data,
            None if self.b13 is None else self.b13.data,
            None if self.b2 is None else self.b2.data,
            self.activation,
            self.alpha,
            self.limit,
            ops=ops,
            quantization=quantization,
        )
        for name in ("w13", "w2"):
            setattr(self, name, nn.Parameter(getattr(self, name).new_empty(0), requires_grad=False))
        return self.impl.nbytes
