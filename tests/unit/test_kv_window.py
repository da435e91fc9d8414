"""Decode's KV windows (``disagg/transfer/window.py``): a second mapping of each memfd file, whose
addresses a prefill is given instead of the buffers' own. Every buffer must be translated into
the window of its own file, also when files lie back to back, so that one file's end is the next
file's first byte (seen: the routed experts' rows, in the file right after the metadata buffers,
went to one past the end of the metadata window, and prompt routes were lost on one DP rank)."""

from __future__ import annotations

import ctypes

import torch

from pdserve.disagg.transfer.window import Window, forget_files, memfd_allocator


def test_a_file_that_starts_where_another_ends_is_its_own():
    w = Window.__new__(Window)  # the translation alone, over spans laid out back to back
    w.spans = [(0x1000, 0x9000, 0x100), (0x1100, 0x5000, 0x40)]
    assert w.translate(0x1100) == 0x5000  # the second file's first byte, not the first's end
    assert w.translate(0x10FF) == 0x90FF
    assert w.translate(0x1000) == 0x9000
    assert w.translate(0x1140) == 0x5040  # one past the last file's end still has its window
    assert w.regions([(0x1000, 0x100), (0x1100, 0x40), (0x1200, 0)]) == [
        (0x9000, 0x100),
        (0x5000, 0x40),
    ]


def test_bytes_written_through_the_window_land_in_each_buffer():
    bufs = [memfd_allocator(n, torch.device("cpu")) for n in (4096, 100, 8192)]
    regions = [(b.data_ptr(), b.numel()) for b in bufs]
    w = Window("test", regions)
    try:
        for i, (ptr, n) in enumerate(regions):
            ctypes.memset(w.translate(ptr), 17 + i, n)  # what a prefill's write does
        for i, b in enumerate(bufs):
            assert bool((b == 17 + i).all()), i
    finally:
        w.release()
        forget_files(regions)
