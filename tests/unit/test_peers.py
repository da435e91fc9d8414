"""``--migration-peers`` and the URLs a migration names (pdserve/peers.py): what parses, what
matches, and the schema patterns /openapi.json publishes for them."""

from __future__ import annotations

import re

import pytest

from pdserve.config import ServerArgs
from pdserve.peers import MigrationPeers, check_host, parse_target


@pytest.mark.parametrize(
    "text, url",
    [
        ("127.0.0.1:8000", "http://127.0.0.1:8000"),
        (" http://127.0.0.1:8000/ ", "http://127.0.0.1:8000"),
        ("HTTPS://Decode-1.Example:443", "https://decode-1.example:443"),
        ("http://[::1]:80", "http://[::1]:80"),
        ("decode-0", "http://decode-0:80"),
        ("https://d", "https://d:443"),
    ],
)
def test_a_server_url_parses(text, url):
    assert parse_target(text).url == url


@pytest.mark.parametrize(
    "text, why",
    [
        ("", "is empty"),
        ("\ud8ff\udca4\u00ddf", "characters a URL cannot have"),
        ("b\u00fccher.example:1", "xn-- form"),
        ("http://[::1", "not a URL"),
        ("h:99999", "Port out of range"),
        ("h:0", "port 0"),
        ("http://u:p@h:1", "no user name"),
        ("http://h:1/admin", "no path"),
        ("http://h:1?x", "no path"),
        ("ftp://h:1", "scheme"),
        ("999.1.1.1:5", "not a host name"),
        ("a..b:5", "not a host name"),
        ("[1.2.3.4]:5", "not a URL"),
        ("http://:80", "no host"),
        ("-a:1", "not a host name"),
    ],
)
def test_what_is_no_server_url_says_why(text, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        parse_target(text)


def test_entries_match_hosts_ports_and_networks_without_resolving_names():
    peers = MigrationPeers("127.0.0.1, localhost:9000, 10.0.0.0/8, [::1]:5, fd00::/8")
    allowed = ["127.0.0.1:1", "http://localhost:9000", "10.1.2.3:4", "[::1]:5", "[fd00::7]:1"]
    refused = ["localhost:9001", "127.0.0.2:1", "[::1]:6", "11.0.0.1:1", "decode:1"]
    assert all(peers.allows(parse_target(t)) for t in allowed)
    assert not any(peers.allows(parse_target(t)) for t in refused)
    # a name is not its address: no DNS look-up decides what a decode connects to
    assert not MigrationPeers("127.0.0.1").allows(parse_target("localhost:1"))
    # a moved request's source: any port of a listed host
    assert peers.allows_host("localhost") and peers.allows_host(check_host("::1"))
    assert not peers.allows_host("127.0.0.2")


def test_none_by_default_and_star_for_any():
    none = MigrationPeers(None)
    assert not none and not none.allows(parse_target("127.0.0.1:1"))
    assert "--migration-peers (none)" in none.refusal("target", "http://127.0.0.1:1")
    assert MigrationPeers("*").allows(parse_target("203.0.113.9:1"))
    assert any(
        "--migration-peers *" in w for w in ServerArgs("m", migration_peers="*").exposure_warnings()
    )


@pytest.mark.parametrize("spec", ["a/b", "10.0.0.0/33", "http://h:1/x", "h:99999", "b\u00fcch"])
def test_a_bad_entry_is_a_start_up_error(spec):
    with pytest.raises(ValueError, match="migration_peers"):
        ServerArgs("m", migration_peers=spec)


def test_the_published_patterns_match_what_the_checks_allow():
    """Exact for host entries; a network is published as any address of its family (a pattern
    cannot state a prefix), and the check refuses the rest with 403."""
    peers = MigrationPeers("127.0.0.1, localhost:9000, [::1]:5")
    target = re.compile(peers.target_schema()["pattern"])
    for text in ["127.0.0.1:8", "http://localhost:9000/", "https://[::1]:5"]:
        assert target.match(text) and peers.allows(parse_target(text)), text
    for text in ["localhost:9001", "127.0.0.2:1", "[::1]:6", "evil.example:80"]:
        assert not target.match(text), text
    host = re.compile(peers.host_schema()["pattern"])
    assert host.match("127.0.0.1") and host.match("::1") and not host.match("127.0.0.2")
    assert MigrationPeers(None).target_schema()["not"] == {}
    network = re.compile(MigrationPeers("10.0.0.0/8").target_schema()["pattern"])
    assert network.match("10.1.1.1:80") and network.match("11.1.1.1:80")
