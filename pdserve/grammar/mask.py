"""Applying grammar bitmasks to logits (int32 words, bit t % 32 of word t // 32 = token t).

Float32 logits are masked as bits: each word is spread into 32 int32 lanes of all ones (allowed)
or zeros (disallowed), and the logits' bits are selected against those of -inf. That is a few
vectorized passes over the rows; ``masked_fill_`` with a bool mask, the obvious way, measured
several times slower on CPU (docs/benchmarks.md "Structured outputs").
"""

from __future__ import annotations

import torch

# bit k of a word, shifted left by 31 - k, is the sign bit; an arithmetic shift right by 31 then
# spreads it over the lane: -1 where token 32 * word + k is allowed, 0 where not
_TO_SIGN = 31 - torch.arange(32, dtype=torch.int32)
_NEG_INF_BITS = int(torch.tensor(float("-inf")).view(torch.int32))  # 0xff800000 as an int32


def allocate(rows: int, vocab_size: int) -> torch.Tensor:
    """A bitmask of ``rows`` rows, all tokens allowed."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def _lanes(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Int32 [rows, vocab_size]: -1 where the row allows the token, 0 where not."""
    lanes = bitmask.unsqueeze(-1) << _TO_SIGN.to(bitmask.device)  # [rows, words, 32]
    lanes >>= 31
    return lanes.view(bitmask.shape[0], -1)[:, :vocab_size]


def allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [rows, vocab_size]: which tokens each row allows."""
    return _lanes(bitmask, vocab_size).bool()


def _mask_rows(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: row i of ``logits`` takes the -inf of the tokens ``bitmask[i]`` disallows."""
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        logits.masked_fill_(~allowed(bitmask, logits.shape[1]), float("-inf"))
        return
    keep = _lanes(bitmask, logits.shape[1])
    # select(keep, x, -inf) = ((x ^ -inf) & keep) ^ -inf, bit for bit
    bits = logits.view(torch.int32)
    bits.bitwise_xor_(_NEG_INF_BITS).bitwise_and_(keep).bitwise_xor_(_NEG_INF_BITS)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: ``logits[rows[i]]`` of the disallowed tokens of ``bitmask[i]`` become -inf."""
    bitmask = bitmask.to(logits.device)
    n = rows.numel()
    if n == logits.shape[0] and torch.equal(rows, torch.arange(n, device=rows.device)):
        _mask_rows(logits, bitmask)  # every row, in order: no gather and scatter back
        return
    sub = logits.index_select(0, rows)
    _mask_rows(sub, bitmask)
    logits.index_copy_(0, rows, sub)
