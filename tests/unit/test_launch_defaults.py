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


def test_each_decode_of_a_launch_lists_the_others_as_migration_peers():
    from pdserve.config import ServerArgs
    from pdserve.peers import MigrationPeers, parse_target
    from pdserve.server.cluster import migration_peer_flags

    ports = [30001, 30002, 30003]
    flags = migration_peer_flags("127.0.0.1", ports, 1, [])
    assert flags == ["--migration-peers", "127.0.0.1:30001,127.0.0.1:30003"]
    peers = MigrationPeers(flags[1])
    assert peers.allows(parse_target("http://127.0.0.1:30003"))
    assert not peers.allows(parse_target("http://127.0.0.1:30002"))  # itself
    assert migration_peer_flags("::1", ports, 0, [])[1] == "[::1]:30002,[::1]:30003"
    ServerArgs("m", migration_peers=migration_peer_flags("::1", ports, 0, [])[1])  # valid
    assert migration_peer_flags("127.0.0.1", [30001], 0, []) == []  # no other decode
    given = ["--migration-peers", "10.0.0.0/8"]
    assert migration_peer_flags("127.0.0.1", ports, 0, given) == []  # the user's list stands
