"""Cache policies: how the KV cache manager treats the group of each cache kind.

A group's spec (``kv_spec``) says what a layer keeps; its policy says how a request's share of
the group lives in ``KVCacheManager``, so the manager holds no kind checks:

- ``FullAttentionPolicy``: one page per ``page_size`` tokens, every page kept; the prefix tree
  keeps the pages; in PD each chunk's full pages travel as soon as they are computed.
- ``WindowPolicy``: the same pages, but those the next query cannot see are freed as the sequence
  slides (``CacheSpec.first_live_page``); the tree keeps them with tombstones where a window
  dropped them; in PD they travel once, after the last chunk, from the window's first page.
- ``StatePolicy``: a slot per request (a recurrent state), taken when the request is admitted
  and freed when it ends, budgeted apart from pages; the state is final only after the last
  chunk, so it travels then. A cached prefix is of use to such a model only with the state at
  its end, so with the prefix cache on a request holds a second slot, its snapshot, which the
  mixers overwrite with the state at each page boundary the sequence crosses (``layers/
  state_snapshots.py``); when the request ends, its pages go into the tree with the snapshot on
  the last page, and a later prompt hits only up to a page that carries one (the tree's group
  for this kind holds a slot on such pages, 0 on the others).

- ``CompressedPolicy``: an entry per ``rate`` tokens (``CompressedEntries``), on the logical page
  where its window closes; a page of ``page_size >= rate`` tokens holds several, and below that
  only one logical page in ``rate / page_size`` has an item (0 on the others, by structure, not a
  tombstone). Every entry is kept; a page holds only closed windows, so a full page is final and
  travels with its chunk. The window still open lives in the compressor's state (a
  ``CompressorState`` group, ``StatePolicy``), whose snapshot at a page boundary lets a prefix
  hit end anywhere.

A request's items of group g are ``KVSlots.pages[g]``: its page of each logical page for a paged
group, ``[slot]`` for a per-request group. ``cache_kinds.KINDS`` maps a spec's kind to its
policy and its pool.
"""

from __future__ import annotations

from typing import ClassVar, Optional

from pdserve.kv_spec import CacheSpec


class CachePolicy:
    """The behaviour of one cache group of ``page_size``-token pages."""

    paged: ClassVar[bool] = True  # items are pages addressed by logical page; else one slot
    cacheable: ClassVar[bool] = True  # the prefix tree may keep its items
    drops_pages: ClassVar[bool] = False  # frees pages as the sequence slides
    sent_with_chunks: ClassVar[bool] = True  # PD: items are final after each chunk's forward

    def __init__(self, spec: CacheSpec, page_size: int, prefix_cache: bool = True):
        self.spec = spec
        self.page_size = page_size

    def pages(self, tokens: int) -> int:
        return (tokens + self.page_size - 1) // self.page_size

    def need(self, held: int, tokens: int) -> int:
        """Items to take so that a request holding ``held`` items (logical pages, dropped ones
        included) can hold ``tokens`` tokens."""
        return max(0, self.pages(tokens) - held)

    def extend(self, items: list[int], new: list[int], tokens: int) -> None:
        """Lay ``new`` (``need(len(items), tokens)`` items) out after ``items`` so that they cover
        ``tokens`` tokens."""
        items.extend(new)

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

    def sent(self, items: list[int], start: int, end: Optional[int]) -> list[int]:
        """PD: the items at ``start .. end`` that prefill sends."""
        return items[start:end]

    def insertable(self, full: int, kv_len: int, computed_from: int) -> int:
        """Of a request's ``full`` full pages, how many the prefix tree may take: all, but for a
        state, whose pages are of use only up to a snapshot, none without one (so every leaf of
        the tree ends on a snapshot and what KV events report stored can be hit)."""
        return full

    def tree_items(self, items: list[int], full: int, kv_len: int, computed_from: int) -> list[int]:
        """What the prefix tree takes of a request's ``items`` when its first ``full`` pages go
        in: one id per page (0: none). ``kv_len``: the tokens computed; ``computed_from``: where
        this server began computing them."""
        return items[:full]

    def released(self, items: list[int], kept: int, given: list[int]) -> list[int]:
        """The items a request frees when it ends, the tree having taken ``given``
        (``tree_items``) and its first ``kept`` logical pages being the tree's."""
        return self.owned(items, kept)

    def restore_from(self, found: list[int]) -> int:
        """The item a hit on ``found`` (the tree's ids of the matched pages) restores the
        request's own item from (0: none; only a state)."""
        return 0


class FullAttentionPolicy(CachePolicy):
    """Every page of the sequence kept (full attention, a latent, an indexer's keys)."""


class WindowPolicy(CachePolicy):
    """Pages only while the next query can see them (a sliding window, an attention chunk)."""

    drops_pages: ClassVar[bool] = True
    sent_with_chunks: ClassVar[bool] = False  # the window still drops pages until the last chunk

    def live_from(self, kv_len: int) -> int:
        return self.spec.first_live_page(kv_len, self.page_size)

    def transfer_start(self, prompt_len: int, decode_prefix: int) -> int:
        return max(decode_prefix, self.live_from(prompt_len))


class StatePolicy(CachePolicy):
    """A slot per request, whatever its length (a recurrent state), and with ``snapshots`` a
    second one: the state at the last page boundary the sequence crossed, which the prefix tree
    takes when the request ends."""

    paged: ClassVar[bool] = False
    sent_with_chunks: ClassVar[bool] = False  # the state changes with every chunk

    def __init__(self, spec: CacheSpec, page_size: int, prefix_cache: bool = True):
        super().__init__(spec, page_size, prefix_cache)
        self.snapshots = snapshots = prefix_cache
        self.cacheable = snapshots  # type: ignore[misc]
        self.per_request = 2 if snapshots else 1  # the live state (item 0), its snapshot (1)

    def need(self, held: int, tokens: int) -> int:
        return max(0, self.per_request - held)

    def peak(self, seq_len: int, chunk: int) -> int:
        return self.per_request

    def owned(self, items: list[int], cached: int) -> list[int]:
        return [p for p in items if p]  # a prefix hit never covers the state: it is the request's

    def transfer_start(self, prompt_len: int, decode_prefix: int) -> int:
        return 0

    def transfer_count(self, prompt_len: int, decode_prefix: int) -> int:
        return 1  # the live state; decode takes its own snapshot slot

    def sent(self, items: list[int], start: int, end: Optional[int]) -> list[int]:
        return items[:1][start:end]  # the live state, not the snapshot

    def _snapshot_valid(self, full: int, kv_len: int, computed_from: int) -> bool:
        """Whether the snapshot holds the state at the end of ``full`` pages: the last boundary
        the sequence crossed since this server began computing it."""
        return (
            self.snapshots
            and full > 0
            and kv_len // self.page_size == full
            and full * self.page_size > computed_from
        )

    def insertable(self, full: int, kv_len: int, computed_from: int) -> int:
        return full if self._snapshot_valid(full, kv_len, computed_from) else 0

    def tree_items(self, items: list[int], full: int, kv_len: int, computed_from: int) -> list[int]:
        out = [0] * full
        if self._snapshot_valid(full, kv_len, computed_from) and len(items) > 1:
            out[-1] = items[1]
        return out

    def released(self, items: list[int], kept: int, given: list[int]) -> list[int]:
        taken = {p for p in given if p}
        return [p for p in items if p and p not in taken]

    def restore_from(self, found: list[int]) -> int:
        return found[-1] if found else 0


class CompressedPolicy(CachePolicy):
    """Entries of closed windows (``kv_spec.CompressedEntries``), on the logical pages where the
    windows close."""

    def __init__(self, spec: CacheSpec, page_size: int, prefix_cache: bool = True):
        super().__init__(spec, page_size, prefix_cache)
        spec.check_page_size(page_size)

    def need(self, held: int, tokens: int) -> int:
        return self.spec.items_between(held, self.pages(tokens), self.page_size)

    def extend(self, items: list[int], new: list[int], tokens: int) -> None:
        it = iter(new)
        for page in range(len(items), self.pages(tokens)):
            items.append(next(it) if self.spec.holds_item(page, self.page_size) else 0)
        assert next(it, None) is None, "compressed entries: more items than pages that hold one"
