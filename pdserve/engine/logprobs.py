"""Log-probabilities reported to users (output tokens and prompt tokens).

All values are the log-softmax of the model's raw logits in float32, before any sampling
penalty or temperature, as SGLang reports them by default. Top-k lists are
``[(logprob, token_id), ...]`` sorted by logprob, descending.
"""

from __future__ import annotations

from typing import Optional

import torch

TopList = list[tuple[float, int]]


def _logsumexp(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits, dim=-1, keepdim=True)


def token_logprobs(logits: torch.Tensor, target_ids: torch.Tensor) -> list[float]:
    """log_softmax(logits[i])[target_ids[i]] for each row i; logits [N, V], target_ids [N]."""
    if logits.shape[0] == 0:
        return []
    logits = logits.float()
    target_ids = target_ids.to(device=logits.device, dtype=torch.long)
    picked = logits.gather(1, target_ids.view(-1, 1))
    return (picked - _logsumexp(logits)).view(-1).tolist()


def top_logprobs(logits: torch.Tensor, k: int) -> list[TopList]:
    """The ``k`` most likely tokens of each row of ``logits`` [N, V] with their logprobs."""
    n = logits.shape[0]
    if n == 0 or k <= 0:
        return [[] for _ in range(n)]
    logits = logits.float()
    # log_softmax is monotone, so the top-k of the logits are the top-k of the logprobs.
    vals, idx = logits.topk(min(k, logits.shape[-1]), dim=-1, sorted=True)
    vals = (vals - _logsumexp(logits)).tolist()
    idx = idx.tolist()
    return [list(zip(v, i)) for v, i in zip(vals, idx)]


def input_logprobs(
    logits: torch.Tensor, input_ids: list[int], start: int, top_k: int
) -> tuple[list[tuple[Optional[float], int]], list[Optional[TopList]]]:
    """Prompt-token logprobs for tokens ``start .. L-1`` of ``input_ids`` (L = len(input_ids)).

    The logits at prompt position p predict token p+1, so the caller passes the logits of
    prompt positions ``max(start - 1, 0) .. L - 2``, i.e. ``L - max(start, 1)`` rows (zero rows
    when L == 1). The last prompt position's logits (which predict the first output token) are
    not part of this.

    Returns ``(token_logprobs, top_logprobs)``, both with one entry per token ``start .. L-1``:
    ``token_logprobs[j] = (logprob, token_id)`` and ``top_logprobs[j]`` the ``top_k`` list
    (an empty list when ``top_k == 0``). Token 0 has no predecessor: when ``start == 0`` its
    entries are ``(None, input_ids[0])`` and ``None``.

    Chunked prefill: for a chunk covering prompt positions ``[a, b)`` (b <= L - 1) whose logits
    rows are all passed, ``input_logprobs(rows, input_ids[:b + 1], a + 1, k)`` gives tokens
    ``a+1 .. b``; the first chunk uses ``start`` itself so token 0 gets its ``None``.
    """
    num_tokens = len(input_ids)
    assert 0 <= start < num_tokens, (start, num_tokens)
    first_row_pos = max(start - 1, 0)
    assert logits.shape[0] == num_tokens - 1 - first_row_pos, (logits.shape, num_tokens, start)

    token_out: list[tuple[Optional[float], int]] = []
    top_out: list[Optional[TopList]] = []
    if start == 0:
        token_out.append((None, input_ids[0]))
        top_out.append(None)
    targets = input_ids[first_row_pos + 1 :]
    if targets:
        target_t = torch.tensor(targets, dtype=torch.long, device=logits.device)
        token_out.extend(zip(token_logprobs(logits, target_t), targets))
        top_out.extend(top_logprobs(logits, top_k))
    return token_out, top_out
