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

# A collective that waits longer than this means a rank died or hangs: every rank raises and exits
# (the default of --dist-timeout).
COLLECTIVE_TIMEOUT_S = 120.0
# A control broadcast up to this long is one collective (its length travels with it)
INLINE_BYTES = 1024


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # the model's collectives (gloo on CPU, NCCL on CUDA)
    cpu_group: Any = None  # control: input broadcast, KV poll all-reduce (always gloo)
    ranks: tuple[int, ...] = (0,)  # the members' global ranks, in group-rank order

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
        """Rank 0's ``data`` on every rank (the others pass None). One collective when it fits
        in :data:`INLINE_BYTES` (the scheduler loop's every iteration: its clock and usually no
        message), a second one for the rest of a longer message."""
        if self.size == 1:
            return data or b""
        import torch.distributed as dist

        head = torch.zeros(8 + INLINE_BYTES, dtype=torch.uint8)
        if self.rank == 0:
            data = data or b""
            first = data[:INLINE_BYTES]
            head[:8] = torch.frombuffer(
                bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8
            )
            if first:
                head[8 : 8 + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
        dist.broadcast(head, src=self.ranks[0], group=self.cpu_group)
        if self.rank == 0:
            if len(data) > INLINE_BYTES:
                rest = torch.frombuffer(bytearray(data[INLINE_BYTES:]), dtype=torch.uint8)
                dist.broadcast(rest, src=self.ranks[0], group=self.cpu_group)
            return data
        raw = head.numpy().tobytes()
        size = int.from_bytes(raw[:8], "little")
        if size <= INLINE_BYTES:
            return raw[8 : 8 + size]
        rest = torch.empty(size - INLINE_BYTES, dtype=torch.uint8)
        dist.broadcast(rest, src=self.ranks[0], group=self.cpu_group)
        return raw[8:] + rest.numpy().tobytes()

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order, on every rank."""
        return [data] if self.size == 1 else all_gather_bytes(data, self.cpu_group)

    def broadcast_object_str(self, value: Optional[str]) -> str:
        """A short string from rank 0 (e.g. a decision every rank must share)."""
        return self.broadcast_bytes(
            value.encode() if self.rank == 0 and value is not None else None
        ).decode()

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
    """Every member of gloo ``group``'s ``data``, in rank order (lengths first, then padded
    bytes)."""
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


@dataclass
class Parallel:
    """Where one scheduler rank sits in its server: ``world`` is every rank (rank 0 broadcasts
    the front end's messages over it), ``tp`` this pipeline stage's tensor-parallel ranks (the
    MLP's shards), ``attn`` this rank's attention group (query/KV heads and vocabulary: the whole
    ``tp`` group, or with ``--enable-dp-attention`` one of ``dp_size`` groups of tp/dp ranks, each
    with its own requests and KV pool)."""

    world: TPGroup = SINGLE
    tp: TPGroup = SINGLE
    attn: TPGroup = SINGLE
    # the ranks that run this rank's scheduler (its attention group in every pipeline stage): PD
    # room states are MIN-all-reduced over it, so that they all admit and finish rooms alike
    sched: TPGroup = SINGLE
    dp_rank: int = 0
    dp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    @property
    def dp_attention(self) -> bool:
        return self.dp_size > 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def leads_group(self) -> bool:
        """This rank reports its attention group's outputs to the front end (the first rank of the
        group in the first pipeline stage)."""
        return self.attn.rank == 0 and self.pp_rank == 0

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of this rank's peer (same tp rank) in pipeline stage ``pp_rank``."""
        return pp_rank * self.tp.size + self.tp.rank

    def describe(self) -> str:
        parts = [f"tp{self.tp.rank}/{self.tp.size}"]
        if self.dp_attention:
            parts.append(
                f"dp{self.dp_rank}/{self.dp_size} (attention tp{self.attn.rank}/{self.attn.size})"
            )
        if self.pp_size > 1:
            parts.append(f"pp{self.pp_rank}/{self.pp_size}")
        return " ".join(parts)


SINGLE_RANK = Parallel()


def rank_coordinates(rank: int, tp_size: int, dp_size: int) -> tuple[int, int, int, int]:
    """(pp_rank, tp_rank, dp_rank, attention tp_rank) of global ``rank``: ranks are numbered
    stage-major (stage p holds ``p*tp_size .. (p+1)*tp_size - 1``), and a stage's tp ranks form
    ``dp_size`` consecutive attention groups."""
    pp_rank, tp_rank = divmod(rank, tp_size)
    attn_size = tp_size // dp_size
    dp_rank, attn_rank = divmod(tp_rank, attn_size)
    return pp_rank, tp_rank, dp_rank, attn_rank


def init_parallel(
    rank: int,
    tp_size: int,
    init_address: str,
    device: str = "cpu",
    dp_size: int = 1,
    pp_size: int = 1,
    timeout_s: float = COLLECTIVE_TIMEOUT_S,
) -> Parallel:
    """Join the server's ``tp_size * pp_size`` ranks at ``init_address`` (``tcp://host:port``,
    rank 0 listens) and build this rank's groups. Every rank creates every group, in the same
    order (``torch.distributed.new_group`` is collective). ``timeout_s`` (``--dist-timeout``)
    bounds the join and every later collective."""
    world_size = tp_size * pp_size
    if world_size == 1:
        return Parallel()
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(
        backend, init_method=init_address, rank=rank, world_size=world_size, timeout=timeout
    )

    def group(ranks: list[int]) -> TPGroup:
        if len(ranks) == world_size:
            g = dist.group.WORLD
            cpu = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else g
        else:
            g = dist.new_group(ranks, backend=backend, timeout=timeout)
            cpu = dist.new_group(ranks, backend="gloo", timeout=timeout) if backend != "gloo" else g
        return TPGroup(
            rank=ranks.index(rank) if rank in ranks else -1,
            size=len(ranks),
            group=g,
            cpu_group=cpu,
            ranks=tuple(ranks),
        )

    pp_rank, _, dp_rank, _ = rank_coordinates(rank, tp_size, dp_size)
    attn_size = tp_size // dp_size
    world = group(list(range(world_size)))
    mine: dict[str, TPGroup] = {}
    for p in range(pp_size):  # every rank takes part in creating every group
        stage = list(range(p * tp_size, (p + 1) * tp_size))
        g = world if len(stage) == world_size else group(stage)
        if p == pp_rank:
            mine["tp"] = g
        for d in range(dp_size):
            members = stage[d * attn_size : (d + 1) * attn_size]
            a = g if len(members) == len(stage) else group(members)
            if p == pp_rank and d == dp_rank:
                mine["attn"] = a
    for d in range(dp_size):
        members = [
            p * tp_size + d * attn_size + a for p in range(pp_size) for a in range(attn_size)
        ]
        g = (
            world
            if len(members) == world_size
            else mine["attn"]
            if pp_size == 1 and d == dp_rank
            else None
            if pp_size == 1
            else group(members)
        )
        if d == dp_rank:
            mine["sched"] = g
    par = Parallel(
        world=world,
        tp=mine["tp"],
        attn=mine["attn"],
        sched=mine["sched"],
        dp_rank=dp_rank,
        dp_size=dp_size,
        pp_rank=pp_rank,
        pp_size=pp_size,
    )
    logger.info("rank %d of %d joined (%s): %s", rank, world_size, backend, par.describe())
    return par


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
        raise ValueError(
            f"tp_size {size} must be a multiple of num_key_value_heads ({total_kv_heads}) "
            "when it is larger"
        )
    q_start, _ = shard_range(num_heads, rank, size)
    kv = q_start // (num_heads // total_kv_heads)
    return kv, kv + 1
