"""Load-balancing policies: a base class and a registry.

The router keeps one policy instance per role (prefill, decode or colocated worker), so prefill
and decode are chosen separately, each among that role's available workers.
"""

from __future__ import annotations

import itertools
import random
from typing import Sequence

from pdserve.router.workers import Worker


class Policy:
    """Chooses one worker from ``candidates`` (never empty, all available, in configured order).

    Runs on the router's event loop only; implementations may keep state without locks.
    """

    name = ""
    needs_load = False  # True: the router polls GET /get_load for this policy

    def select(self, candidates: Sequence[Worker]) -> Worker:
        raise NotImplementedError


_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    _REGISTRY[cls.name] = cls
    return cls


def make_policy(name: str) -> Policy:
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ValueError(f"policy: unknown policy {name!r}, choose from {', '.join(_REGISTRY)}") from None


@register
class RandomPolicy(Policy):
    name = "random"

    def select(self, candidates: Sequence[Worker]) -> Worker:
        return random.choice(candidates)


@register
class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self):
        self._counter = itertools.count()

    def select(self, candidates: Sequence[Worker]) -> Worker:
        return candidates[next(self._counter) % len(candidates)]


@register
class LeastLoadPolicy(Policy):
    """Fewest requests (polled from the worker plus sent since the poll), then fewest tokens;
    ties are broken at random so idle workers share the load."""

    name = "least_load"
    needs_load = True

    def select(self, candidates: Sequence[Worker]) -> Worker:
        loads = [w.load_estimate() for w in candidates]
        best = min(loads)
        return random.choice([w for w, load in zip(candidates, loads, strict=True) if load == best])
