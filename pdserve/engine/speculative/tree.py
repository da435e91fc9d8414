"""The arithmetic of a speculative row's drafts, chain or tree: a tree's drafts each have a parent
in the row (``Req.draft_parents``; the row's token is the root, row index 0), so a draft sits at
the position of its depth and sees its ancestors only. A chain is the tree whose every draft's
parent is the one before it."""

from __future__ import annotations

from typing import Optional

import torch

from pdserve.engine.request import Req
from pdserve.forward_batch import TreeMask


def accept(
    drafts: list[int], targets: list[int], parents: Optional[list[int]] = None
) -> tuple[list[int], list[int]]:
    """The tokens a row yields and the rows of its accepted drafts: from the row's token, the
    child equal to the draw at the current token while there is one, then the draw there
    (``targets``: one draw per row token; ``parents``: a tree's, None for a chain)."""
    if parents is None:
        n = 0
        while n < len(drafts) and drafts[n] == targets[n]:
            n += 1
        return drafts[:n] + [targets[n]], list(range(1, n + 1))
    children: dict[int, dict[int, int]] = {}
    for j, (token, parent) in enumerate(zip(drafts, parents)):
        children.setdefault(parent, {})[token] = j + 1
    path, at = [], 0
    while targets[at] in children.get(at, {}):
        at = children[at][targets[at]]
        path.append(at)
    return [drafts[j - 1] for j in path] + [targets[at]], path


def depths(parents: list[int]) -> list[int]:
    """Each draft's depth in its tree (a child of the row's token: 1)."""
    depth = [0]
    for parent in parents:
        depth.append(depth[parent] + 1)
    return depth[1:]


def lineage(parents: list[int], row: int) -> list[int]:
    """The rows from the root to ``row`` (both included) of a tree's row."""
    out = [row]
    while row:
        row = parents[row - 1]
        out.append(row)
    return out[::-1]


def drafts_before(req: Req, j: int) -> list[int]:
    """The drafts between the request's output and its row's token ``j`` (its ancestors)."""
    if req.draft_parents is None:
        return req.drafts[:j]
    return [req.drafts[a - 1] for a in lineage(req.draft_parents, j)[1:]]


def tree_layout(req: Req, ext: int) -> tuple[list[int], TreeMask]:
    """A tree row's token positions (the row's token at ``kv_len``, each draft at its depth past
    it) and its mask (each token sees its ancestors and itself)."""
    at = [req.kv_len] + [req.kv_len + d for d in depths(req.draft_parents)]
    sees = [lineage(req.draft_parents, j) for j in range(ext)]
    return at, tree_mask(req.kv_len, sees, at)


def tree_mask(base: int, sees: list[list[int]], key_positions: list[int]) -> TreeMask:
    """The mask of a row whose token t sees the slots ``base + s`` for s in ``sees[t]`` (and the
    sequence before ``base``); ``key_positions``: the positions of the slots from ``base``."""
    visible = torch.zeros((len(sees), len(key_positions)), dtype=torch.bool)
    for t, slots in enumerate(sees):
        visible[t, slots] = True
    return TreeMask(base, visible, torch.tensor(key_positions, dtype=torch.long))
