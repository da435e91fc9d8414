"""When does a request stop: EOS / stop token ids, stop strings, max_new_tokens, context."""

from __future__ import annotations

import json
import os
from typing import Optional

from pdserve.engine.request import FinishKind, FinishReason, Req


def eos_token_ids(hf_config, tokenizer, model_path: str) -> set[int]:
    """EOS ids from the model config, generation_config.json and the tokenizer."""
    ids: set[int] = set()

    def add(v) -> None:
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(x for x in v if isinstance(x, int))

    add(getattr(hf_config, "eos_token_id", None))
    gen = os.path.join(model_path, "generation_config.json")
    if os.path.exists(gen):
        with open(gen) as f:
            add(json.load(f).get("eos_token_id"))
    if tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None))
    return ids


def check_finish(
    req: Req, eos_ids: set[int], tokenizer, context_length: int
) -> Optional[FinishReason]:
    """Called after each new output token."""
    sp = req.sampling
    tok = req.output_ids[-1]
    n = len(req.output_ids)
    if n > sp.min_new_tokens:
        if not sp.ignore_eos and tok in eos_ids:
            return FinishReason(FinishKind.STOP, matched=tok)
        if sp.stop_token_ids and tok in sp.stop_token_ids:
            return FinishReason(FinishKind.STOP, matched=tok)
        if sp.stop and tokenizer is not None:
            matched = _match_stop_string(req, tokenizer)
            if matched is not None:
                return FinishReason(FinishKind.STOP, matched=matched)
    if n >= sp.max_new_tokens or req.seq_len >= context_length:
        return FinishReason(FinishKind.LENGTH, matched=n)
    return None


def _match_stop_string(req: Req, tokenizer) -> Optional[str]:
    # A stop string of s characters ending at the newest token spans at most s tokens (plus
    # a few for tokens that carry partial UTF-8 bytes).
    longest = max(len(s) for s in req.sampling.stop)
    tail = req.output_ids[-(longest + 3) :]
    prev = tail[:-1]
    text = tokenizer.decode(tail, skip_special_tokens=req.sampling.skip_special_tokens)
    prev_text = (
        tokenizer.decode(prev, skip_special_tokens=req.sampling.skip_special_tokens) if prev else ""
    )
    for s in req.sampling.stop:
        # only occurrences that end in the newest token count (earlier ones were checked before)
        if s in text and (s not in prev_text or text.count(s) > prev_text.count(s)):
            return s
    return None
