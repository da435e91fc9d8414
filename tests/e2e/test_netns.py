"""PD across hosts: prefill in namespace A, decode in B, the router in C (tests/helpers/netns.py),
each server bound to its namespace's address, so the bootstrap look-up, the control plane and the
KV bytes all cross veth links and a bridge instead of loopback.

- Per network backend (``mooncake`` over TCP, ``nixl`` with UCX over TCP): greedy outputs equal
  the offline engine's token for token, the KV went through the backend, and every page, metadata
  slot and room is free afterwards on both sides.
- The ``local`` backend (shared memory) between two namespaces: the router does not pair the two
  (503 at once), and a client that pairs them itself is refused at registration; both errors name
  the backends to use.

Skips with the exact reason when namespaces cannot be created (not root, no iproute2) or a
backend library is missing.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.test_pd import assert_same, generate, mixed_prompts
from tests.helpers import localhttp
from tests.helpers import netns as nx


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_pd_across_namespaces_matches_offline_engine(netns_pd, backend, reference):
    pd = netns_pd(backend)
    P, D, R = pd["prefill"], pd["decode"], pd["router"]
    hosts = {P.host, D.host, R.host}
    assert len(hosts) == 3 and not any(h.startswith("127.") for h in hosts), hosts
    for proc in (P, D):
        assert proc.http.get("/server_info").json()["disaggregation_transfer_backend"] == backend
    prompts = mixed_prompts(8, seed=23, max_len=700)
    jobs = [
        (ids, i % 2 == 0, i % 4 == 1) for i, ids in enumerate(prompts)
    ]  # (ids, stream, logprobs)
    t0 = time.monotonic()
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda j: generate(R.url, *j), jobs))
    print(f"MEASURED {backend} across namespaces: 8 requests in {nx.since(t0):.2f}s")
    for (ids, _, logprobs), out in zip(jobs, outs):
        assert_same(out, reference(ids, logprobs), logprobs)
    transfers = P.http.get("/server_info").json()["internal_states"][0].get("recent_transfers")
    if transfers is not None:
        assert sum(t["kv_bytes"] for t in transfers) > 0, transfers
    for proc in (P, D):
        pools = proc.wait_idle()
        assert pools["metadata_slots_free"] == pools["metadata_slots_total"], (proc.name, pools)
        assert pools.get("kv_rooms", 0) == 0 and pools.get("kv_dst_claims", 0) == 0, (
            proc.name,
            pools,
        )


def test_local_backend_between_hosts_is_refused_by_the_router_and_at_registration(netns_pd):
    pd = netns_pd("local")
    P, D, R = pd["prefill"], pd["decode"], pd["router"]
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
    # the router knows both servers' backend and host (/server_info) and does not pair them
    r = localhttp.post(R.url + "/generate", timeout=60, json=body)
    msg = r.json()["error"]["message"]
    print(f"SAMPLE local backend across namespaces, router: HTTP {r.status_code}: {msg}")
    assert r.status_code == 503, r.text
    assert "different hosts" in msg and "mooncake" in msg and "nixl" in msg, msg
    # a client that pairs them itself: decode's registration is refused by prefill
    t0 = time.monotonic()
    room = {"bootstrap_host": P.host, "bootstrap_port": P.bootstrap_port, "bootstrap_room": 77}
    r = localhttp.post(D.url + "/generate", timeout=60, json={**body, **room})
    elapsed = nx.since(t0)
    msg = r.json()["error"]["message"]
    print(
        "SAMPLE local backend across namespaces, direct: "
        f"HTTP {r.status_code} after {elapsed:.2f}s: {msg}"
    )
    assert r.status_code == 502, r.text
    assert "rejected registration" in msg and "one host" in msg, msg
    assert "--disaggregation-transfer-backend mooncake" in msg and "nixl" in msg, msg
    assert elapsed < 10  # at registration, not at a timeout
    assert "rejected decode registration" in P.log_tail(200)
    for proc in (P, D):
        proc.wait_idle()
