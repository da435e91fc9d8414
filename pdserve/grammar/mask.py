"""Applying grammar bitmasks to logits (int32 words, bit t % 32 of word t // 32 = token t)."""

from __future__ import annotations

import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


def allocate(rows: int, vocab_size: int) -> torch.Tensor:
    """A bitmask of ``rows`` rows, all tokens allowed."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [rows, vocab_size]: which tokens each row allows."""
    bits = (bitmask.unsqueeze(-1) >> _SHIFTS) & 1  # [rows, words, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: ``logits[rows[i]]`` of the disallowed tokens of ``bitmask[i]`` become -inf."""
    ok = allowed(bitmask, logits.shape[1]).to(logits.device)
    sub = logits.index_select(0, rows)
    logits.index_copy_(0, rows, sub.masked_fill_(~ok, float("-inf")))
