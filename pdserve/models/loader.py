"""Build a model from an HF checkpoint directory (config.json + safetensors)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import types
from typing import Any, Iterator, Optional

import torch
from torch import nn

from pdserve.distributed import SINGLE, Parallel, TPGroup
from pdserve.models.multimodal import (
    from_multimodal,
    text_model_config,
    text_model_tensors,
    text_model_weights,
)
from pdserve.models.registry import model_class
from pdserve.quantization.base import WeightFormat
from pdserve.quantization.registry import weight_format

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TORCH_FILE = "pytorch_model.bin"
# Config fields that decide tensor shapes: two servers whose fingerprints match can share KV.
_SHAPE_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
)


def load_config(model_path: str):
    """The checkpoint's configuration as ``AutoConfig`` reads it (recorded: models/hf_config.py);
    of a multimodal checkpoint whose text model pdserve serves, that text model's
    (``models/multimodal.py``)."""
    if not os.path.isdir(model_path):
        raise FileNotFoundError(f"model_path: {model_path!r} is not a directory")
    from pdserve.models.hf_config import load_hf_config

    return text_model_config(load_hf_config(model_path))


def resolve_dtype(hf_config, dtype: str = "auto") -> torch.dtype:
    """``auto``: the checkpoint's dtype (float32 when the config names none); otherwise as asked."""
    if dtype != "auto":
        value = getattr(torch, dtype, None)
        if not isinstance(value, torch.dtype):
            raise ValueError(f"dtype: unknown {dtype!r}")
        return value
    # transformers 5 calls the field `dtype`; 4 called it `torch_dtype`
    value = getattr(hf_config, "dtype", None)
    if value is None:
        value = getattr(hf_config, "torch_dtype", None)
    if value is None:
        return torch.float32
    return getattr(torch, value) if isinstance(value, str) else value


def _safetensors_files(model_path: str) -> Optional[list[str]]:
    """The checkpoint's safetensors files (the index's shards, or the single file); None when it
    has neither."""
    index = os.path.join(model_path, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    if os.path.exists(os.path.join(model_path, SINGLE_FILE)):
        return [SINGLE_FILE]
    return None


def iter_safetensors(model_path: str) -> Iterator[tuple[str, Any]]:
    """(HF name, safetensors slice) for every tensor of ``model.safetensors`` or of the shards
    named by ``model.safetensors.index.json`` (or tensors of a ``pytorch_model.bin``). A slice reads
    only what is indexed (``s[a:b]``, ``s[:, a:b]``, ``s[:]`` for all of it), while the iteration is
    on it."""
    from safetensors import safe_open

    files = _safetensors_files(model_path)
    if files is None and os.path.exists(os.path.join(model_path, TORCH_FILE)):
        # PyTorch's format, as EAGLE heads are published: tensors only (weights_only), mapped
        yield from torch.load(
            os.path.join(model_path, TORCH_FILE), map_location="cpu", weights_only=True, mmap=True
        ).items()
        return
    if files is None:
        raise FileNotFoundError(
            f"{model_path}: none of {SINGLE_FILE}, {INDEX_FILE} or {TORCH_FILE} found"
        )
    for name in files:
        with safe_open(os.path.join(model_path, name), framework="pt", device="cpu") as st:
            for key in st.keys():
                yield key, st.get_slice(key)


def checkpoint_tensors(model_path: str) -> dict[str, tuple[str, list[int]]]:
    """Every safetensors tensor's dtype (as safetensors names it: ``BF16``, ``F8_E4M3``, ...) and
    shape, read from the files' headers only ({} for a ``pytorch_model.bin``)."""
    out = {}
    for name in _safetensors_files(model_path) or ():
        with open(os.path.join(model_path, name), "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        for key, info in header.items():
            if key != "__metadata__":
                out[key] = (info["dtype"], list(info["shape"]))
    return out


def init_dummy_weights(model: nn.Module, std: float, seed: int) -> None:
    """Random weights: normal(0, std) for matrices, ones for norm scales, zeros for biases."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            param.data.zero_()
        elif param.dim() == 1:
            param.data.fill_(1.0)
        else:
            param.data.copy_(torch.empty(param.shape).normal_(0.0, std, generator=gen))


def allocate(model: nn.Module, dtype: torch.dtype, device) -> nn.Module:
    """``model.to(dtype=dtype).to_empty(device=device)`` for a model built on the meta device:
    every parameter and buffer uninitialised, floating ones in ``dtype``. Allocated with
    ``empty_strided`` (``empty_like`` of a meta tensor runs torch's Python reference, which imports
    its symbolic-shapes machinery: a third of a second of every scheduler's start)."""

    def empty(t: torch.Tensor) -> torch.Tensor:
        kind = dtype if t.is_floating_point() else t.dtype
        return torch.empty_strided(t.size(), t.stride(), dtype=kind, device=device)

    return model._apply(empty)


def load_model(
    model_path: str,
    dtype: str = "auto",
    device: str = "cpu",
    load_format: str = "auto",
    seed: int = 0,
    tp: TPGroup = SINGLE,
    par: Optional[Parallel] = None,
    moe: Any = None,
    model_cls: Optional[type] = None,
    language_only: bool = False,
    fmt: Optional[WeightFormat] = None,
) -> tuple[nn.Module, object]:
    """(model in eval mode on ``device``, HF config); with ``tp``, this rank's shard of it (only
    that shard is read from the checkpoint); ``model_cls`` instead of the config's architecture;
    ``language_only``: a vision-language model without its vision tower; ``fmt``: the checkpoint's
    weight format as the caller made it (checked against its flags), else one read from the
    config."""
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(
            f"load_format: must be 'auto', 'safetensors' or 'dummy', got {load_format!r}"
        )
    hf_config = load_config(model_path)
    if language_only:
        hf_config.language_only = True  # read by the model's constructor
    cls = model_cls or model_class(hf_config)  # a speculative head's class, its config a Llama's
    torch_dtype = resolve_dtype(hf_config, dtype)
    with torch.device("meta"):
        model = cls(hf_config, tp=tp, par=par, moe=moe)
    # parameters are allocated once, uninitialised, in their final dtype and place (a quantized
    # layer's are replaced before anything is written to them: they never take memory)
    model = allocate(model, torch_dtype, device)
    if load_format == "dummy":
        fmt = None
    elif fmt is None:
        fmt = weight_format(hf_config)
    if load_format == "dummy":
        init_dummy_weights(model, getattr(hf_config, "initializer_range", 0.02), seed)
    else:
        weights, tensors = iter_safetensors(model_path), None
        if from_multimodal(hf_config):
            weights = text_model_weights(weights, hf_config.multimodal_architecture)
        if fmt is not None:
            tensors = checkpoint_tensors(model_path)
            if from_multimodal(hf_config):
                tensors = text_model_tensors(tensors, hf_config.multimodal_architecture)
            fmt.prepare(model, tensors)
            weights = fmt.wrap(weights, tensors)
        model.load_weights(weights)
        if fmt is not None:
            fmt.finish(model)
    model.eval().requires_grad_(False)
    where = (
        f", {par.describe()}"
        if par is not None and par.world.size > 1
        else f", tp rank {tp.rank} of {tp.size}"
        if tp.size > 1
        else ""
    )
    logger.info(
        "loaded %s (%s%s, %s, %s%s) from %s",
        cls.__name__,
        torch_dtype,
        f", weights {fmt.describe()}" if fmt is not None else "",
        device,
        load_format,
        where,
        model_path,
    )
    return model, hf_config


def context_length(hf_config) -> int:
    for name in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions"):
        value = getattr(hf_config, name, None)
        if value:
            return int(value)
    return 2048


def model_fingerprint(hf_config) -> str:
    """Short hash of the architecture and the shape-defining config fields. The compute dtype is
    not in it (hosts may choose differently); what the KV bytes mean is checked on its own
    (``kv_dtype`` at registration)."""
    fields = {name: getattr(hf_config, name, None) for name in _SHAPE_FIELDS}
    fields["architectures"] = list(getattr(hf_config, "architectures", None) or [])
    blob = json.dumps(fields, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def weights_digest(model: nn.Module) -> dict:
    """Where the loaded weights live: the model object's id and a hash of (name, data pointer,
    bytes) over every parameter, buffer and prepacked weight (the tensors a module's helper
    objects hold, e.g. a ``Linear``'s packed impl). The same digest later: nothing was loaded or
    packed again (a role switch asserts it)."""
    h = hashlib.sha256()
    count = nbytes = 0
    for name, mod in model.named_modules():
        tensors = [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]
        for attr, obj in vars(mod).items():
            if attr.startswith("_") or isinstance(obj, (torch.Tensor, nn.Module, types.ModuleType)):
                continue
            held = getattr(obj, "__dict__", None)
            if isinstance(held, dict):
                tensors += [
                    (f"{attr}.{k}", t) for k, t in held.items() if isinstance(t, torch.Tensor)
                ]
        for key, t in tensors:
            if t is not None:
                # oneDNN's prepacked weights are opaque (no storage, no data pointer): the object's
                # id
                where = id(t) if t.is_mkldnn else t.data_ptr()
                h.update(f"{name}.{key}:{where}:{t.nbytes};".encode())
                count, nbytes = count + 1, nbytes + t.nbytes
    return {
        "model_id": f"{id(model):x}",
        "tensors": count,
        "bytes": nbytes,
        "digest": h.hexdigest()[:16],
    }
