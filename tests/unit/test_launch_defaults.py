"""``pdserve launch``'s defaults for the host it runs on (``server/cluster.py``)."""

from __future__ import annotations

import pytest

from pdserve.server import cluster


@pytest.mark.parametrize(
    "cores,ranks,threads",
    [
        (2, 2, 1),  # 1P1D on 2 cores: one thread each (measured best; oversubscribing was slower)
        (1, 2, 1),
        (4, 2, 2),
        (16, 2, 8),
        (2, 3, 1),
        (8, 4, 2),
    ],
)
def test_default_threads(cores, ranks, threads):
    assert cluster.default_threads(cores, ranks) == threads


def test_conditional_policy_flags_reach_the_router():
    args, extra = cluster.parse_args(
        [
            "--pd-policy",
            "conditional",
            "--pd-local-max-tokens",
            "2048",
            "--pd-itl-weight",
            "0.5",
            "--max-total-tokens",
            "4096",
        ]
    )
    assert cluster.router_pd_flags(args) == [
        "--pd-local-max-tokens",
        "2048",
        "--pd-itl-weight",
        "0.5",
    ]
    assert extra == ["--max-total-tokens", "4096"]  # the servers' flags stay theirs
    assert cluster.router_pd_flags(cluster.parse_args([])[0]) == []
