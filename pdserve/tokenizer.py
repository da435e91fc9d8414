"""A checkpoint's tokenizer, as transformers' ``AutoTokenizer`` loads it, without paying each time
for what ``AutoTokenizer`` imports to choose the class.

``AutoTokenizer`` decides from ``tokenizer_config.json`` and the model's configuration, which it
reads through the model's configuration class. In transformers 5 that import pulls torch, the
model-loading modules and ``torch.distributed.tensor`` (about 2 CPU seconds per process; the
HTTP front end and the router need none of it). What it decides depends only on the
checkpoint's small files and transformers' version, so the class it picked is recorded under
the cache directory, keyed by the bytes of those files, the version and the arguments. When the
record says the generic ``TokenizersBackend`` (what a tokenizer saved by transformers 5 names),
later loads build that class directly; any other choice, a hub id or an unreadable directory
goes through ``AutoTokenizer`` every time."""

from __future__ import annotations

from typing import Any

from pdserve import records

GENERIC = "TokenizersBackend"
KIND = "tokenizer-classes"  # the records' folder under the cache directory


def load_tokenizer(path: str, **kwargs: Any):
    """``AutoTokenizer.from_pretrained(path, **kwargs)``, or the class it chose for these files
    before (see the module docstring)."""
    from transformers import TokenizersBackend

    key = records.key(path, kwargs)
    if records.read(KIND, key).strip() == GENERIC:
        return TokenizersBackend.from_pretrained(path, **kwargs)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    cls = type(tokenizer)
    name = GENERIC if cls is TokenizersBackend else f"{cls.__module__}.{cls.__name__}"
    records.write(KIND, key, name + "\n")
    return tokenizer
