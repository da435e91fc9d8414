"""One scheduler step's plan: what the forward computes for each request and what is read back.

A step runs as plan -> forward -> draw (sample / verify) -> commit. ``StepPlan.build`` turns the
batch the scheduler formed ((request, tokens to compute) pairs) into the forward's inputs and
says per row what its logits are for:
- ``EXTEND``: a prompt chunk that does not reach the prompt's end; nothing is drawn;
- ``SAMPLE``: the row ends at the sequence's end; one token is drawn from its last position;
- ``VERIFY``: a speculative decode row (the request's token and its drafts); a token is drawn at
  each position and the drafts are checked against them (``speculative/verify.py``).
Any row may also read input logprobs of the prompt tokens it covers (``LogprobSpan``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from pdserve.engine import images
from pdserve.engine.request import Req
from pdserve.engine.speculative.tree import tree_layout
from pdserve.forward_batch import TreeMask

EXTEND, SAMPLE, VERIFY = "extend", "sample", "verify"


@dataclass
class Row:
    req: Req
    start: int  # the request's ``kv_len`` when planned: the slot of the row's first token
    ext: int  # tokens the forward computes for it (a verify row: its token and its drafts)
    kind: str  # EXTEND, SAMPLE or VERIFY
    logits_at: int = -1  # SAMPLE / VERIFY: the row's first index in the forward's logits

    @property
    def end(self) -> int:
        return self.start + self.ext


@dataclass
class LogprobSpan:
    """Input logprobs a row reads: logits ``at`` .. ``at + len(targets)`` predict ``targets``."""

    req: Req
    at: int
    targets: list[int]


@dataclass
class StepPlan:
    rows: list[Row] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    logits_rows: list[int] = field(default_factory=list)  # token indices whose logits are read
    spans: list[LogprobSpan] = field(default_factory=list)
    trees: dict[int, TreeMask] = field(default_factory=dict)  # row index -> a tree row's mask
    # rows covering image tokens: (request, first slot, tokens, first index in the forward)
    image_rows: list[tuple[Req, int, int, int]] = field(default_factory=list)
    # (first index in the forward, [3, n] positions) of rows whose three RoPE axes differ
    rope_rows: list[tuple[int, object]] = field(default_factory=list)

    @classmethod
    def build(cls, batch: list[tuple[Req, int]]) -> "StepPlan":
        plan = cls()
        for i, (req, ext) in enumerate(batch):
            plan._add(i, req, ext)
        return plan

    def _add(self, i: int, req: Req, ext: int) -> None:
        first, start = len(self.ids), req.kv_len
        tokens = req.all_ids[start : start + ext]
        self.ids.extend(tokens + req.drafts[: ext - len(tokens)])  # a decode row's drafts
        if req.draft_parents is not None and req.drafts:  # a tree: positions by depth
            positions, self.trees[i] = tree_layout(req, ext)
            self.positions.extend(positions)
        elif req.rope_positions is None and not req.rope_delta:
            self.positions.extend(range(start, start + ext))
        else:  # a prompt with images (engine/images.py)
            positions, three = images.positions(req, start, ext)
            self.positions.extend(positions)
            if three is not None:
                self.rope_rows.append((first, three))
                self.image_rows.append((req, start, ext, first))
        if req.return_logprob and not req.input_logprobs_done:
            # logits at position p predict prompt token p + 1
            lo = max(start, req.effective_logprob_start - 1)
            hi = min(start + ext, req.prompt_len - 1)
            if hi > lo:
                self.spans.append(
                    LogprobSpan(req, len(self.logits_rows), req.input_ids[lo + 1 : hi + 1])
                )
                self.logits_rows.extend(range(first + lo - start, first + hi - start))
        row = Row(req, start, ext, EXTEND)
        if req.drafts and start + 1 == req.seq_len and ext == 1 + len(req.drafts):
            row.kind, row.logits_at = VERIFY, len(self.logits_rows)
            self.logits_rows.extend(range(first, first + ext))
        elif start + ext == req.seq_len:
            row.kind, row.logits_at = SAMPLE, len(self.logits_rows)
            self.logits_rows.append(first + ext - 1)
        self.rows.append(row)

    def of_kind(self, kind: str) -> list[Row]:
        return [row for row in self.rows if row.kind == kind]

    @property
    def batch(self) -> list[tuple[Req, int]]:
        """(request, tokens computed) per row, in the forward's order."""
        return [(row.req, row.ext) for row in self.rows]

    @property
    def computed(self) -> list[tuple[Req, int, int]]:
        """(request, first position's slot, tokens) per row, in the forward's order."""
        return [(row.req, row.start, row.ext) for row in self.rows]

    def forward_batch(self, runner, dp_counts: Optional[list[int]] = None):
        fb = runner.make_forward_batch(
            self.ids,
            self.positions,
            [row.start for row in self.rows],
            [row.ext for row in self.rows],
            [row.req.kv.pages for row in self.rows],
            self.logits_rows,
            dp_counts,
            full_lens=[row.req.seq_len for row in self.rows],
            trees=self.trees,
        )
        if any(row.req.lora_slot >= 0 for row in self.rows):
            fb.adapters = [row.req.lora_slot for row in self.rows]
        if self.image_rows:
            fb.image_embeds = images.splice(self.image_rows, runner.model)
        if self.rope_rows:
            three = fb.positions.expand(3, -1).clone()
            for first, rows in self.rope_rows:
                three[:, first : first + rows.shape[1]] = rows
            fb.rope_positions = three
        return fb
