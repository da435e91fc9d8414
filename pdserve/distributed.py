"""Tensor-parallel ranks of one server: their process group and the collectives the model and
the scheduler loop use.

A server with ``--tp-size N`` runs N scheduler processes, one per rank, joined by
``torch.distributed`` (gloo on CPU, NCCL for the model on CUDA, plus a gloo group for control on
CUDA). ``TPGroup`` is what the rest of the code sees: ``rank``, ``size`` and a few collectives
that are no-ops at size 1, so single-rank code paths pay nothing.

Control messages between ranks (the front end's requests, broadcast by rank 0 every loop
iteration) are msgpack bytes in a uint8 tensor: nothing is pickled across processes.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

# A collective that waits longer than this means a rank died or hangs: every rank raises and exits.
COLLECTIVE_TIMEOUT_S = 120.0


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # the model's collectives (gloo on CPU, NCCL on CUDA)
    cpu_group: Any = None  # control: input broadcast, KV poll all-reduce (always gloo)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    # ---- model collectives -----------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns it."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(t, group=self.group)
        return t

    def all_gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``t`` along the last dimension, in rank order."""
        if self.size == 1:
            return t
        import torch.distributed as dist

        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    # ---- control ---------------------------------------------------------------------------
    def broadcast_bytes(self, data: Optional[bytes]) -> bytes:
        """Rank 0's ``data`` on every rank (the others pass None)."""
        if self.size == 1:
            return data or b""
        import torch.distributed as dist

        n = torch.tensor([len(data) if self.rank == 0 and data else 0], dtype=torch.int64)
        dist.broadcast(n, src=0, group=self.cpu_group)
        size = int(n.item())
        if size == 0:
            return b""
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 else \
            torch.empty(size, dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.cpu_group)
        return data if self.rank == 0 else buf.numpy().tobytes()

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order, on every rank."""
        return [data] if self.size == 1 else all_gather_bytes(data, self.cpu_group)

    def broadcast_object_str(self, value: Optional[str]) -> str:
        """A short string from rank 0 (e.g. a decision every rank must share)."""
        return self.broadcast_bytes(value.encode() if self.rank == 0 and value is not None else None).decode()

    def barrier(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            dist.barrier(group=self.cpu_group)

    def destroy(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


SINGLE = TPGroup()


def all_gather_bytes(data: bytes, group) -> list[bytes]:
    """Every member of gloo ``group``'s ``data``, in rank order (lengths first, then padded bytes)."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    n = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(sizes, n, group=group)
    longest = max(1, max(int(x.item()) for x in sizes))
    buf = torch.zeros(longest, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(size)]
    dist.all_gather(parts, buf, group=group)
    return [p[: int(k.item())].numpy().tobytes() for p, k in zip(parts, sizes)]


def init_tp(rank: int, size: int, init_address: str, device: str = "cpu") -> TPGroup:
    """Join the server's ``size`` ranks at ``init_address`` (``tcp://host:port``, rank 0 listens)."""
    if size == 1:
        return TPGroup()
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=init_address, rank=rank, world_size=size, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    logger.info("tensor-parallel rank %d of %d joined (%s)", rank, size, backend)
    return TPGroup(rank=rank, size=size, group=dist.group.WORLD, cpu_group=cpu_group)


def shard_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of ``rank``'s equal share of ``total`` (which ``size`` must divide)."""
    if total % size:
        raise ValueError(f"{total} is not divisible by the tensor-parallel size {size}")
    per = total // size
    return rank * per, (rank + 1) * per


def kv_heads_for_rank(total_kv_heads: int, num_heads: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of the KV heads ``rank`` holds. With at least as many KV heads as ranks they
    are split; with fewer (tp_size a multiple of them) each rank keeps the one KV head its query
    heads use, so a head is replicated on tp_size / kv_heads ranks."""
    if total_kv_heads >= size:
        return shard_range(total_kv_heads, rank, size)
    if size % total_kv_heads:
        raise ValueError(f"tp_size {size} must be a multiple of num_key_value_heads ({total_kv_heads}) "
                         "when it is larger")
    q_start, _ = shard_range(num_heads, rank, size)
    kv = q_start // (num_heads // total_kv_heads)
    return kv, kv + 1
