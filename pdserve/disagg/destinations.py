"""What a decode session may register with a prefill rank, and ask it to write (checked
before any byte moves).

``registration_errors``: a ``Register`` is accepted only when both sides agree on the model,
layout, page size, dtype and transfer backend, and their TP sizes can be paired
(``rank_map``: this rank writes some of that decode rank's bytes, or holds an empty pair with it
and only concludes its rooms), and every region this rank sends has a decode region of the same
key, split and finality, of the size the split says; errors name both sides' values.

A ``TransferRequest`` names destination pages per cache group and a metadata row by index. The
prefill rank accepts it only when
- every index lies inside the buffers that session registered (page < pages of that group's
  regions, where it has any: a group of pages without bytes has none and gets no write;
  row < rows in its metadata buffers), and
- no page or row is also the destination of another unfinished room of the same session
  (what decode allocated to a room belongs to that room alone until the room ends here), and
- it names no page or row at all when this rank's pair with that decode rank is empty
  (the two sides disagree on ``rank_map`` otherwise).
This holds with or without ``--disaggregation-secret``: it protects decode memory from a buggy
or forged request, and the backend checks the resulting addresses against the registered
regions once more (``TransferBackend.write``).

A room's claims are released when this rank stops writing for it (Success or Failed sent, an
abort acknowledged, the room cleared), which is always before decode may reuse the pages.
"""

from __future__ import annotations

from pdserve.disagg import rank_map
from pdserve.disagg.kv_args import compat_mismatches
from pdserve.disagg.layout import dst_item_bytes, dst_segments, group_rows, pair_regions, writes
from pdserve.disagg.messages import BufferDesc, Register, TransferRequest
from pdserve.disagg.rank_map import PairPlan
from pdserve.kv_region import Region


def pair_plan(a, msg: Register) -> PairPlan:
    """What prefill rank ``a`` writes into the decode rank of ``msg`` (``rank_map``; an empty pair:
    nothing); ValueError when the TP sizes cannot be paired or that decode rank has no business
    with this rank."""
    return rank_map.pair_for(
        a.tp_size,
        msg.decode_tp_size,
        a.total_kv_head_num,
        a.num_heads,
        a.engine_rank,
        msg.decode_rank,
        a.splits,
    )


def registration_errors(a, msg: Register, backend_name: str) -> list[str]:
    """Why prefill rank ``a`` (its ``KVArgs``) cannot serve decode registration ``msg``."""
    errs = compat_mismatches(a.compat_info(), msg.compat)
    if msg.backend != backend_name:
        errs.append(f"transfer backend mismatch: prefill {backend_name}, decode {msg.backend}")
    try:
        pair = pair_plan(a, msg)
    except ValueError as e:
        return errs + [
            f"prefill tp {a.tp_size} rank {a.engine_rank} and decode tp {msg.decode_tp_size} "
            f"rank {msg.decode_rank}: {e}"
        ]
    paired, why = dst_regions(a, msg.buffers)
    if why:
        errs.append(f"regions mismatch: {why}")
    else:
        errs += _region_mismatches(
            a.regions,
            [msg.buffers.regions[j] for j in paired],
            pair,
            a.tp_size,
            msg.decode_tp_size,
            msg.decode_rank,
        )
    if msg.buffers.aux_item_lens != list(a.aux_item_lens):
        errs.append(
            f"metadata row layout mismatch: prefill {a.aux_item_lens}, decode "
            f"{msg.buffers.aux_item_lens}"
        )
    return errs


def _region_mismatches(
    src: list[Region], dst: list[Region], pair: PairPlan, p_tp: int, d_tp: int, d_rank: int
) -> list[str]:
    """The first disagreement between each prefill region and its decode region, per kind of
    disagreement: split, finality, item size."""
    errs = []
    split = next(((s, d) for s, d in zip(src, dst) if s.split != d.split), None)
    if split:
        s, d = split
        errs.append(
            f"region split mismatch: {s.name} is split {s.describe_split()} on prefill, "
            f"{d.describe_split()} on decode"
        )
    final = next(((s, d) for s, d in zip(src, dst) if s.final != d.final), None)
    if final:
        s, d = final
        errs.append(
            f"region final mismatch: {s.name} is final {s.final} on prefill, {d.final} on decode"
        )
    if split:
        return errs
    for s, d in zip(src, dst):
        if not writes(s, pair):  # nothing of it goes there (the other ranks check its size)
            continue
        want = dst_item_bytes(s, pair, p_tp, d_tp)
        if s.split == "segments" and d.segments != dst_segments(s, p_tp, d_tp):
            errs.append(
                f"region segments mismatch: decode rank {d_rank} of tp {d_tp} should hold segments "
                f"of {list(dst_segments(s, p_tp, d_tp))} bytes of {s.name}, "
                f"it registered {list(d.segments)}"
            )
            break
        if d.item_bytes != want:
            what = (
                f"{pair.dst_heads} KV head(s) per page"
                if s.split == "heads"
                else f"its share of {s.name}"
                if s.split == "segments"
                else f"all of {s.name}"
            )
            errs.append(
                f"region item bytes mismatch: decode rank {d_rank} should hold {what} ({want} "
                f"bytes per item of {s.name}), it registered {d.item_bytes}"
            )
            break
    return errs


def dst_regions(a, buffers: BufferDesc) -> tuple[list[int], str]:
    """The decode region of every region of prefill rank ``a``, paired by key
    (``layout.pair_regions``): a pipeline stage pairs only its own layers."""
    return pair_regions(a.regions, buffers.regions)


def _rows(lens: list[int], items: list[int]) -> int:
    counts = [length // item for length, item in zip(lens, items) if item > 0]
    return min(counts) if counts else 0


class DestinationGuard:
    """One per registered decode session; the caller (the KV manager) holds its lock."""

    def __init__(
        self, buffers: BufferDesc, regions: list[Region], num_groups: int, empty: bool = False
    ):
        self.empty = empty  # this rank writes nothing into that decode rank
        # pages per cache group in the decode regions this rank writes (``regions``)
        self.num_pages = group_rows(regions, num_groups)
        self.num_aux_rows = _rows(buffers.aux_data_lens, buffers.aux_item_lens)
        self._pages: dict[tuple[int, int], int] = {}  # (cache group, destination page) -> room
        self._rows: dict[int, int] = {}  # metadata row -> room
        self._by_room: dict[int, TransferRequest] = {}

    def check(self, req: TransferRequest) -> str:
        """Why ``req`` must be refused ("" when it may be served)."""
        pages = [p for g in req.dst_pages for p in g]
        if self.empty and (pages or req.aux_slot >= 0):
            return (
                f"the request names {len(pages)} destination page(s) and metadata row "
                f"{req.aux_slot}, but this prefill rank holds none of that decode rank's bytes to "
                "write (prefill and decode disagree on which rank writes what); nothing written"
            )
        if len(req.dst_pages) > len(self.num_pages):
            return (
                f"the request names destination pages of {len(req.dst_pages)} cache groups, decode "
                f"registered {len(self.num_pages)}; nothing written"
            )
        for g, ids in enumerate(req.dst_pages):
            limit = self.num_pages[g]  # None: the group's pages hold no bytes
            bad = None if limit is None else next((p for p in ids if not 0 <= p < limit), None)
            if bad is not None:
                where = f" of cache group {g}" if len(self.num_pages) > 1 else ""
                return (
                    f"destination page {bad}{where} is outside decode's registered KV pool "
                    f"({self.num_pages[g]} pages); nothing written"
                )
            held = [p for p in ids if p]  # 0: a logical page on which the group holds no item
            if len(set(held)) != len(held):
                return "destination pages repeat within the request; nothing written"
        if req.aux_slot >= self.num_aux_rows or req.aux_slot < -1:
            return (
                f"metadata row {req.aux_slot} is outside decode's registered metadata buffers "
                f"({self.num_aux_rows} rows); nothing written"
            )
        owner = next(
            (
                self._pages[(g, p)]
                for g, ids in enumerate(req.dst_pages)
                for p in ids
                if p and self._pages.get((g, p), req.room) != req.room
            ),
            None,
        )
        if owner is not None:
            return (
                f"destination pages overlap those of room {owner}, still in flight from the same "
                "decode; nothing written"
            )
        if req.aux_slot >= 0 and self._rows.get(req.aux_slot, req.room) != req.room:
            return (
                f"metadata row {req.aux_slot} is the destination of room "
                f"{self._rows[req.aux_slot]}, still in flight from the same decode; nothing written"
            )
        return ""

    def claim(self, req: TransferRequest) -> None:
        """Record ``req``'s destinations as its room's (after ``check`` passed)."""
        self.release(req.room)
        self._by_room[req.room] = req
        for g, ids in enumerate(req.dst_pages):
            for p in ids:
                if p:
                    self._pages[(g, p)] = req.room
        if req.aux_slot >= 0:
            self._rows[req.aux_slot] = req.room

    def release(self, room: int) -> None:
        req = self._by_room.pop(room, None)
        if req is None:
            return
        for g, ids in enumerate(req.dst_pages):
            for p in ids:
                if self._pages.get((g, p)) == room:
                    del self._pages[(g, p)]
        if self._rows.get(req.aux_slot) == room:
            del self._rows[req.aux_slot]

    @property
    def rooms(self) -> int:
        return len(self._by_room)
