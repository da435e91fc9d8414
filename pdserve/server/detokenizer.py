"""Incremental detokenization: output token ids in, text deltas out.

Invariants (tested in tests/unit/test_detokenizer.py):
- the concatenation of all deltas is the final text;
- the final text is ``tokenizer.decode(ids)``, cut before the matched stop string (unless
  ``trim_stop`` is off);
- a delta never ends inside a UTF-8 character: text ending in U+FFFD is held back until a later
  token completes the character (or the request finishes);
- a delta never contains a stop string, nor a tail that may become one: text that is a prefix
  of a stop string is held back until it is resolved. The scheduler enforces stop strings, but
  the tokens that form one may already have been sent, so the trim happens here.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        *,
        skip_special_tokens: bool = True,
        stop: Optional[Sequence[str]] = None,
        trim_stop: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.trim_stop = trim_stop
        self.ids: list[int] = []
        # ids[:_read] are decoded into ``decoded``, which ends on a character boundary;
        # ids[_surr:_read] is the context window re-decoded with the next tokens, so that
        # tokenizers whose pieces depend on their left neighbour (SentencePiece) decode right.
        self._surr = 0
        self._read = 0
        self.decoded = ""
        self.text = ""  # what has been handed out: always a prefix of the final text

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _advance(self, final: bool) -> None:
        if self._read == len(self.ids):
            return
        prefix = self._decode(self.ids[self._surr : self._read])
        full = self._decode(self.ids[self._surr :])
        if not final and (len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR)):
            return  # nothing new yet, or a character still incomplete
        self.decoded += full[len(prefix) :]
        self._surr, self._read = self._read, len(self.ids)

    def _safe_end(self) -> int:
        """End of the text that can be handed out without risking a stop string in it."""
        end = len(self.decoded)
        start = len(self.text)
        for s in self.stop:
            idx = self.decoded.find(s, max(0, start - len(s) + 1))
            if idx != -1:
                end = min(end, idx)
            # the longest tail of ``decoded`` that is a proper prefix of ``s``
            for k in range(min(len(s) - 1, len(self.decoded) - start), 0, -1):
                if self.decoded.endswith(s[:k]):
                    end = min(end, len(self.decoded) - k)
                    break
        return max(end, start)

    def _emit(self, end: int) -> str:
        delta = self.decoded[len(self.text) : end]
        self.text += delta
        return delta

    def push(self, new_ids: Sequence[int]) -> str:
        """Add tokens; returns the new text that is safe to hand out (may be empty)."""
        self.ids.extend(new_ids)
        self._advance(final=False)
        return self._emit(self._safe_end())

    def finish(self, matched_stop: Optional[Any] = None) -> str:
        """Flush everything held back; ``matched_stop`` is the finish reason's ``matched``.

        When it is a stop string, the text is cut before its first occurrence.
        """
        self._advance(final=True)
        end = len(self.decoded)
        if isinstance(matched_stop, str) and matched_stop and self.trim_stop:
            idx = self.decoded.find(matched_stop)
            if idx != -1:
                end = max(idx, len(self.text))
        return self._emit(end)
