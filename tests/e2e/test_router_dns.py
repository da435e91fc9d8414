"""Discovery through DNS, for real: dnsmasq serves the records (tests/helpers/elastic.py), the
router resolves ``--prefill-dns``/``--decode-dns`` names through it; under load, an address
added to a name becomes a worker that takes streams, an address taken out of it is drained
(its streams finish, none fails), and a DNS server that stops answering changes nothing."""

from __future__ import annotations

import sys
import time

import pytest

from tests.helpers import cluster as c
from tests.helpers.elastic import (
    DECODE_HOSTS,
    PREFILL_HOSTS,
    DNSServer,
    StreamLoad,
    dnsmasq_available,
    worker_state,
)

INTERVAL_S = 0.5
pytestmark = pytest.mark.skipif(
    not dnsmasq_available(),
    reason="dnsmasq is not installed (scripts/install.sh --test installs Debian's package as root)",
)


@pytest.fixture(scope="module")
def dns(tmp_path_factory):
    server = DNSServer(tmp_path_factory.mktemp("dns")).start()
    yield server
    server.stop()


def test_workers_follow_their_dns_records(elastic_servers, dns):
    s = elastic_servers
    (p0, p1), (d0, d1) = s.prefills, s.decodes
    records = {"prefill.pd.test": [PREFILL_HOSTS[0]], "decode.pd.test": [DECODE_HOSTS[0]]}
    dns.set(records)
    port = c.free_port()
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "router",
        "--port",
        str(port),
        "--prefill-dns",
        f"prefill.pd.test:{s.http_port[0]}:{s.bootstrap_port}",
        "--decode-dns",
        f"decode.pd.test:{s.http_port[1]}",
        "--dns-server",
        dns.address,
        "--dns-interval",
        str(INTERVAL_S),
        "--policy",
        "round_robin",
    ]
    router = c.Proc(
        "DR", cmd, port, s.logs
    ).start()  # ready: the names' servers were found and added
    load = None
    try:
        body = router.http.get("/workers").json()
        assert sorted(w["url"] for w in body["workers"]) == [p0.url, d0.url]
        assert {w["source"] for w in body["workers"]} == {
            "dns prefill.pd.test",
            "dns decode.pd.test",
        }
        load = StreamLoad(router.url)
        c.wait_for(lambda: len(load.results) >= 3, 60, "streams through the DNS-found pair")

        records["decode.pd.test"] = list(DECODE_HOSTS)  # scale decode out
        dns.set(records)
        c.wait_for(
            lambda: (worker_state(router, d1.url) or {}).get("requests", 0) >= 3,
            60,
            "the new decode address to take streams",
        )
        c.wait_for(
            lambda: worker_state(router, d0.url)["in_flight"] > 0, 30, "a stream on decode 0"
        )
        records["decode.pd.test"] = [DECODE_HOSTS[1]]  # decode 0's record disappears
        dns.set(records)
        c.wait_for(
            lambda: worker_state(router, d0.url) is None, 60, "decode 0 to be drained and removed"
        )

        records["prefill.pd.test"] = list(PREFILL_HOSTS)
        dns.set(records)
        c.wait_for(lambda: worker_state(router, p1.url) is not None, 30, "prefill 1 to be added")
        c.wait_for(lambda: worker_state(router, p0.url)["in_flight"] > 0, 30, "a room on prefill 0")
        records["prefill.pd.test"] = [PREFILL_HOSTS[1]]
        dns.set(records)
        c.wait_for(
            lambda: worker_state(router, p0.url) is None, 60, "prefill 0 to be drained and removed"
        )
        after = time.monotonic()
        c.wait_for(
            lambda: len(load.done_after(after)) >= 3, 60, "streams through prefill 1 and decode 1"
        )
        results = load.close()
        load = None
        assert not [r for r in results if r[1] != 200 or r[3] is not None], results[:3]
        assert len({text for _, _, text, _ in results}) == 1

        # the DNS server goes away: no answer is no news, the workers stay
        dns.stop()
        time.sleep(6 * INTERVAL_S)
        assert sorted(w["url"] for w in router.http.get("/workers").json()["workers"]) == [
            p1.url,
            d1.url,
        ]
        assert router.http.get("/health").status_code == 200
    finally:
        if load is not None:
            load.close()
        router.stop()
    for proc in (*s.prefills, *s.decodes):
        proc.wait_idle()
