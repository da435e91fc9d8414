"""Which prefill and decode servers can be paired: their KV transfer backends must match, and
the ``local`` backend (shared memory) works only between two processes on one host.

A server's backend (``disaggregation_transfer_backend``) and host (``host_id``: boot id and
network namespace, ``disagg/transfer/local.py``) come from its ``/server_info``. What is not
known (a server that does not report it) is not held against a pair: the servers' own
registration check still refuses a bad pair, with the same advice.
"""

from __future__ import annotations

from typing import Optional

from pdserve.router.workers import Worker

NETWORK_BACKENDS = "--disaggregation-transfer-backend mooncake (TCP/RDMA) or nixl (UCX)"


def _field(worker: Worker, name: str) -> Optional[str]:
    value = (worker.info or {}).get(name)
    return value if isinstance(value, str) and value else None


def why_not(prefill: Worker, decode: Worker) -> Optional[str]:
    """Why ``prefill`` and ``decode`` cannot work together, or None when they can (or it is not
    known)."""
    p_backend, d_backend = (
        _field(prefill, "disaggregation_transfer_backend"),
        _field(decode, "disaggregation_transfer_backend"),
    )
    if p_backend and d_backend and p_backend != d_backend:
        return (
            f"prefill {prefill.url} uses the {p_backend} transfer backend and decode {decode.url} "
            f"uses {d_backend}: start both with the same --disaggregation-transfer-backend"
        )
    if p_backend == d_backend == "local":
        p_host, d_host = _field(prefill, "host_id"), _field(decode, "host_id")
        if p_host and d_host and p_host != d_host:
            return (
                f"prefill {prefill.url} and decode {decode.url} use the local transfer backend "
                "(shared memory, one host only) but run on different hosts: "
                f"start both with {NETWORK_BACKENDS}"
            )
    return None
