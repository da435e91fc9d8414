"""The PD end-to-end check once per KV transfer backend: a 1P1D cluster behind our router whose
prefill and decode use ``--disaggregation-transfer-backend`` local, mooncake or nixl; mixed-length
requests (streaming and not, some with logprobs) must equal the offline engine, the KV must have
moved through the backend (prompts of 300 tokens or more layer by layer during the forward,
``--enable-disagg-layer-pipeline``, shorter ones by chunk), and every page and metadata slot must
be free afterwards.

A backend whose library is not installed is skipped with the reason.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.disagg.transfer import get_backend
from tests.e2e.test_pd import COMMON, assert_same, generate, mixed_prompts
from tests.helpers import cluster as c

BACKENDS = ["local", "mooncake", "nixl"]


@pytest.fixture(scope="module", params=BACKENDS)
def pd_cluster(request, tmp_path_factory, tiny_llama_path):
    backend = request.param
    try:
        get_backend(backend)
    except ValueError as e:
        pytest.skip(str(e))
    logs = tmp_path_factory.mktemp(f"pd-{backend}")
    args = [
        "--page-size",
        "16",
        "--chunked-prefill-size",
        "256",
        "--disaggregation-transfer-backend",
        backend,
        *COMMON,
    ]
    # prompts of 300 tokens or more go layer by layer (one layer per write), shorter ones by chunk
    layers = ["--enable-disagg-layer-pipeline", "--disagg-layer-group-size", "1"]
    layers += ["--disagg-layer-pipeline-min-prefill-len", "300"]
    P, _ = c.prefill(f"P-{backend}", tiny_llama_path, logs, *args, *layers)
    D = c.decode(f"D-{backend}", tiny_llama_path, logs, *args)
    procs = [P, D]
    try:
        c.start_all((P, D))
        R = c.router(f"R-{backend}", [P], [D], logs)
        procs.append(R)
        R.start()
        yield {"backend": backend, "prefill": P, "decode": D, "router": R}
    finally:
        c.stop_all(reversed(procs))
    # a backend library must not crash the servers as they exit (NIXL does with ibverbs-providers)
    codes = {proc.name: proc.proc.returncode for proc in (P, D)}
    assert codes == {P.name: 0, D.name: 0}, (codes, P.log_tail(20), D.log_tail(20))


def test_mixed_requests_match_offline_engine(pd_cluster, reference):
    P, D, R = pd_cluster["prefill"], pd_cluster["decode"], pd_cluster["router"]
    for proc in (P, D):
        assert (
            proc.http.get("/server_info").json()["disaggregation_transfer_backend"]
            == pd_cluster["backend"]
        )
    prompts = mixed_prompts(40, seed=11, max_len=900)
    jobs = [
        (ids, i % 2 == 0, i % 5 == 0) for i, ids in enumerate(prompts)
    ]  # (ids, stream, logprobs)
    with ThreadPoolExecutor(8) as ex:
        outs = list(ex.map(lambda j: generate(R.url, *j), jobs))
    for (ids, _, logprobs), out in zip(jobs, outs):
        assert_same(out, reference(ids, logprobs), logprobs)
    # the KV really went through the backend: prefill recorded the bytes of each transfer
    transfers = P.http.get("/server_info").json()["internal_states"][0].get("recent_transfers")
    if transfers is not None:
        assert sum(t["kv_bytes"] for t in transfers) > 0, transfers
        # long prompts went layer by layer during their forwards, short ones after
        groups = [t["layer_groups"] for t in transfers]
        assert max(groups) > 0 and min(groups) == 0, groups
    for proc in (P, D):
        pools = proc.wait_idle()
        assert pools["metadata_slots_free"] == pools["metadata_slots_total"], (proc.name, pools)


def test_nixl_completion_notice_completes_rooms_without_status(
    tmp_path, tiny_llama_path, reference
):
    """With NIXL the room's last write carries a completion notification; decode marks the room
    done from it. Prefill here never sends its Success status (fault ``drop_status`` on every
    room), so requests can only complete through the notification."""
    try:
        get_backend("nixl")
    except ValueError as e:
        pytest.skip(str(e))
    args = ["--page-size", "16", "--disaggregation-transfer-backend", "nixl", *COMMON]
    P, _ = c.prefill(
        "P-nixl-notify",
        tiny_llama_path,
        tmp_path,
        *args,
        "--disaggregation-fault-mode",
        "drop_status",
        "--disaggregation-fault-prob",
        "1",
    )
    D = c.decode("D-nixl-notify", tiny_llama_path, tmp_path, *args)
    R = c.router("R-nixl-notify", [P], [D], tmp_path)
    try:
        c.start_all((P, D))
        R.start()
        for ids in mixed_prompts(6, seed=11, max_len=300):
            assert_same(generate(R.url, ids, stream=False), reference(ids))
        assert "Success status not sent" in P.log_tail(400)
        D.wait_idle()
        P.wait_idle()
    finally:
        c.stop_all((R, D, P))
