"""KV tier backends: where a page's KV goes when it leaves the pool (host memory, disk, a store).

The unit of storage is one page of one request prefix across every layer and every region of the
pool (K, V and any scale regions), as one ``bytes`` value. Its key is
``f"{layout_key}/{block_hash:016x}"``: ``block_hash`` is the page's token-block hash chain
(``pdserve.kv_events.chain_hashes``, the namespace included), and ``layout_key`` names the model
and the pool layout (dtype, page size, layer count, head shape, TP rank), so servers whose pages
do not fit each other never read each other's entries.

Contract of a backend:

- The value handed to ``put`` is already framed by the tier (a header with a magic, the layout
  key, the length and a checksum, see ``kv_tier.entry``); a backend stores and returns it
  verbatim. The tier verifies it on ``get``: a corrupt entry is counted, logged, removed (through
  ``remove``) and treated as a miss.
- ``put`` returns False on any failure and never raises; ``get`` returns None on a miss, a
  failure or an unreachable backend and never raises; ``exists`` returns how many of the leading
  keys are present (it stops at the first absent one) and never raises (0 when down).
- Calls may come from two threads at once: the scheduler's (``get``, ``exists``) and the tier's
  writer thread (``put``); a backend guards its own state.
- ``medium`` is the KV events medium of the entries it holds: ``"CPU"`` for host memory,
  ``"STORAGE"`` for disk or a remote store.
- Entries a backend drops on its own (capacity eviction) are reported by ``drain_removed`` so
  the tier can publish ``BlockRemoved`` for them; a backend that never drops on its own keeps the
  default (nothing).

Backends are found by name through a registry of ``"module:Class"`` paths, imported only when
chosen, so an optional dependency (e.g. Mooncake) is needed only by servers that pick it. A
built-in backend is a line in ``_REGISTRY`` below (the server arguments are checked against it
before anything is imported); code that embeds the engine may add one with
``register_backend(name, "package.module:Class")`` before building its ``ServerArgs``.
"""

from __future__ import annotations

import abc
import importlib
from typing import TYPE_CHECKING, Iterable, Optional

if TYPE_CHECKING:
    from pdserve.config import ServerArgs


class TierBackend(abc.ABC):
    """One tier below the pool; see the module docstring for the contract."""

    medium: str = "STORAGE"  # KV events medium: "CPU" for host, "STORAGE" for disk/store

    def __init__(self, args: "ServerArgs", layout_key: str, page_nbytes: int):
        self.args = args
        self.layout_key = layout_key
        self.page_nbytes = page_nbytes

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> bool:
        """Store ``data`` under ``key`` (replacing any entry); False on failure, never raises."""

    @abc.abstractmethod
    def get(self, key: str) -> Optional[bytes]:
        """The bytes stored under ``key``; None on a miss, a failure or a backend that is down."""

    @abc.abstractmethod
    def exists(self, keys: list[str]) -> int:
        """How many of the leading ``keys`` are present (stops at the first absent one)."""

    def remove(self, key: str) -> None:
        """Drop ``key`` if present (a corrupt entry); never raises. Default: nothing to drop."""

    def startup_entries(self, header_nbytes: int) -> Iterable[tuple[str, bytes]]:
        """The entries present when the backend started (a store that outlives the server), as
        (key, its first ``header_nbytes`` bytes), so the tier can announce them in KV events.
        Default: none known."""
        return ()

    def drain_removed(self) -> list[str]:
        """Keys this backend dropped on its own since the last call (capacity eviction)."""
        return []

    def close(self) -> None:
        """Release files, connections and memory; the backend is not used after this."""


# name -> "module:Class"; imported only when a server chooses the name
_REGISTRY: dict[str, str] = {
    "file": "pdserve.engine.kv_tier.file_store:FileTierBackend",
    "mooncake": "pdserve.engine.kv_tier.mooncake_store:MooncakeStoreBackend",
}


def register_backend(name: str, target: str) -> None:
    """Make ``--hicache-storage-backend name`` build ``target`` (``"package.module:Class"``)."""
    module, sep, cls = target.partition(":")
    if not sep or not module or not cls:
        raise ValueError(f"tier backend {name!r}: target {target!r} is not 'module:Class'")
    _REGISTRY[name] = target


def registered_backends() -> list[str]:
    return sorted(_REGISTRY)


def backend_class(name: str) -> type[TierBackend]:
    if name not in _REGISTRY:
        raise ValueError(
            f"hicache_storage_backend: unknown {name!r}; available: {registered_backends()}"
        )
    module, _, cls = _REGISTRY[name].partition(":")
    try:
        found = getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"hicache_storage_backend: {name!r} cannot be loaded from {_REGISTRY[name]!r}: {e}"
        ) from e
    if not (isinstance(found, type) and issubclass(found, TierBackend)):
        raise ValueError(f"hicache_storage_backend: {_REGISTRY[name]!r} is not a TierBackend")
    return found


def create_backend(name: str, args: "ServerArgs", layout_key: str, page_nbytes: int) -> TierBackend:
    return backend_class(name)(args, layout_key, page_nbytes)
