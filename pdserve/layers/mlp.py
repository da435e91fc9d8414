"""A gated MLP that shards and loads itself: ``down(act(gate(x)) * up(x))`` over ``tp`` (its
intermediate columns split, the down projection's partial sums added), or replicated (``tp`` of
size 1: every rank holds all of it and runs only its own tokens).

MoE models use it where the Llama MLP's sharding (by ``config.intermediate_size`` over the
stage's ranks) does not fit: shared experts (their own intermediate size) and dense layers with
``--moe-dense-tp-size 1``. It reads its HF weights itself (``checkpoint_names`` /
``load_checkpoint``, see ``models/weights.py``)."""

from __future__ import annotations

from functools import partial
from types import ModuleType
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed import SINGLE, TPGroup, shard_range
from pdserve.layers.linear import MATRIX_KINDS, Linear, MergedLinear, RowParallelLinear

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


# the gated MLP's activations, by their HF config names (``silu`` also has a CPU kernel)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}


def activation_fn(
    activation: str, field: str = "hidden_act"
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function of an HF activation name (``field``: the config field that named it)."""
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"{field}: {activation!r} is not supported; supported: {sorted(ACTIVATIONS)}"
        )
    return ACTIVATIONS[activation]


class GatedProjections(nn.Module):
    """``down(act(gate(x)) * up(x))`` over fused ``gate_up_proj`` and ``down_proj`` (which the
    subclass makes); ``activation`` is the HF config name, SiLU runs as one CPU kernel with
    ``ops``. The Llama MLP and ``GatedMLP`` share it."""

    def set_activation(self, activation: str, field: str = "hidden_act") -> None:
        self.activation = activation
        self.act = activation_fn(activation, field)
        self.ops: Optional[ModuleType] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.ops is not None and gate_up.dim() == 2 and self.activation == "silu":
            act = gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))
            self.ops.silu_and_mul(act, gate_up)
            return self.down_proj(act)
        gate, up = self.gate_up_proj.split(gate_up)
        return self.down_proj(self.act(gate) * up)


def intermediate_share(intermediate: int, tp: TPGroup) -> tuple[int, int]:
    """[start, end) of this rank's intermediate columns of an MLP ``intermediate`` wide."""
    try:
        return shard_range(intermediate, tp.rank, tp.size)
    except ValueError as e:
        raise ValueError(f"tp_size: {e} (MLP intermediate size {intermediate})") from None


class SelfShardedMLP(nn.Module):
    """An MLP split over its own ``tp`` (or replicated at size 1) that runs under DP attention."""

    tp: TPGroup

    def run(self, h: torch.Tensor, dp: Optional[Any]) -> torch.Tensor:
        """This DP group's output: tensor-parallel over every group's tokens (gathered), or, when
        replicated, over its own tokens only."""
        if dp is None or self.tp.size == 1:
            return self(h)
        return dp.local(self(dp.gather(h)))


class GatedMLP(SelfShardedMLP, GatedProjections):
    """Split over ``tp`` by its own ``intermediate`` (or replicated at size 1); loads itself."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        activation: str,
        tp: TPGroup = SINGLE,
        bias: bool = False,
    ):
        super().__init__()
        self.inter = intermediate_share(intermediate, tp)
        n = self.inter[1] - self.inter[0]
        self.tp = tp
        self.set_activation(activation)
        self.gate_up_proj = MergedLinear(hidden, [n, n], bias=bias)
        self.down_proj = RowParallelLinear(n, hidden, bias=bias, tp=tp)

    # ---- weights -----------------------------------------------------------------------------
    def checkpoint_names(self) -> list[str]:
        names = [f"{p}.weight" for p in PROJECTIONS]
        if self.down_proj.bias is not None:
            names += [f"{p}.bias" for p in PROJECTIONS]
        if hasattr(self.down_proj, MATRIX_KINDS[1]):  # FP8 blocks (quantization/fp8_block.py)
            names += [f"{p}.{MATRIX_KINDS[1]}" for p in PROJECTIONS]
        return names

    def load_checkpoint(self, name: str, src: Any) -> None:
        proj, _, leaf = name.partition(".")
        if proj not in PROJECTIONS or leaf not in (*MATRIX_KINDS, "bias"):
            raise ValueError(f"unexpected MLP weight {name!r}")
        i0, i1 = self.inter
        if proj == "down_proj":
            t = src[:, i0:i1] if leaf in MATRIX_KINDS else src[:]
            target = getattr(self.down_proj, leaf).data
            if target.shape != t.shape:
                raise ValueError(
                    f"weight {name!r}: expected shape {tuple(target.shape)}, got {tuple(t.shape)}"
                )
            target.copy_(t)
        else:
            self.gate_up_proj.load_shard(0 if proj == "gate_proj" else 1, leaf, src[i0:i1])


class PlainMLP(SelfShardedMLP):
    """``c_proj(act(c_fc(x)))``, without a gate (StarCoder 2), with optional biases; split over
    ``tp`` by its intermediate columns (``c_fc``'s rows, ``c_proj``'s columns, whose partial sums
    add up, its bias added once), or replicated at size 1. It reads its HF weights itself."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        activation: str,
        tp: TPGroup = SINGLE,
        bias: bool = False,
    ):
        super().__init__()
        self.act = activation_fn(activation)
        self.inter = intermediate_share(intermediate, tp)
        n = self.inter[1] - self.inter[0]
        self.tp = tp
        self.c_fc = Linear(hidden, n, bias=bias)
        self.c_proj = RowParallelLinear(n, hidden, bias=bias, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))

    def checkpoint_names(self) -> list[str]:
        return [n for n, _ in self.named_parameters()]

    def load_checkpoint(self, name: str, src: Any) -> None:
        i0, i1 = self.inter
        if name in ("c_fc.weight", "c_fc.bias"):
            t = src[i0:i1]
        elif name == "c_proj.weight":
            t = src[:, i0:i1]
        elif name == "c_proj.bias":
            t = src[:]
        else:
            raise ValueError(f"unexpected MLP weight {name!r}")
        target = dict(self.named_parameters())[name]
        if target.shape != t.shape:
            raise ValueError(
                f"weight {name!r}: expected shape {tuple(target.shape)}, got {tuple(t.shape)}"
            )
        target.data.copy_(t)
