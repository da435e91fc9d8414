"""FP8 block-scaled weights, as DeepSeek-V3, Qwen3 "-FP8", MiniMax-M2 and others publish them:
``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}`` (``scale_fmt: "ue8m0"`` when the scales are powers of two);
each quantized linear stores ``weight`` F8_E4M3 [N, K] and ``weight_scale_inv`` [ceil(N/bn),
ceil(K/bk)], the weight being ``q * scale_inv`` per block, partial blocks on the ceil grid.

What is held: the checkpoint's FP8 bytes as they are, and the scales expanded to one row per
output row, ``[N, ceil(K/bk)]`` float32 (4/bk bytes more per weight: 3 % at 128), so a layer
fused from several projections (q/k/v, gate/up) and a tensor-parallel rank's rows need no row
alignment. Columns are split over ranks (``o_proj``, ``down_proj``) only on whole blocks: a split
inside a block is refused, naming the dimension.

A module that uses its weight other than as a matmul (latent attention's ``kv_b_proj``, applied
per head) says so with ``fp8_dequantized``: its FP8 weight is dequantized as it loads.

The matmuls that read them are in ``fp8_matmul.py`` (``Fp8BlockLinear``, ``Fp8Experts``)."""

from __future__ import annotations

from types import ModuleType
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

from pdserve.hostmem import HUGE_PAGE, huge_like
from pdserve.quantization.base import WeightFormat
from pdserve.quantization.fp8_matmul import Fp8BlockLinear, Fp8Experts, _widen

SCALE = "weight_scale_inv"
FP8_DTYPE = "F8_E4M3"
SCALE_DTYPES = ("F32", "BF16", "F8_E8M0")  # as safetensors names them


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Fp8Block(WeightFormat):
    method = "fp8"
    batch_invariant = True  # with the kernels (deterministic serving needs them anyway)
    # what the checkpoint stores quantized: its safetensors dtype, the storage, its name in errors
    stored_dtype = FP8_DTYPE
    storage = torch.float8_e4m3fn
    kind = "FP8"

    def __init__(
        self, block: tuple[int, Optional[int]], scale_fmt: Optional[str], ignore: Iterable[str]
    ):
        """``block``: (rows, columns) a scale covers; columns None: the whole row (one scale per
        output channel)."""
        super().__init__(ignore)
        self.block = block
        self.scale_fmt = scale_fmt
        # checkpoint name prefixes ("...kv_b_proj.") of FP8 weights dequantized as they load
        self.dequantize_at_load: set[str] = set()

    @classmethod
    def from_config(cls, quant: dict[str, Any]) -> "Fp8Block":
        fmt = quant.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config.fmt: {fmt!r} is not supported; supported: e4m3")
        scheme = quant.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(
                f"quantization_config.activation_scheme: {scheme!r} is not supported (static "
                "activation scales); supported: dynamic"
            )
        block = quant.get("weight_block_size")
        if (
            not isinstance(block, (list, tuple))
            or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)
        ):
            raise ValueError(
                f"quantization_config.weight_block_size: {block!r}; expected two positive "
                "integers [rows, columns] (FP8 without blocks, one scale per tensor or channel, "
                "is not supported)"
            )
        scale_fmt = quant.get("scale_fmt")
        if scale_fmt not in (None, "ue8m0"):
            raise ValueError(
                f"quantization_config.scale_fmt: {scale_fmt!r} is not supported; supported: "
                "ue8m0 or none"
            )
        ignore = quant.get("modules_to_not_convert") or quant.get("ignored_layers") or ()
        return cls((block[0], block[1]), scale_fmt, ignore)

    def describe(self) -> str:
        bn, bk = self.block
        if bk is None:
            return "fp8 e4m3, a scale per output channel"
        return f"fp8 e4m3, {bn}x{bk} blocks" + (", ue8m0 scales" if self.scale_fmt else "")

    # ---- loading -----------------------------------------------------------------------------
    def prepare(self, model: nn.Module, tensors: dict[str, tuple[str, list[int]]]) -> None:
        from pdserve.layers.linear import Linear
        from pdserve.models.weights import FUSED, self_loading_modules

        own_name, holds = self.checkpoint_naming(model)
        owners = self_loading_modules(model)
        quantized: dict[str, list[str]] = {}  # our module path -> its checkpoint weights
        experts: dict[str, set[str]] = {}  # an MoE layer's experts -> their FP8 weights
        for name, (dtype, shape) in sorted(tensors.items()):
            if dtype != self.stored_dtype:
                continue
            if not name.endswith(".weight"):
                raise ValueError(
                    f"weight {name!r}: an {self.kind} tensor that is not a layer's weight"
                )
            if self.ignores(name[: -len(".weight")]):
                raise ValueError(
                    f"weight {name!r} is {self.kind}, but the quantization_config's ignore list "
                    "keeps its module in high precision"
                )
            own = own_name(name)
            if own is None or not holds(own):
                continue  # another pipeline stage's, or not a weight this model loads
            path = own[: -len(".weight")]
            parent, _, proj = path.rpartition(".")
            owner = next((p for p in owners if path.startswith(p + ".") or path == p), None)
            if owner is not None and _per_expert(owners[owner]):
                self._check_scale(name, shape, tensors)
                experts.setdefault(owner, set()).add(own[len(owner) + 1 :])
                continue
            # a layer of the model, or of a module that loads its own weights (a shared expert's
            # MLP, latent attention): its Linear takes quantized storage, the module loads the scale
            # beside the weight
            target = path
            if proj in FUSED and _submodule(model, path) is None:
                target = f"{parent}.{FUSED[proj][0]}"
            module = _submodule(model, target)
            if getattr(module, "fp8_dequantized", False):
                # kept in the compute dtype (latent attention's up-projection, used per head):
                # dequantized at load, as transformers does
                self._check_scale(name, shape, tensors)
                self.dequantize_at_load.add(name[: -len("weight")])
                continue
            if not isinstance(module, Linear):
                what = "no layer" if module is None else f"a {type(module).__name__}"
                raise ValueError(f"weight {name!r}: {self.kind}, but the model has {what} for it")
            self._check_scale(name, shape, tensors)
            quantized.setdefault(target, []).append(name)
        for target, names in quantized.items():
            # a fused layer: every projection stored apart quantized, or the one stored fused
            proj = target.rpartition(".")[2]
            apart = [p for p, (fused, _) in FUSED.items() if fused == proj]
            stored_fused = any(own_name(n).endswith(f".{proj}.weight") for n in names)
            if apart and not stored_fused and len(names) != len(apart):
                raise ValueError(
                    f"{target}: of its projections {', '.join(apart)} only "
                    f"{', '.join(own_name(n).rsplit('.', 2)[-2] for n in names)} are "
                    f"{self.kind}; a fused layer's projections must all be {self.kind} or none"
                )
            self._swap(_submodule(model, target))
        for path, names in experts.items():
            module = owners[path]
            needed = {n for n in module.checkpoint_names() if n.endswith(".weight")}
            if not needed <= names:
                missing = sorted(needed - names)[:4]
                raise ValueError(
                    f"{path}: some experts' weights are {self.kind} and others not "
                    f"({', '.join(missing)} are not); an MoE layer's experts must all be "
                    f"{self.kind} or none"
                )
            self._swap_experts(module)

    def _check_scale(
        self, name: str, shape: list[int], tensors: dict[str, tuple[str, list[int]]]
    ) -> None:
        if len(shape) != 2:
            raise ValueError(f"weight {name!r}: {self.kind} weights must be 2-D, got shape {shape}")
        scale = name[: -len("weight")] + SCALE
        if scale not in tensors:
            raise ValueError(f"weight {name!r}: its scale tensor {scale!r} is missing")
        expected = [cdiv(shape[0], self.block[0]), cdiv(shape[1], self.block[1] or shape[1])]
        sdtype, sshape = tensors[scale]
        if list(sshape) != expected:
            raise ValueError(
                f"weight {scale!r}: shape {list(sshape)}, expected {expected} (one per "
                + (
                    "output channel"
                    if self.block[1] is None
                    else f"{self.block[0]}x{self.block[1]} block"
                )
                + f" of {name!r}'s {list(shape)})"
            )
        if sdtype not in SCALE_DTYPES:
            raise ValueError(
                f"weight {scale!r}: dtype {sdtype} is not a scale dtype ({', '.join(SCALE_DTYPES)})"
            )

    def _swap_experts(self, experts: nn.Module) -> None:
        """Quantized storage for an MoE layer's ``w13`` / ``w2``, and their row scales."""
        bk = self.block[1]
        for name in ("w13", "w2"):
            w = getattr(experts, name)
            s, n, k = w.shape
            q = torch.empty((s, n, self._stored_columns(k)), dtype=self.storage, device=w.device)
            setattr(experts, name, nn.Parameter(q, requires_grad=False))
            scale = torch.empty((s, n, cdiv(k, bk or k)), dtype=torch.float32, device=w.device)
            experts.register_parameter(f"{name}_scale", nn.Parameter(scale, requires_grad=False))

    def _swap(self, module: nn.Module) -> None:
        """Replace the layer's weight by quantized storage of the same shape, add its row
        scales."""
        n, k = module.weight.shape
        device = module.weight.device
        module.weight = nn.Parameter(
            torch.empty((n, self._stored_columns(k)), dtype=self.storage, device=device),
            requires_grad=False,
        )
        scale = torch.empty((n, cdiv(k, self.block[1] or k)), dtype=torch.float32, device=device)
        module.register_parameter(SCALE, nn.Parameter(scale, requires_grad=False))

    def wrap(
        self, weights: Iterable[tuple[str, Any]], tensors: dict[str, tuple[str, list[int]]]
    ) -> Iterator[tuple[str, Any]]:
        pending: dict[str, dict[str, Any]] = {}  # dequantized at load: the half that came first
        for name, src in weights:
            base, _, leaf = name.rpartition(".")
            if base + "." in self.dequantize_at_load and leaf in ("weight", SCALE):
                parts = pending.setdefault(base, {})
                parts[leaf] = src
                if len(parts) == 2:
                    del pending[base]
                    yield base + ".weight", self._dequantized(parts["weight"], parts[SCALE])
                continue
            if name.endswith("." + SCALE):
                weight = name[: -len(SCALE)] + "weight"
                if weight not in tensors:
                    raise ValueError(f"weight {name!r}: a scale without its weight {weight!r}")
                src = BlockScaleView(src, tensors[weight][1], self.block, name)
            yield name, src
        for base, parts in pending.items():
            missing = "weight" if "weight" not in parts else SCALE
            raise ValueError(
                f"weight {base}.{missing}: missing (its {self.kind} pair is in the checkpoint)"
            )

    def _dequantized(self, weight: Any, scale: Any) -> torch.Tensor:
        """A quantized weight in float32: each value times its block's scale (one rounding)."""
        q = weight[:] if not isinstance(weight, torch.Tensor) else weight
        s = (scale[:] if not isinstance(scale, torch.Tensor) else scale).to(torch.float32)
        (n, k), (bn, bk) = q.shape, self.block
        rows = s.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk or k, dim=1)[:, :k]
        return self._values(q) * rows

    # ---- what differs between the formats on this machinery ------------------------------------
    def _stored_columns(self, k: int) -> int:
        """The columns a weight of ``k`` input columns is stored in."""
        return k

    def _values(self, q: torch.Tensor) -> torch.Tensor:
        """The stored codes' exact values in float32."""
        return _widen(q)

    def _linear(self, weight: torch.Tensor, scale: torch.Tensor, bias) -> Any:
        return Fp8BlockLinear(weight, scale, bias, self.block[1])

    def _experts(self, module: nn.Module) -> Any:
        return Fp8Experts(module, self.block[1])

    def finish(self, model: nn.Module) -> int:
        from pdserve.layers.linear import Linear

        total = 0
        for module in model.modules():
            if isinstance(module, Linear) and hasattr(module, SCALE):
                scale = getattr(module, SCALE)
                module.impl = self._linear(module.weight, scale, module.matmul_bias())
                total += module.impl.nbytes
            elif getattr(module, "w13_scale", None) is not None:
                module.impl = self._experts(module)
                total += module.impl.nbytes
        return total

    def use_kernels(self, model: nn.Module, ops: ModuleType, batch_invariant: bool = False) -> int:
        from pdserve.kernels import onednn_bf16

        # oneDNN for large bf16 calls where it has bf16 and pdserve's kernel has no AMX tiles
        onednn = onednn_bf16()[0] and not ops.isa().startswith("amx")
        total = 0
        for module in model.modules():
            impl = getattr(module, "impl", None)
            if impl is None:
                continue
            if hasattr(module, SCALE):  # a layer
                names = ("weight", SCALE)
            elif getattr(module, "w13_scale", None) is not None:  # an MoE layer's experts
                names = ("w13", "w2", "w13_scale", "w2_scale")
            else:
                continue
            impl.use_kernels(ops, onednn, batch_invariant)
            packed = getattr(impl, "packed", None)
            if isinstance(packed, torch.Tensor) and packed.nbytes >= HUGE_PAGE // 2:
                impl.packed = huge_like(packed)  # 2 MiB pages for a large layer's weight stream
            # the checkpoint's layout is no longer read: 0-element stand-ins of its dtypes
            for name in names:
                old = getattr(module, name)
                setattr(module, name, nn.Parameter(old.new_empty(0), requires_grad=False))
            total += impl.nbytes
        return total


def _per_expert(module: nn.Module) -> bool:
    """An MoE layer's experts stored one 2-D weight per expert and projection (Qwen, DeepSeek,
    Mixtral): the layouts the FP8 releases use."""
    from pdserve.layers.moe.experts import FORMATS, Experts

    return isinstance(module, Experts) and module.fmt in FORMATS


def _submodule(model: nn.Module, path: str) -> Optional[nn.Module]:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


class BlockScaleView:
    """A checkpoint's ``[ceil(N/bn), ceil(K/bk)]`` block scales seen in the weight's own [N, K]
    coordinates, as the loader shards weights: rows ``a:b`` give each of those rows its block's
    scales, columns ``c:d`` the blocks they cover (only whole blocks, else ``ValueError``).
    ``get_shape`` is the weight's, so tensor-parallel slicing needs no rule of its own."""

    def __init__(self, src: Any, weight_shape: list[int], block: tuple[int, int], name: str):
        self.src, self.shape, self.block, self.name = src, list(weight_shape), block, name

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index) -> torch.Tensor:
        k, (bn, bk) = self.shape[1], self.block
        bk = bk or k  # one scale per row: no column split divides it
        (a, b), (c, d) = row_col_slices(index, self.shape, self.name)
        if c % bk or (d % bk and d != k):
            raise ValueError(
                f"weight {self.name!r}: columns {c}:{d} of {k} split a {bk}-wide scale block; "
                "a tensor-parallel split of the input dimension must fall on whole blocks "
                "(choose a tp_size that divides it into multiples of the block)"
            )
        rb0, rb1 = a // bn, cdiv(b, bn)
        part = self.src[rb0:rb1, c // bk : cdiv(d, bk)]
        part = part.to(torch.float32)
        return part.repeat_interleave(bn, dim=0)[a - rb0 * bn : b - rb0 * bn].contiguous()


def row_col_slices(index, shape: list[int], name: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """A loader's ``[rows, columns]`` slice of a 2-D weight ``shape`` as ((a, b), (c, d))."""
    index = index if isinstance(index, tuple) else (index,)
    rows = index[0] if index else slice(None)
    cols = index[1] if len(index) > 1 else slice(None)
    if not isinstance(rows, slice) or not isinstance(cols, slice) or len(index) > 2:
        raise TypeError(f"{name}: only [rows, columns] slices, got {index!r}")
    a, b, _ = rows.indices(shape[0])
    c, d, _ = cols.indices(shape[1])
    return (a, b), (c, d)
