"""Cache policies: how the KV cache manager treats the group of each cache kind.

A group's spec (``kv_spec``) says what a layer keeps; its policy says how a request's share of
the group lives in ``KVCacheManager``, so the manager holds no kind checks:

- ``FullAttentionPolicy``: one page per ``page_size`` tokens, every page kept; the prefix tree
  keeps the pages; in PD each chunk's full pages travel as soon as they are computed.
- ``WindowPolicy``: the same pages, but those the next query cannot see are freed as the sequence
  slides (``CacheSpec.first_live_page``); the tree keeps them with tombstones where a window
  dropped them; in PD they travel once, after the last chunk, from the window's first page.
- ``StatePolicy``: one slot per request (a recurrent state), taken when the request is admitted
  and freed when it ends, budgeted apart from pages; the state is final only after the last
  chunk, so it travels then. The tree keeps no states: a cached prefix is of no use to a model
  whose state at the prefix's end is not kept, so such a model computes every prompt whole.

A request's items of group g are ``KVSlots.pages[g]``: its page of each logical page for a paged
group, ``[slot]`` for a per-request group. ``POLICIES`` maps a spec's kind to its policy; a new
kind names its policy there, as it names its pool in ``kv_pool.POOLS``.
"""

from __future__ import annotations

from typing import ClassVar

from pdserve.kv_spec import CacheSpec


class CachePolicy:
    """The behaviour of one cache group of ``page_size``-token pages."""

    paged: ClassVar[bool] = True  # items are pages addressed by logical page; else one slot
    cacheable: ClassVar[bool] = True  # the prefix tree may keep its items
    drops_pages: ClassVar[bool] = False  # frees pages as the sequence slides
    sent_with_chunks: ClassVar[bool] = True  # PD: items are final after each chunk's forward

    def __init__(self, spec: CacheSpec, page_size: int):
        self.spec = spec
        self.page_size = page_size

    def pages(self, tokens: int) -> int:
        return (tokens + self.page_size - 1) // self.page_size

    def need(self, held: int, tokens: int) -> int:
        """Items to take so that a request holding ``held`` items (logical pages, dropped ones
        included) can hold ``tokens`` tokens."""
        return max(0, self.pages(tokens) - held)

    def live_from(self, kv_len: int) -> int:
        """The first logical page the next query of a sequence of ``kv_len`` tokens sees."""
        return 0

    def peak(self, seq_len: int, chunk: int) -> int:
        """Most items one sequence of ``seq_len`` tokens holds at once, prefilled in chunks of
        ``chunk`` tokens."""
        return self.spec.peak_pages(seq_len, chunk, self.page_size)

    def owned(self, items: list[int], cached: int) -> list[int]:
        """The items a request owns (not the prefix tree's) of its ``items``, the first ``cached``
        logical pages being the tree's."""
        return [p for p in items[cached:] if p]

    def transfer_start(self, prompt_len: int, decode_prefix: int) -> int:
        """PD: the first item (logical page) prefill sends for a prompt of ``prompt_len`` tokens
        when decode already holds ``decode_prefix`` pages of it."""
        return decode_prefix

    def transfer_count(self, prompt_len: int, decode_prefix: int) -> int:
        """PD: items prefill sends (and decode preallocates) for that prompt."""
        return self.pages(prompt_len) - self.transfer_start(prompt_len, decode_prefix)


class FullAttentionPolicy(CachePolicy):
    """Every page of the sequence kept (full attention, a latent, an indexer's keys)."""


class WindowPolicy(CachePolicy):
    """Pages only while the next query can see them (a sliding window)."""

    drops_pages: ClassVar[bool] = True
    sent_with_chunks: ClassVar[bool] = False  # the window still drops pages until the last chunk

    def live_from(self, kv_len: int) -> int:
        return self.spec.first_live_page(kv_len, self.page_size)

    def transfer_start(self, prompt_len: int, decode_prefix: int) -> int:
        return max(decode_prefix, self.live_from(prompt_len))


class StatePolicy(CachePolicy):
    """One slot per request, whatever its length (a recurrent state)."""

    paged: ClassVar[bool] = False
    cacheable: ClassVar[bool] = False
    sent_with_chunks: ClassVar[bool] = False  # the state changes with every chunk

    def need(self, held: int, tokens: int) -> int:
        return 0 if held else 1

    def peak(self, seq_len: int, chunk: int) -> int:
        return 1

    def owned(self, items: list[int], cached: int) -> list[int]:
        return [p for p in items if p]  # a prefix hit never covers the state: it is the request's

    def transfer_start(self, prompt_len: int, decode_prefix: int) -> int:
        return 0

    def transfer_count(self, prompt_len: int, decode_prefix: int) -> int:
        return 1


# cache kind (kv_spec.CacheSpec.kind) -> its policy in the manager
POLICIES: dict[str, type[CachePolicy]] = {
    "full_attention": FullAttentionPolicy,
    "latent_attention": FullAttentionPolicy,
    "index_keys": FullAttentionPolicy,
    "sliding_window": WindowPolicy,
    "recurrent_state": StatePolicy,
}


def policy_for(spec: CacheSpec, page_size: int) -> CachePolicy:
    cls = POLICIES.get(spec.kind)
    if cls is None:
        raise ValueError(
            f"cache kind {spec.kind!r} has no policy in the KV cache manager "
            f"(policies: {', '.join(sorted(POLICIES))})"
        )
    return cls(spec, page_size)
