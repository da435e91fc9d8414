"""HF checkpoint weights into a Llama-family model, whole or as one tensor-parallel rank's shard.

``TPShards`` says what a rank holds: its query heads, its KV heads (split, or replicated when
there are fewer KV heads than ranks), its slice of the MLP's intermediate dimension and of the
vocabulary. ``load_weights`` reads each weight's shard straight from the checkpoint (safetensors
slices: no rank materialises the full model) and copies it into the model, fusing q/k/v and
gate/up into one matmul each.

Sharding (Megatron style): q/k/v and gate/up are split by output rows (column parallel), o_proj
and down_proj by input columns (row parallel, summed over ranks afterwards, bias added once),
the embedding and the LM head by vocabulary rows (padded to a multiple of the TP size). Norm
weights are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

from pdserve.distributed import SINGLE, TPGroup, kv_heads_for_rank, shard_range
from pdserve.layers.linear import MATRIX_KINDS, MergedLinear

# HF projection name -> (our fused module, shard index in it)
FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# fused projections some families store as one tensor -> the HF names of its row blocks, in order
FUSED_ON_DISK = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# HF weights that carry no parameters of ours
# kv scales: the per-layer k_scale / v_scale of fp8 KV caches, read by engine/kv_quant.py
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".k_scale", ".v_scale", ".kv_scale")


@dataclass(frozen=True)
class TPShards:
    tp: TPGroup  # the MLP's ranks
    attn: TPGroup  # the attention's and the vocabulary's ranks (``tp``, or one DP-attention group)
    head_dim: int
    heads: tuple[int, int]  # [start, end) of this rank's query heads
    kv_heads: tuple[int, int]  # [start, end) of its KV heads
    inter: tuple[int, int]  # [start, end) of its MLP intermediate columns
    vocab: tuple[
        int, int
    ]  # [start, end) of its vocabulary rows (end may pass the real vocab: padding)
    total_kv_heads: int
    vocab_size: int
    layers: tuple[int, int] = (0, 0)  # [start, end) of the decoder layers it holds (pipeline stage)
    num_layers: int = 0  # the model's
    embeds: bool = True  # holds the embedding (first stage; the last too when the LM head is tied)
    has_head: bool = True  # computes the logits (last stage)
    total_heads: int = 0  # the model's query heads
    total_inter: int = 0  # the model's MLP intermediate size

    @classmethod
    def of(
        cls,
        config,
        tp: TPGroup = SINGLE,
        attn: TPGroup | None = None,
        pp_rank: int = 0,
        pp_size: int = 1,
    ) -> "TPShards":
        attn = tp if attn is None else attn
        layers = stage_layers(config.num_hidden_layers, pp_rank, pp_size)
        last = pp_rank == pp_size - 1
        tied = bool(getattr(config, "tie_word_embeddings", False))
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        try:
            h = shard_range(heads, attn.rank, attn.size)
            kvr = kv_heads_for_rank(kv, heads, attn.rank, attn.size)
            inter = shard_range(config.intermediate_size, tp.rank, tp.size)
        except ValueError as e:
            what = (
                "tp_size"
                if attn.size == tp.size
                else "tp_size / dp_size (the attention group's size)"
            )
            raise ValueError(
                f"{what}: {e} (heads {heads}, KV heads {kv}, intermediate size "
                f"{config.intermediate_size})"
            ) from None
        per_rank_vocab = -(-config.vocab_size // attn.size)
        vocab = (attn.rank * per_rank_vocab, (attn.rank + 1) * per_rank_vocab)
        return cls(
            tp,
            attn,
            head_dim,
            h,
            kvr,
            inter,
            vocab,
            kv,
            config.vocab_size,
            layers,
            config.num_hidden_layers,
            embeds=pp_rank == 0 or (last and tied),
            has_head=last,
            total_heads=heads,
            total_inter=config.intermediate_size,
        )

    def holds(self, name: str) -> bool:
        """Whether HF weight ``name`` belongs to this pipeline stage."""
        if name.startswith("model.layers."):
            return self.layers[0] <= int(name.split(".")[2]) < self.layers[1]
        if name == "model.embed_tokens.weight":
            return self.embeds
        if name == "lm_head.weight":
            return self.has_head
        return True  # the final norm: every stage (tiny)

    def fused_rows(self, proj: str) -> tuple[int, ...]:
        """Rows of each block of a fused projection as a checkpoint stores it (whole model)."""
        if proj == "qkv_proj":
            kv = self.total_kv_heads * self.head_dim
            return (self.total_heads * self.head_dim, kv, kv)
        return (self.total_inter, self.total_inter)

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate(self) -> int:
        return self.inter[1] - self.inter[0]

    @property
    def vocab_rows(self) -> int:
        return self.vocab[1] - self.vocab[0]

    def shard(self, name: str, src: Any) -> torch.Tensor:
        """This rank's part of HF weight ``name``; ``src`` is a tensor or a safetensors slice."""
        shape = tuple(src.shape) if isinstance(src, torch.Tensor) else tuple(src.get_shape())
        if self.tp.size == 1 and self.attn.size == 1:
            return src[:] if shape else src[()]
        leaf = name.rsplit(".", 2)
        proj, kind = (leaf[-2], leaf[-1]) if len(leaf) >= 2 else ("", leaf[-1])
        D = self.head_dim
        if proj == "q_proj":
            return _rows(src, self.heads[0] * D, self.heads[1] * D)
        if proj in ("q_norm", "k_norm") and shape and shape[0] != D:  # over the whole projection
            start, end = self.heads if proj == "q_norm" else self.kv_heads
            return _rows(src, start * D, end * D)
        if proj == "self_attn" and kind == "sinks":  # one per query head
            return _rows(src, *self.heads)
        if proj == "g_proj":  # an output gate's row per query head (LFM3)
            return _rows(src, *self.heads)
        if proj in ("k_proj", "v_proj"):
            return _rows(src, self.kv_heads[0] * D, self.kv_heads[1] * D)
        if proj in ("gate_proj", "up_proj"):
            return _rows(src, *self.inter)
        # a matrix (its weight, or scales a quantized format shows in the weight's coordinates)
        # splits by columns; a bias is whole on every rank
        matrix = kind in MATRIX_KINDS
        if proj == "o_proj":
            return _cols(src, self.heads[0] * D, self.heads[1] * D) if matrix else src[:]
        if proj == "down_proj":
            return _cols(src, *self.inter) if matrix else src[:]
        if name in ("model.embed_tokens.weight", "lm_head.weight", "lm_head.bias"):
            start, end = self.vocab
            part = _rows(src, start, min(end, shape[0]))
            if part.shape[0] < end - start:  # the last rank's padding rows
                part = torch.cat(
                    [part, part.new_zeros((end - start - part.shape[0],) + tuple(part.shape[1:]))]
                )
            return part
        return src[:]  # norms: replicated


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the layers of pipeline stage ``pp_rank``: equal shares, the first stages
    taking one more when ``pp_size`` does not divide ``num_layers``."""
    if pp_size > num_layers:
        raise ValueError(
            f"pp_size: {pp_size} stages for {num_layers} layers; at most one stage per layer"
        )
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


class RowSection:
    """Rows [start, end) of a checkpoint tensor or safetensors slice, read only when indexed (a
    block of a fused projection)."""

    def __init__(self, src: Any, start: int, end: int):
        self.src, self.start, self.end = src, start, end

    def get_shape(self) -> list[int]:
        shape = list(self.src.shape if isinstance(self.src, torch.Tensor) else self.src.get_shape())
        return [self.end - self.start] + shape[1:]

    def __getitem__(self, index) -> torch.Tensor:
        rows, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError(f"RowSection: rows must be a plain slice, got {index!r}")
        a, b, _ = rows.indices(self.end - self.start)
        return self.src[(slice(self.start + a, self.start + b),) + rest]


def _rows(src: Any, start: int, end: int) -> torch.Tensor:
    return src[start:end]


def _cols(src: Any, start: int, end: int) -> torch.Tensor:
    return src[:, start:end]


def with_scales(module: torch.nn.Module, names: list[str]) -> list[str]:
    """``names`` (a self-loading module's) and the block scales of the projections among them
    that hold FP8 weights (``quantization/fp8_block.py`` gives those a ``weight_scale_inv``)."""
    scales = []
    for name in names:
        path, _, leaf = name.rpartition(".")
        if leaf == "weight" and hasattr(_module(module, path), MATRIX_KINDS[1]):
            scales.append(f"{path}.{MATRIX_KINDS[1]}")
    return names + scales


def self_loading_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Modules that name and load their own HF weights (``checkpoint_names`` /
    ``load_checkpoint``: MoE experts, MLPs sharded their own way), by their path."""
    return {
        path: m
        for path, m in model.named_modules()
        if path and hasattr(m, "checkpoint_names") and hasattr(m, "load_checkpoint")
    }


def _owner(name: str, owners: dict[str, torch.nn.Module]) -> tuple[str, torch.nn.Module] | None:
    """The self-loading module whose path prefixes HF weight ``name``, with the rest of the name."""
    path = name
    while "." in path:
        path = path.rpartition(".")[0]
        if path in owners:
            return name[len(path) + 1 :], owners[path]
    return None


def checkpoint_weight_names(model: torch.nn.Module) -> set[str]:
    """HF names of every weight ``model`` needs from a checkpoint."""
    fused: dict[str, dict[int, str]] = {}
    for proj, (module, shard) in FUSED.items():
        fused.setdefault(module, {})[shard] = proj
    owners = self_loading_modules(model)
    names = {f"{path}.{n}" for path, m in owners.items() for n in m.checkpoint_names()}
    for name, _ in model.named_parameters():
        if _owner(name, owners) is not None:
            continue
        module_path, _, leaf = name.rpartition(".")
        parent, _, module = module_path.rpartition(".")
        if module in fused:
            names.update(f"{parent}.{proj}.{leaf}" for proj in fused[module].values())
        else:
            names.add(name)
    return names


def renamed(name: str, prefixes: dict[str, str]) -> str:
    """``name`` with its first matching prefix of ``prefixes`` replaced by the prefix's value."""
    for old, new in prefixes.items():
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def _module(model: torch.nn.Module, path: str) -> Optional[torch.nn.Module]:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def renamed_part(name: str, parts: dict[str, str]) -> str:
    """``name`` with the first of ``parts`` it contains replaced (once) by the part's value."""
    for old, new in parts.items():
        if old in name:
            return name.replace(old, new, 1)
    return name


def load_weights(
    model: torch.nn.Module, weights: Iterable[tuple[str, Any]], shards: TPShards, tied_head: bool
) -> None:
    """Copy HF-named weights (tensors or safetensors slices) into ``model``, each rank its shard.
    Every needed weight must come and nothing unknown may (``ValueError`` naming them otherwise)."""
    params = dict(model.named_parameters())
    owners = self_loading_modules(model)
    loaded = set()
    for name, src in weights:
        if (
            name.endswith(IGNORED_SUFFIXES)
            or (name == "lm_head.weight" and tied_head)
            or not shards.holds(name)
        ):
            continue
        owned = _owner(name, owners)
        if owned is not None:
            rest, module = owned
            try:
                module.load_checkpoint(rest, src)
            except ValueError as e:
                raise ValueError(f"weight {name!r}: {e}") from None
            loaded.add(name)
            continue
        module_path, _, leaf = name.rpartition(".")
        parent, _, proj = module_path.rpartition(".")
        if proj in FUSED and name not in params:  # a model that keeps it apart loads it as is
            module, index = FUSED[proj]
            target = f"{parent}.{module}"
            if f"{target}.{leaf}" not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            try:
                model.get_submodule(target).load_shard(index, leaf, shards.shard(name, src))
            except ValueError as e:
                raise ValueError(f"weight {name!r}: {e}") from None
        elif proj in FUSED_ON_DISK and isinstance(_module(model, module_path), MergedLinear):
            # stored fused (Phi-3's qkv_proj, GLM-4's gate_up_proj): each block as its own weight
            shape = tuple(src.shape) if isinstance(src, torch.Tensor) else tuple(src.get_shape())
            sizes = shards.fused_rows(proj)
            if not shape or shape[0] != sum(sizes):
                raise ValueError(f"weight {name!r}: expected {sum(sizes)} rows, got shape {shape}")
            module, start = model.get_submodule(module_path), 0
            for index, (part, rows) in enumerate(zip(FUSED_ON_DISK[proj], sizes)):
                block = RowSection(src, start, start + rows)
                module.load_shard(index, leaf, shards.shard(f"{parent}.{part}.{leaf}", block))
                loaded.add(f"{parent}.{part}.{leaf}")
                start += rows
        else:
            param = params.get(name)
            if param is None:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            tensor = shards.shard(name, src)
            if param.shape != tensor.shape:
                raise ValueError(
                    f"weight {name!r}: expected shape {tuple(param.shape)}, "
                    f"got {tuple(tensor.shape)}"
                )
            param.data.copy_(tensor)
        loaded.add(name)
    for module in owners.values():
        if hasattr(module, "finish_loading"):
            module.finish_loading()
    missing = sorted(checkpoint_weight_names(model) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (
            f", ... ({len(missing)} in all)" if len(missing) > 8 else ""
        )
        raise ValueError(f"checkpoint is missing weight(s): {shown}")
