"""The ranks' control broadcast (``TPGroup.broadcast_bytes``) over gloo: rank 0's bytes on every
rank, whatever their length around the inline limit, nothing (the idle loop's case) included."""

import multiprocessing as mp

from pdserve.distributed import INLINE_BYTES
from tests.helpers.ports import free_port

MESSAGES = [
    b"",
    b"\x00",
    b"x" * (INLINE_BYTES - 1),
    bytes(range(256)) * (INLINE_BYTES // 256),
    b"y" * (INLINE_BYTES + 1),
    bytes(range(251)) * 40,
    b"\x00" * 3,
]


def _rank_main(rank, port, out):
    import torch
    import torch.distributed as dist

    from pdserve.distributed import TPGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1], backend="gloo")
        tp = TPGroup(rank=rank, size=2, group=group, cpu_group=group, ranks=(0, 1))
        got = [tp.broadcast_bytes(m if rank == 0 else None) for m in MESSAGES]
        got.append(tp.broadcast_bytes(None if rank == 0 else b"ignored"))  # rank 0 sends nothing
        out.put((rank, got))
    finally:
        dist.destroy_process_group()


def test_every_rank_gets_rank_zeros_bytes():
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert got[0] == got[1] == [*MESSAGES, b""]
    assert all(p.exitcode == 0 for p in procs)
