"""Load-balancing policies: a base class and a registry.

The router keeps one policy instance per role (prefill, decode or colocated worker), so prefill
and decode are chosen separately, each among that role's available workers.
"""

from __future__ import annotations

import itertools
import random
from typing import TYPE_CHECKING, Optional, Sequence

from pdserve.router.workers import Worker

if TYPE_CHECKING:
    from pdserve.router.kv_index import KVIndex, PromptBlocks


class Policy:
    """Chooses one worker from ``candidates`` (never empty, all available, in configured order).

    Runs on the router's event loop only; implementations may keep state without locks.
    """

    name = ""
    needs_load = False  # True: the router polls GET /get_load for this policy
    needs_index = False  # True: the router follows the workers' KV events (router/kv_index.py)

    def select(
        self, candidates: Sequence[Worker], prompt: Optional["PromptBlocks"] = None
    ) -> Worker:
        """``prompt``: the request's prompt blocks when the router knows them (policies that
        weigh caches need them; the others ignore them)."""
        raise NotImplementedError


_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    _REGISTRY[cls.name] = cls
    return cls


def make_policy(name: str, index: Optional["KVIndex"] = None, balance: float = 1.0) -> Policy:
    if name not in _REGISTRY:
        raise ValueError(f"policy: unknown policy {name!r}, choose from {', '.join(_REGISTRY)}")
    if name == CacheAwarePolicy.name:
        if index is None:
            raise ValueError("policy: cache_aware needs the router's KV index")
        return CacheAwarePolicy(index, balance)
    return _REGISTRY[name]()


@register
class RandomPolicy(Policy):
    name = "random"

    def select(self, candidates: Sequence[Worker], prompt=None) -> Worker:
        return random.choice(candidates)


@register
class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self):
        self._counter = itertools.count()

    def select(self, candidates: Sequence[Worker], prompt=None) -> Worker:
        return candidates[next(self._counter) % len(candidates)]


@register
class LeastLoadPolicy(Policy):
    """Fewest requests (polled from the worker plus sent since the poll), then fewest tokens;
    ties are broken at random so idle workers share the load."""

    name = "least_load"
    needs_load = True

    def select(self, candidates: Sequence[Worker], prompt=None) -> Worker:
        loads = [w.load_estimate() for w in candidates]
        best = min(loads)
        return random.choice([w for w, load in zip(candidates, loads, strict=True) if load == best])


@register
class CacheAwarePolicy(Policy):
    """The worker that would start this prompt soonest, by what its cache holds and its load.

    A worker's cost is the prompt tokens it would have to compute (those past the longest
    prefix its KV index holds; a prefix held in a tier below its pool is spared only in part,
    ``--cache-aware-host-weight`` / ``--cache-aware-storage-weight`` of each token) plus ``balance``
    times the tokens it already has in hand (polled ``num_tokens``, plus this prompt's length for
    each request sent to it since the poll). The cheapest wins, ties by fewer requests then at
    random. When no worker holds any of the prompt (or the prompt is not known) this is
    ``least_load``. ``balance`` 0 follows the cache alone; larger values spread load sooner (a
    worker holding the prompt is passed over once its load exceeds another's by more than
    matched/balance tokens).
    """

    name = "cache_aware"
    needs_load = True
    needs_index = True

    def __init__(self, index: "KVIndex", balance: float = 1.0):
        self.index = index
        self.balance = balance
        self.fallback = LeastLoadPolicy()
        self.last: dict = {}  # the last choice's inputs, for tests and logs

    def select(self, candidates: Sequence[Worker], prompt=None) -> Worker:
        matched = [self.index.weighted_tokens(w, prompt) for w in candidates]
        if prompt is None or not any(matched):
            self.last = {"matched": matched, "fallback": "least_load"}
            return self.fallback.select(candidates)
        length = len(prompt.ids)
        costs = []
        for w, m in zip(candidates, matched, strict=True):
            reqs, tokens = w.load_estimate()
            costs.append(
                ((length - m) + self.balance * (tokens + w.sent_since_poll() * length), reqs)
            )
        best = min(costs)
        self.last = {"matched": matched, "costs": [c for c, _ in costs]}
        return random.choice([w for w, c in zip(candidates, costs, strict=True) if c == best])

    def choose_group(self, worker: Worker, prompt) -> int:
        """``worker``'s DP group for ``prompt`` (``--dp-aware``): the same cost over its groups
        (their polled loads), the usual least-loaded choice when no group holds any of it."""
        matched = self.index.group_weighted(worker, prompt) if prompt is not None else {}
        if not any(matched.values()):
            return worker.choose_dp_rank()
        length = len(prompt.ids)

        def cost(g: int) -> tuple[float, int]:
            reqs, tokens = worker.group_load(g)
            return (length - matched.get(g, 0)) + self.balance * tokens, reqs

        return min(range(worker.dp_size or 1), key=cost)
