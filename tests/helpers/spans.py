"""The keys an attention query sees besides causality, as the kernels take their ``window``
argument (``AttnLayer.span``): W > 0 the last W positions, -C the query's own chunk of C
positions (HF's chunked mask: key and query in the same chunk), 0 every earlier key."""

from __future__ import annotations


def first_visible_key(pos: int, window: int) -> int:
    if window > 0:
        return max(0, pos - window + 1)
    if window < 0:
        return pos // -window * -window
    return 0
