"""What a weight format is: a validated spec read from ``quantization_config``, and the three
steps the loader runs with it (``prepare`` before the weights are copied in, the weights wrapped
on their way, ``finish`` after)."""

from __future__ import annotations

import fnmatch
from abc import ABC, abstractmethod
from typing import Any, Iterable, Iterator, Optional

from torch import nn

# the opt-in flags (ServerArgs fields) that quantize the activations of 4-bit weights to int8,
# and the weights each is for
INT8_ACTIVATION_FLAGS = {
    "int4_int8_activations": "int4 (pack-quantized)",
    "mxfp4_int8_activations": "MXFP4",
}


def check_int8_activation_flags(args: Any, fmt: Optional["WeightFormat"] = None) -> None:
    """Refuse an int8-activation flag set in ``args`` (``ServerArgs``) that the checkpoint's
    weights do not take: ``fmt`` its weight format, None for an unquantized checkpoint."""
    for flag, weights in INT8_ACTIVATION_FLAGS.items():
        if not getattr(args, flag, False) or (fmt is not None and flag == fmt.int8_activation_flag):
            continue
        has = "is not quantized" if fmt is None else f"has no {weights} weights ({fmt.describe()})"
        raise ValueError(
            f"--{flag.replace('_', '-')}: the checkpoint {has}; the flag is for {weights} "
            "checkpoints"
        )


class WeightFormat(ABC):
    """One checkpoint's quantization. Subclasses are built by ``from_config`` (a ``ValueError``
    naming the ``quantization_config`` field for what they cannot serve)."""

    method: str = ""  # quantization_config.quant_method
    # whether its kernels' rows do not depend on each other (--enable-deterministic-inference)
    batch_invariant: bool = False

    def __init__(self, ignore: Iterable[str] = ()):
        self.ignore = tuple(ignore)  # module names or patterns kept in high precision

    @classmethod
    @abstractmethod
    def from_config(cls, quant: dict[str, Any]) -> "WeightFormat": ...

    def ignores(self, module: str) -> bool:
        """Whether the checkpoint's config keeps ``module`` (an HF module name) unquantized:
        listed by name, as a prefix, or by an ``fnmatch`` pattern (``model.layers.*.self_attn``)."""
        return any(
            module == p or module.startswith(p + ".") or fnmatch.fnmatchcase(module, p)
            for p in self.ignore
        )

    @staticmethod
    def checkpoint_naming(model: nn.Module):
        """(``own_name``: a checkpoint name -> the model's, or None for one it does not load;
        ``holds``: whether this rank holds a weight of the model) for ``prepare``; a model that
        loads part of a checkpoint under other names (a draft head) maps them."""
        own_name = getattr(model, "quantized_weight_name", None) or getattr(
            model, "own_weight_name", None
        )
        if own_name is None:
            raise ValueError(
                f"quantization_config: {type(model).__name__} does not load quantized weights yet"
            )
        holds = getattr(getattr(model, "shards", None), "holds", lambda name: True)
        return own_name, holds

    @abstractmethod
    def prepare(self, model: nn.Module, tensors: dict[str, tuple[str, list[int]]]) -> None:
        """Give the layers the checkpoint stores quantized the parameters of this format (the
        model is allocated, not loaded); ``tensors``: every checkpoint tensor's dtype (as
        safetensors names it) and shape."""

    @abstractmethod
    def wrap(
        self, weights: Iterable[tuple[str, Any]], tensors: dict[str, tuple[str, list[int]]]
    ) -> Iterator[tuple[str, Any]]:
        """The checkpoint's (name, tensor or slice) pairs as the model's loader reads them."""

    @abstractmethod
    def finish(self, model: nn.Module) -> int:
        """After loading: give each quantized layer its matmul; returns the bytes they hold."""

    def use_kernels(self, model: nn.Module, ops: Any, batch_invariant: bool = False) -> int:
        """Move the quantized layers onto pdserve's CPU kernels (``ops``), dropping what only
        the PyTorch path read; returns the bytes they hold. Formats without kernels keep their
        matmuls."""
        return 0

    def describe(self) -> str:
        return self.method

    # the int8-activation flag these weights take (ServerArgs field), if any
    int8_activation_flag: Optional[str] = None

    def check_flags(self, args: Any) -> None:
        """Refuse the server flags (``ServerArgs``) these weights cannot be served with (yet)."""
        check_int8_activation_flags(args, self)
        if args.quantization is not None:
            raise ValueError(
                f"--quantization {args.quantization}: the checkpoint is already quantized "
                f"({self.describe()}); serve it without --quantization"
            )
        if args.enable_deterministic_inference and not self.batch_invariant:
            raise ValueError(
                f"--enable-deterministic-inference: the matmul of {self.describe()} weights is "
                "not batch invariant yet"
            )
