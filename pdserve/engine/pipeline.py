"""Pipeline-parallel forward (``--pp-size P``): every stage holds a contiguous range of layers
(``models/weights.stage_layers``) and the KV of those layers only.

All stages run the same scheduler on the same inputs, so each calls ``ModelRunner.forward`` with
the same batch. The batch is cut into micro-batches along its flattened tokens (a request's
tokens may straddle a cut: the later part is an extend over the earlier one, whose KV the stage
has just written), and each stage streams them: it computes micro-batch k while the next stage
computes k - 1, the hidden states and the residual stream travelling by point-to-point sends
between the stages' peer ranks. The last stage computes the logits of every micro-batch and
broadcasts them, so that every stage samples the same tokens (the samplers are replicas).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdserve.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from pdserve.engine.model_runner import ModelRunner

# A micro-batch smaller than this many tokens costs more in per-layer overhead than it gains in
# overlap: batches below 2 * this run as P micro-batches (one per stage) at most.
MIN_MICRO_BATCH_TOKENS = 128


def num_micro_batches(num_tokens: int, pp_size: int) -> int:
    """P micro-batches for small batches (decode steps), up to 4 P for long prompts (the
    pipeline's fill and drain then cost 1/(4 P) of the time instead of (P-1)/P)."""
    return max(
        1, min(num_tokens, max(pp_size, min(4 * pp_size, num_tokens // MIN_MICRO_BATCH_TOKENS)))
    )


def split(parts: tuple, n: int) -> list[tuple[tuple, int]]:
    """Cut a batch (the lists ``ModelRunner.make_forward_batch`` takes) into ``n`` batches of
    about equal token counts; returns (lists, first flattened token) per micro-batch."""
    input_ids, positions, prefix_lens, extend_lens, page_lists, logits_idx, full_lens = parts
    total = len(input_ids)
    bounds = [round(total * k / n) for k in range(n + 1)]
    starts, acc = [], 0
    for e in extend_lens:
        starts.append(acc)
        acc += e
    out = []
    for lo, hi in zip(bounds, bounds[1:]):
        if hi <= lo:
            continue
        pre, ext, pages, fulls = [], [], [], []
        for i, (s, e) in enumerate(zip(starts, extend_lens)):
            a, b = max(lo, s), min(hi, s + e)
            if a < b:
                pre.append(prefix_lens[i] + a - s)
                ext.append(b - a)
                pages.append(page_lists[i])
                fulls.append(None if full_lens is None else full_lens[i])
        rows = [r - lo for r in logits_idx if lo <= r < hi]
        fulls = None if full_lens is None else fulls
        out.append(((input_ids[lo:hi], positions[lo:hi], pre, ext, pages, rows, fulls), lo))
    return out


def _send(t: torch.Tensor, dst: int, group) -> "object":
    import torch.distributed as dist

    wire = t.contiguous().view(torch.uint8)  # bytes: gloo has no bf16 point-to-point
    return dist.isend(wire, dst, group=group), wire


def _recv(shape: tuple, dtype: torch.dtype, src: int, group) -> torch.Tensor:
    import torch.distributed as dist

    buf = torch.empty(shape, dtype=dtype)
    wire = buf.view(torch.uint8)
    dist.recv(wire, src, group=group)
    return buf


def pipeline_forward(runner: "ModelRunner", fb: ForwardBatch) -> torch.Tensor:
    import torch.distributed as dist

    par, model = runner.par, runner.model
    group = par.world.cpu_group
    hidden = model.hidden_size
    assert fb.parts is not None
    logits_idx = fb.parts[5]
    assert logits_idx == sorted(logits_idx), "logits rows must be in token order"
    pending = []  # sends in flight (with their buffers)
    logits = []
    # the residual stream's dtype: the model's, or float32 (Mamba's residual_in_fp32)
    residual_dtype = getattr(model, "residual_dtype", None) or runner.dtype
    for parts, _ in split(fb.parts, num_micro_batches(len(fb.parts[0]), par.pp_size)):
        *lists, full_lens = parts
        mb = runner.make_forward_batch(*lists, full_lens=full_lens)
        runner.attn_backend.init_forward(mb)
        t = len(parts[0])
        if par.is_first_stage:
            h, residual = model.embed(mb.input_ids), None
        else:
            prev = par.stage_rank(par.pp_rank - 1)
            h = _recv((t, hidden), runner.dtype, prev, group)
            residual = _recv((t, hidden), residual_dtype, prev, group)
        h, residual = model.forward_layers(mb, h, residual)
        if not par.is_last_stage:
            nxt = par.stage_rank(par.pp_rank + 1)
            pending += [_send(h, nxt, group), _send(residual, nxt, group)]
        elif mb.logits_idx.numel():
            out = model.final_norm(h, residual)
            logits.append(model.compute_logits(out[mb.logits_idx]))
    for work, _ in pending:
        work.wait()
    n = len(logits_idx)
    out = torch.cat(logits) if logits else torch.empty((n, runner.vocab_size), dtype=torch.float32)
    if n:
        dist.broadcast(out, src=par.stage_rank(par.pp_size - 1), group=group)
    return out
