import numpy as np
import pytest
import torch

from pdserve.disagg.descriptors import page_runs, region_descriptors
from pdserve.disagg.metadata import EMPTY_ROOM, MetadataBuffers, SlotAllocator

torch.set_num_threads(1)


def test_rows_are_padded_and_room_is_last():
    m = MetadataBuffers(4, hidden_size=8)
    info = m.buffer_info()
    assert info.names[-1] == "bootstrap_room"
    assert "output_hidden_states" in info.names
    assert all(n >= 64 for n in info.item_lens)
    assert all(p % 64 == 0 for p in np.array(info.data_ptrs) - info.data_ptrs[0])
    assert [d // i for d, i in zip(info.data_lens, info.item_lens)] == [4] * len(info.names)
    assert "output_hidden_states" not in MetadataBuffers(4, hidden_size=0).buffer_info().names


def test_set_get_row_and_room_gate():
    m = MetadataBuffers(4, hidden_size=4)
    assert all(m.row_room(s) == EMPTY_ROOM for s in range(4))
    room = 2**63 - 5
    m.set_row(
        2,
        room,
        first_token=123,
        logprob=-0.25,
        top_logprobs=[(-0.25, 123), (-2.0, 9)],
        cached_tokens=(10, 6, 3, 1),
        topk_p=[0.5, 0.25],
        topk_index=[4, 5],
        hidden_states=torch.tensor([1.0, 2.0, 3.0, 4.0]),
    )
    row = m.get_row(2)
    assert row.room == room and m.row_room(2) == room
    assert row.first_token == 123 and row.logprob == -0.25
    assert row.top_logprobs == [(-0.25, 123), (-2.0, 9)]
    assert row.cached_tokens == (10, 6, 3, 1)
    assert row.topk_p[:2] == [0.5, 0.25] and row.topk_index[:2] == [4, 5]
    assert row.hidden_states.tolist() == [1.0, 2.0, 3.0, 4.0]
    m.set_row(2, 7, first_token=5)  # reuse: old fields do not leak into the new row
    row = m.get_row(2)
    assert row.logprob is None and row.top_logprobs == [] and row.cached_tokens == (0, 0, 0, 0)
    m.clear_row(2)
    assert m.row_room(2) == EMPTY_ROOM
    with pytest.raises(ValueError, match="top_logprobs"):
        m.set_row(0, 1, 1, top_logprobs=[(0.0, 1)] * 21)


def test_metadata_uses_the_allocator():
    calls = []

    def alloc(n, device):
        calls.append(n)
        return torch.zeros(n, dtype=torch.uint8)

    m = MetadataBuffers(3, allocator=alloc)
    assert len(calls) == 1  # one allocation for all fields
    ptrs = m.buffer_info().data_ptrs
    assert ptrs[0] == m._raw.data_ptr()


def test_slot_allocator():
    a = SlotAllocator(3)
    got = [a.alloc() for _ in range(3)]
    assert sorted(got) == [0, 1, 2] and a.alloc() is None and a.num_free() == 0
    a.free(got[1])
    assert a.alloc() == got[1]
    a.free(0)
    with pytest.raises(AssertionError, match="double free"):
        a.free(0)
    with pytest.raises(AssertionError, match="outside"):
        a.free(3)


def test_page_runs_merge_only_when_both_sides_are_contiguous():
    s, d, n = page_runs([1, 2, 3, 7, 8, 9], [10, 11, 12, 13, 20, 21])
    # src breaks at 3->7, dst breaks at 13->20
    assert s.tolist() == [1, 7, 8] and d.tolist() == [10, 13, 20] and n.tolist() == [3, 1, 2]
    s, d, n = page_runs(list(range(5, 105)), list(range(200, 300)))
    assert n.tolist() == [100]
    assert [x.tolist() for x in page_runs([], [])] == [[], [], []]
    with pytest.raises(ValueError):
        page_runs([1], [])


def test_region_descriptors():
    src, dst, lens = region_descriptors(
        [1000, 5000], [90000, 95000], [10, 20], [1, 2, 5], [3, 4, 9]
    )
    # region-major; runs (1->3, len 2) and (5->9, len 1)
    assert src.tolist() == [1010, 1050, 5020, 5100]
    assert dst.tolist() == [90030, 90090, 95060, 95180]
    assert lens.tolist() == [20, 10, 40, 20]
