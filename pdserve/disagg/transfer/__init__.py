"""KV transfer backends: one interface (``base.TransferBackend``), chosen by name.

``get_backend(name)`` imports the implementation lazily, so optional dependencies (Mooncake,
NIXL) are imported only when selected.
"""

from pdserve.disagg.transfer.base import (
    TransferBackend,
    TransferError,
    backend_names,
    get_backend,
    register_backend,
)

__all__ = ["TransferBackend", "TransferError", "backend_names", "get_backend", "register_backend"]
