"""What a decode session may register with a prefill rank, and ask it to write (checked
before any byte moves).

``registration_errors``: a ``Register`` is accepted only when both sides agree on the model,
layout, page size, dtype and transfer backend, and their TP sizes can be paired
(``rank_map``: this rank writes some KV heads into that decode rank, or holds an empty slice for
it and only concludes its rooms); errors name both sides' values.

A ``TransferRequest`` names destination pages, a metadata row and state slots by index. The
prefill rank accepts it only when
- every index lies inside the buffers that session registered (page < pages in its KV pool,
  row < rows in its metadata buffers, slot < slots in its state buffers), and
- no page or row is also the destination of another unfinished room of the same session
  (what decode allocated to a room belongs to that room alone until the room ends here), and
- it names no page, row or slot at all when this rank's slice for that decode rank is empty
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
from pdserve.disagg.layout import group_rows, pair_regions
from pdserve.disagg.messages import BufferDesc, Register, TransferRequest
from pdserve.disagg.rank_map import HeadSlice


def head_slice(a, msg: Register) -> HeadSlice:
    """The KV heads prefill rank ``a`` writes into the decode rank of ``msg`` (``rank_map``; an
    empty slice: none); ValueError when the TP sizes cannot be paired or that decode rank has no
    business with this rank."""
    return rank_map.slice_for(a.tp_size, msg.decode_tp_size, a.total_kv_head_num, a.num_heads, a.engine_rank,
                              msg.decode_rank)


def registration_errors(a, msg: Register, backend_name: str) -> list[str]:
    """Why prefill rank ``a`` (its ``KVArgs``) cannot serve decode registration ``msg``."""
    errs = compat_mismatches(a.compat_info(), msg.compat)
    if msg.backend != backend_name:
        errs.append(f"transfer backend mismatch: prefill {backend_name}, decode {msg.backend}")
    try:
        sl = head_slice(a, msg)
    except ValueError as e:
        return errs + [f"prefill tp {a.tp_size} rank {a.engine_rank} and decode tp {msg.decode_tp_size} "
                       f"rank {msg.decode_rank}: {e}"]
    paired, why = dst_regions(a, msg.buffers)
    if why:
        errs.append(f"kv regions mismatch: {why}")
    else:
        finals = [msg.buffers.kv_region_final[j] for j in paired]
        if finals != list(a.kv_region_final):
            i = next(i for i, (p, d) in enumerate(zip(a.kv_region_final, finals)) if p != d)
            errs.append(f"kv region final mismatch: cache group {a.kv_region_group[i]} layer {a.kv_region_layer[i]} "
                        f"is final {a.kv_region_final[i]} on prefill, {finals[i]} on decode")
        dst_items = [msg.buffers.kv_item_lens[j] for j in paired]
        # one page item = the rank's KV heads x page_size x head_dim: the decode rank's holds its heads
        want = [item // sl.src_heads * sl.dst_heads for item in a.kv_item_lens]
        if dst_items != want:
            errs.append(f"kv page item bytes mismatch: decode rank {msg.decode_rank} should hold {sl.dst_heads} "
                        f"KV head(s) per page ({sorted(set(want))} bytes), it registered {sorted(set(dst_items))}")
    if msg.buffers.aux_item_lens != list(a.aux_item_lens):
        errs.append(f"metadata row layout mismatch: prefill {a.aux_item_lens}, decode {msg.buffers.aux_item_lens}")
    if msg.buffers.routed_item_lens != list(a.routed_item_lens):
        errs.append(f"routed experts region mismatch: prefill pages of {a.routed_item_lens} bytes, decode "
                    f"{msg.buffers.routed_item_lens} (both need --enable-return-routed-experts)")
    if msg.buffers.state_type != a.state_type:
        errs.append(f"state_type mismatch: prefill {a.state_type}, decode {msg.buffers.state_type}")
    return errs


def dst_regions(a, buffers: BufferDesc) -> tuple[list[int], str]:
    """The decode region of every KV region of prefill rank ``a``, paired by cache group and
    layer (``layout.pair_regions``): a pipeline stage pairs only its own layers."""
    return pair_regions(a.kv_region_group, a.kv_region_layer, buffers.kv_region_group, buffers.kv_region_layer)


def _rows(lens: list[int], items: list[int]) -> int:
    counts = [length // item for length, item in zip(lens, items) if item > 0]
    return min(counts) if counts else 0


class DestinationGuard:
    """One per registered decode session; the caller (the KV manager) holds its lock."""

    def __init__(self, buffers: BufferDesc, kv_entries: list[int], num_groups: int, empty_slice: bool = False,
                 routed_group: int = -1):
        self.empty_slice = empty_slice  # this rank writes nothing into that decode rank
        # pages per cache group in the decode regions this rank writes (``kv_entries``, and the
        # routed experts' region, addressed by ``routed_group``'s pages)
        entries = [(buffers.kv_data_lens[j], buffers.kv_item_lens[j], buffers.kv_region_group[j]) for j in kv_entries]
        if 0 <= routed_group < num_groups:
            entries += [(n, item, routed_group) for n, item in zip(buffers.routed_data_lens, buffers.routed_item_lens)]
        self.num_pages = group_rows(*zip(*entries), num_groups) if entries else [0] * num_groups
        self.num_aux_rows = _rows(buffers.aux_data_lens, buffers.aux_item_lens)
        self.num_state_slots = _rows(buffers.state_data_lens, buffers.state_item_lens)
        self._pages: dict[tuple[int, int], int] = {}  # (cache group, destination page) -> room
        self._rows: dict[int, int] = {}  # metadata row -> room
        self._by_room: dict[int, TransferRequest] = {}

    def check(self, req: TransferRequest) -> str:
        """Why ``req`` must be refused ("" when it may be served)."""
        pages = [p for g in req.dst_pages for p in g]
        if self.empty_slice and (pages or req.aux_slot >= 0 or req.state_indices):
            return (f"the request names {len(pages)} destination page(s), metadata row {req.aux_slot} and "
                    f"{len(req.state_indices)} state slot(s), but this prefill rank holds none of that decode "
                    "rank's KV heads to write (prefill and decode disagree on which rank writes what); "
                    "nothing written")
        if len(req.dst_pages) > len(self.num_pages):
            return (f"the request names destination pages of {len(req.dst_pages)} cache groups, decode registered "
                    f"{len(self.num_pages)}; nothing written")
        for g, ids in enumerate(req.dst_pages):
            bad = next((p for p in ids if not 0 <= p < self.num_pages[g]), None)
            if bad is not None:
                where = f" of cache group {g}" if len(self.num_pages) > 1 else ""
                return (f"destination page {bad}{where} is outside decode's registered KV pool "
                        f"({self.num_pages[g]} pages); nothing written")
            if len(set(ids)) != len(ids):
                return "destination pages repeat within the request; nothing written"
        if req.aux_slot >= self.num_aux_rows or req.aux_slot < -1:
            return (f"metadata row {req.aux_slot} is outside decode's registered metadata buffers "
                    f"({self.num_aux_rows} rows); nothing written")
        bad = next((i for i in req.state_indices if not 0 <= i < self.num_state_slots), None)
        if bad is not None:
            return (f"state slot {bad} is outside decode's registered state buffers "
                    f"({self.num_state_slots} slots); nothing written")
        owner = next((self._pages[(g, p)] for g, ids in enumerate(req.dst_pages) for p in ids
                      if self._pages.get((g, p), req.room) != req.room), None)
        if owner is not None:
            return (f"destination pages overlap those of room {owner}, still in flight from the same decode; "
                    "nothing written")
        if req.aux_slot >= 0 and self._rows.get(req.aux_slot, req.room) != req.room:
            return (f"metadata row {req.aux_slot} is the destination of room {self._rows[req.aux_slot]}, "
                    "still in flight from the same decode; nothing written")
        return ""

    def claim(self, req: TransferRequest) -> None:
        """Record ``req``'s destinations as its room's (after ``check`` passed)."""
        self.release(req.room)
        self._by_room[req.room] = req
        for g, ids in enumerate(req.dst_pages):
            for p in ids:
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
