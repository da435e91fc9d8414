"""A checkpoint's configuration as transformers' ``AutoConfig`` reads it, without paying in every
process for what ``AutoConfig`` imports.

transformers 5's configuration classes import, at module level, its type validators, which
bring in its activations, kernel hub and model-loading modules and ``torch.distributed.tensor``:
about 1 CPU second per process, in every scheduler rank of every server. What ``AutoConfig``
builds depends only on the checkpoint's small files and transformers' version, so the first
process to read a checkpoint records every attribute of the object it got (the fields, the
values the class derives, its properties, nested configurations) as JSON under the cache
directory, keyed like the tokenizer records (``pdserve.records``); every process, the first
included, then works on a :class:`RecordedConfig` built from that record, so a server behaves
the same whether it wrote the record or read it.

An attribute the record cannot hold (anything but numbers, strings, lists, tuples, sets, dicts,
dtypes and nested configurations; in transformers 5 only its per-layer views) is named in the
record, and reading it raises ``TypeError`` rather than ``AttributeError``, so that no
``getattr(config, name, default)`` quietly takes the default. The per-layer view of a
heterogeneous configuration (Gemma 4's: its full-attention layers have another ``head_dim``), whose
global per-layer fields transformers refuses to read, is kept as the list of the layers'
configurations (``per_layer_config[i].head_dim`` reads as on the original)."""

from __future__ import annotations

import json
import logging
from typing import Any

from pdserve import records

logger = logging.getLogger(__name__)

KIND = "configs"  # the records' folder under the cache directory
FORMAT = 3  # of the record; a record of another format is read as none


class RecordedConfig:
    """A configuration's attributes as ``AutoConfig``'s object had them. Reads and writes of an
    alias of the class's ``attribute_map`` go to the attribute it names, as they do there."""

    def __init__(self, class_name: str, attrs: dict[str, Any], unrecorded: dict[str, str]):
        object.__setattr__(self, "_recorded_class", class_name)
        object.__setattr__(self, "_unrecorded", unrecorded)
        self.__dict__.update(attrs)

    def __getattr__(self, name: str) -> Any:  # only for names not set on the object
        own = self.__dict__  # (empty while copy.copy builds one)
        target = own.get("attribute_map", {}).get(name)
        if target is not None and target != name:
            return getattr(self, target)
        cls = own.get("_recorded_class", "a configuration")
        unrecorded = own.get("_unrecorded", {})
        if name in unrecorded:  # not an AttributeError: getattr(c, name, default) must fail
            raise TypeError(
                f"{cls}.{name} (a {unrecorded[name]}) is not kept in the configuration record "
                "(pdserve/models/hf_config.py)"
            )
        raise AttributeError(f"{cls} (recorded) has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        target = self.__dict__.get("attribute_map", {}).get(name)
        object.__setattr__(self, target if target is not None else name, value)

    def __repr__(self) -> str:
        return f"RecordedConfig({self._recorded_class}, {len(self.__dict__) - 1} attributes)"


class _Unrecordable(TypeError):
    pass


def load_hf_config(model_path: str):
    """The configuration ``AutoConfig.from_pretrained(model_path, local_files_only=True)`` gives,
    as a :class:`RecordedConfig` (see the module docstring)."""
    digest = records.key(model_path)
    text = records.read(KIND, digest)
    if text:
        try:
            record = json.loads(text)
            if record.get("format") == FORMAT:
                return _decode(record["config"])
        except (ValueError, KeyError, TypeError) as e:
            logger.warning("ignoring the unreadable config record of %s: %s", model_path, e)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    encoded = _encode(config)
    records.write(KIND, digest, json.dumps({"format": FORMAT, "config": encoded}))
    return _decode(encoded)


def snapshot(config) -> dict[str, Any]:
    """Every attribute of a configuration object that the record keeps, by name (aliases of its
    ``attribute_map`` left out: they are read through it); for tests and the record."""
    import warnings

    from transformers.utils import logging as hf_logging

    aliases = set(getattr(config, "attribute_map", None) or ())
    out = {}
    said = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # deprecated aliases (torch_dtype, ...) warn when read
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in dir(config):
                if name.startswith("__") or name in aliases:
                    continue
                try:
                    value = getattr(config, name)
                except Exception:  # a property that does not apply to this configuration
                    continue
                if callable(value) and not _is_config(value):
                    continue
                out[name] = value
    finally:
        hf_logging.set_verbosity(said)
    return out


def _is_config(value: Any) -> bool:
    return any(c.__name__ in ("PreTrainedConfig", "PretrainedConfig") for c in type(value).__mro__)


def _encode_config(config) -> dict[str, Any]:
    attrs, unrecorded = {}, {}
    for name, value in snapshot(config).items():
        try:
            attrs[name] = _encode(value)
        except _Unrecordable:
            unrecorded[name] = type(value).__name__
    if getattr(config, "is_heterogeneous", False) is True:  # its layers' configurations
        attrs["per_layer_config"] = _encode(list(config.per_layer_config))
        unrecorded.pop("per_layer_config", None)
    return {"class": type(config).__name__, "attrs": attrs, "unrecorded": unrecorded}


def _encode(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v) for v in value]}
    if isinstance(value, (set, frozenset)):
        return {"__set__": [_encode(v) for v in value]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _encode(v) for k, v in value.items()}
        return {"__items__": [[_encode(k), _encode(v)] for k, v in value.items()]}
    if _is_config(value):
        return {"__config__": _encode_config(value)}
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return {"__dtype__": str(value).removeprefix("torch.")}
    raise _Unrecordable(type(value).__name__)


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tuple__" in value:
        return tuple(_decode(v) for v in value["__tuple__"])
    if "__set__" in value:
        return {_hashable(_decode(v)) for v in value["__set__"]}
    if "__items__" in value:
        return {_hashable(_decode(k)): _decode(v) for k, v in value["__items__"]}
    if "__config__" in value:
        inner = value["__config__"]
        attrs = {k: _decode(v) for k, v in inner["attrs"].items()}
        return RecordedConfig(inner["class"], attrs, inner.get("unrecorded", {}))
    if "__dtype__" in value:
        import torch

        return getattr(torch, value["__dtype__"])
    return {k: _decode(v) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key
