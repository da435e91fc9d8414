"""Role switching below HTTP: the front end's checks, the weights digest, and schedulers in one
process that swap prefill and decode (real local backend), refuse while busy and go back to
their old role when the new one cannot be built."""

from __future__ import annotations

import copy
import random
import socket
import time
from types import SimpleNamespace

import msgspec
import pytest
import torch

from pdserve.config import ServerArgs
from pdserve.disagg.setup import apply_role_rules, attach_disaggregation, switch_role
from pdserve.engine.request import FinishKind, Req, SamplingParams
from pdserve.models.loader import weights_digest
from pdserve.server.errors import APIError
from pdserve.server.messages import AbortReq, decode_to_scheduler, encode
from pdserve.server.role_switch import RoleSwitch, SwitchRoleRequest
from tests.helpers.checkpoints import build_tiny_checkpoint
from tests.helpers.cluster import free_port

torch.set_num_threads(1)


def test_abort_req_carries_its_status_and_old_messages_decode():
    back = decode_to_scheduler(encode(AbortReq(rid="r", message="switching", status_code=503)))
    assert (back.rid, back.message, back.status_code) == ("r", "switching", 503)
    old = decode_to_scheduler(msgspec.msgpack.encode({"type": "abort", "rid": "r"}))
    assert old.status_code == 499


def switcher(**kw) -> RoleSwitch:
    args = ServerArgs(model_path="/nowhere", **kw)
    return RoleSwitch(SimpleNamespace(server_args=args, states={}), warm_up=None)


@pytest.mark.parametrize(
    "start, body, status, needle",
    [
        ({}, {"role": "worker"}, 400, "role: must be one of"),
        ({"disaggregation_mode": "decode"}, {"role": "null"}, None, ""),  # the flag's spelling
        ({}, {"role": "decode", "migrate_to": ["x y"]}, 400, "migrate_to: 'x y' is not a host"),
        ({}, {"role": "decode", "migrate_to": ["10.0.0.1:1"]}, 403, "--migration-peers (none)"),
        ({}, {"role": "prefill", "bootstrap_port": 70000}, 400, "bootstrap_port: must be in"),
        ({}, {"role": "decode", "drain_timeout": -1.0}, 400, "drain_timeout"),
        ({}, {"role": "decode", "drain_timeout": float("inf")}, 400, "drain_timeout"),
        ({}, {"role": "decode", "bootstrap_port": 9000}, 400, "only a prefill"),
        ({"pp_size": 2}, {"role": "decode"}, 400, "pp_size"),  # decode holds every layer
        (
            {"nnodes": 2, "tp_size": 2, "dist_init_addr": "127.0.0.1:5000"},
            {"role": "prefill"},
            400,
            "nnodes",
        ),  # multi-host
    ],
)
def test_checks(start, body, status, needle):
    s = switcher(**start)
    req = msgspec.convert(body, SwitchRoleRequest)
    if status is None:
        assert s.check(req)[0] == "null"
        return
    with pytest.raises(APIError) as e:
        s.check(req)
    assert e.value.status == status and needle in e.value.message, e.value.message


@pytest.mark.parametrize(
    "start, body, unchanged",
    [
        ({}, {"role": "colocated"}, True),
        ({"disaggregation_mode": "decode"}, {"role": "decode", "migrate_to": ["10.0.0.1:1"]}, True),
        ({"disaggregation_mode": "prefill"}, {"role": "prefill"}, True),
        ({"disaggregation_mode": "prefill"}, {"role": "prefill", "bootstrap_port": 8998}, True),
        # a prefill given another port is re-wired on it
        (
            {"disaggregation_mode": "prefill"},
            {"role": "prefill", "bootstrap_port": free_port()},
            False,
        ),
    ],
)
def test_the_role_a_server_has_is_no_switch(start, body, unchanged):
    """Idempotent: the role (and port) a server has is answered without a switch, once its
    other fields pass their checks (``migrate_to`` among the peers)."""
    s = switcher(migration_peers="10.0.0.1", **start)
    req = msgspec.convert(body, SwitchRoleRequest)
    mode, port = s.check(req)
    assert s._unchanged(mode, port) is unchanged
    s.broken = "the last switch's warm-up failed"
    assert not s._unchanged(mode, port)  # a broken server is re-wired, even to its role


def test_checks_port_and_switch_in_progress():
    s = switcher(disaggregation_mode="decode")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(APIError) as e:
            s.check(SwitchRoleRequest(role="prefill", bootstrap_port=port))
        assert e.value.status == 409 and "not free" in e.value.message
    assert s.check(SwitchRoleRequest(role="prefill", bootstrap_port=port)) == ("prefill", port)
    s.current = {"from": "decode", "to": "prefill", "since": 0.0}
    with pytest.raises(APIError) as e:
        s.check(SwitchRoleRequest(role="colocated"))
    assert e.value.status == 409 and "in progress" in e.value.message
    with pytest.raises(APIError) as e:  # and the other routes are refused, naming the switch
        s.refuse_if_switching()
    assert e.value.status == 503 and "switching its role from decode to prefill" in e.value.message


def test_weights_digest_sees_a_reload_and_packed_weights():
    class Packed:
        def __init__(self, w):
            self.packed = w.t().contiguous()

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    model[0].impl = Packed(model[0].weight)
    d = weights_digest(model)
    assert (
        d == weights_digest(model) and d["tensors"] == 5
    )  # weight, bias, packed, norm weight and bias
    model[0].impl = Packed(model[0].weight)  # packed again: a new buffer
    assert weights_digest(model)["digest"] != d["digest"]


def test_weights_digest_takes_onednn_packed_weights():
    # a bf16 model's PackedBF16 holds oneDNN's opaque prepacked weight (no storage, no data pointer)
    from pdserve.kernels import onednn_bf16
    from pdserve.layers.linear import PackedBF16

    usable, why = onednn_bf16()
    if not usable:  # e.g. an AVX2-only CPU: torch refuses to prepack bf16 weights there
        pytest.skip(why)

    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    model[0].impl = PackedBF16(model[0].weight, None, None)
    assert model[0].impl.onednn.is_mkldnn
    d = weights_digest(model)
    assert d == weights_digest(model) and d["tensors"] == 3  # weight, bias, oneDNN's packed weight
    model[0].impl = PackedBF16(model[0].weight, None, None)  # packed again: a new object
    assert weights_digest(model)["digest"] != d["digest"]


def test_role_rules_restore_the_users_cache_flag():
    args = ServerArgs(model_path="/nowhere", disaggregation_mode="decode")
    apply_role_rules(args, False)
    assert args.disable_radix_cache  # decode without --disaggregation-decode-enable-radix-cache
    args.disaggregation_mode = "prefill"
    apply_role_rules(args, False)
    assert not args.disable_radix_cache


def make(mode: str, bport: int, backend: str = "local"):
    args = ServerArgs(
        model_path=build_tiny_checkpoint("llama"),
        max_total_tokens=4096,
        page_size=16,
        chunked_prefill_size=64,
        torch_num_threads=1,
        disaggregation_mode=mode,
        disaggregation_transfer_backend=backend,
        disaggregation_waiting_timeout=3,
        disaggregation_bootstrap_timeout=3,
        disaggregation_bootstrap_port=bport,
    )
    started = copy.copy(args)
    return attach_disaggregation(args), started


def req(rid: str, ids: list[int], room: int, port: int) -> Req:
    return Req(
        rid=rid,
        input_ids=list(ids),
        bootstrap_host="127.0.0.1",
        bootstrap_port=port,
        bootstrap_room=room,
        sampling=SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True),
    )


def transfer(P, D, bport: int, prompts: list[list[int]], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    pairs = []
    for i, ids in enumerate(prompts):
        room = rng.randrange(2**63)
        rp, rd = req(f"p{seed}-{i}", ids, room, bport), req(f"d{seed}-{i}", ids, room, bport)
        P.add_request(rp)
        D.add_request(rd)
        pairs.append((rp, rd))
    deadline = (
        time.monotonic() + 60
    )  # by time, not steps: a connection set up under load takes a while
    while not all(rp.finished and rd.finished for rp, rd in pairs) and time.monotonic() < deadline:
        P.step()
        D.step()
    assert all(
        rd.finish_reason is not None and rd.finish_reason.kind == FinishKind.LENGTH
        for _, rd in pairs
    ), [rd.finish_reason for _, rd in pairs]
    return [rd.output_ids for _, rd in pairs]


def kv_mappings() -> tuple[int, int]:
    """(mappings of decode buffers: shared segments or memfd files, those among them whose file is
    gone): a local segment still mapped after its file was removed is memory not given back."""
    with open("/proc/self/maps") as f:
        lines = [line for line in f if "pdserve-kv" in line]
    return len(lines), sum("(deleted)" in line and "memfd:" not in line for line in lines)


@pytest.mark.parametrize("backend", ["local", "mooncake", "nixl"])
def test_schedulers_swap_roles_in_place(backend):
    X, sx = make("prefill", free_port(), backend)
    Y, sy = make("decode", free_port(), backend)
    par = X.par
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (1, 17, 64, 200)]
    before = transfer(X, Y, sx.disaggregation_bootstrap_port, prompts, seed=1)
    weights = {id(s): weights_digest(s.runner.model) for s in (X, Y)}
    pages = [p.num_pages for p in Y.runner.pools]
    mapped = kv_mappings()[0]

    # busy: a request waits on Y (its prefill never comes), so Y refuses and keeps serving
    lonely = req("lonely", [5, 6, 7], room=4242, port=sx.disaggregation_bootstrap_port)
    Y.add_request(lonely)
    out = switch_role(Y, sy, "prefill", free_port(), par)
    assert "request(s) in the PD queues" in out["busy"] and Y.args.disaggregation_mode == "decode"
    Y.abort("lonely")
    for _ in range(2000):
        if not Y.has_work:
            break
        Y.step()
        X.step()

    # swap: Y becomes a prefill, X a decode; the KV of a transfer goes the other way now
    ybport = free_port()
    assert "reconfigure_s" in switch_role(Y, sy, "prefill", ybport, par)
    assert "reconfigure_s" in switch_role(X, sx, "decode", sx.disaggregation_bootstrap_port, par)
    assert (
        X.args.disable_radix_cache and not Y.args.disable_radix_cache
    )  # decode's rule follows the role
    assert [p.num_pages for p in X.runner.pools] == pages
    now, unlinked = kv_mappings()
    assert (
        unlinked == 0 and now <= mapped
    )  # Y's old pool, metadata (and windows) went with its decode role
    assert {id(s): weights_digest(s.runner.model) for s in (X, Y)} == weights
    after = transfer(Y, X, ybport, prompts, seed=2)
    assert after == before
    for s in (X, Y):
        info = s.check_integrity()
        assert (
            info["in_use_pages"] == 0
            and info["metadata_slots_free"] == info["metadata_slots_total"]
        )

    # a role that cannot be built (its bootstrap port is taken) leaves the old one in place
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match="keeps its role 'decode'"):
            switch_role(X, sx, "prefill", port, par)
    assert X.args.disaggregation_mode == "decode" and X.pd is not None
    assert transfer(Y, X, ybport, prompts[:2], seed=3) == before[:2]
    for s in (X, Y):
        s.pd.close()
