"""Layer-wise transfer (``--enable-disagg-layer-pipeline``) on the local backend, in process: a
prefill that sends each group of layers' pages as the forward writes them gives decode the same
KV (decode's tokens and logprobs equal those behind a chunk-wise prefill, the same bytes moved),
its first write completes before the forward of a one-chunk prompt returns (a chunk-wise
prefill's after), short prompts keep the chunk-wise path, and an abort while the layers go out
leaves no write after its acknowledgement. A forward longer than decode's waiting timeout keeps
its room alive (keepalives between layers)."""

from __future__ import annotations

import random
import time

import pytest
import torch

from tests.helpers.cluster import free_port
from tests.unit.test_pd_queues import make, req, run_until

torch.set_num_threads(1)


def pair(decode_kw: dict | None = None, **prefill_kw):
    """A local prefill (``prefill_kw``) and decode (``decode_kw``), patient with each other
    unless told otherwise."""
    bport = free_port()
    patient = dict(disaggregation_bootstrap_timeout=20, disaggregation_waiting_timeout=20)
    P = make(
        "prefill",
        "local",
        disaggregation_bootstrap_port=bport,
        chunked_prefill_size=256,
        max_total_tokens=8192,
        **(patient | prefill_kw),
    )
    D = make("decode", "local", max_total_tokens=8192, **(patient | (decode_kw or {})))
    return P, D, bport


def close(*schedulers) -> None:
    for s in schedulers:
        s.pd.mgr.close()
        if getattr(s.pd, "bootstrap_server", None) is not None:
            s.pd.bootstrap_server.shutdown()


def timed_forwards(scheduler, wait_for_a_write: bool = False) -> list[float]:
    """Wall times at which the prefill's forwards returned; each layer made to take 30 ms more
    (a model whose layers take long enough for a write to finish during the next ones). With
    ``wait_for_a_write``, the first forward's last layer also waits (up to 5 s) for a KV write
    to complete, as a slow model would: a layer-wise prefill's write completes during that wait,
    a chunk-wise prefill has none under way (it sends after the forward), so the order the test
    reads does not depend on how fast a loaded host schedules the transfer thread."""
    role, layers = scheduler.pd.mgr.role, list(scheduler.runner.model.model.own_layers)
    ends, forward = [], scheduler.runner.forward

    def slow(*_):
        time.sleep(0.03)

    def last(*_):
        slow()
        deadline = time.monotonic() + 5
        while wait_for_a_write and not ends and time.monotonic() < deadline:
            with role.mgr.lock:
                if any(w[2] is not None for w in role._written.values()):
                    return
            time.sleep(0.005)

    for layer in layers:
        layer.register_forward_hook(last if layer is layers[-1] else slow)

    def timed(fb):
        out = forward(fb)
        ends.append(time.time())
        return out

    scheduler.runner.forward = timed
    return ends


def serve(P, D, bport, prompts, seed=0):
    rng = random.Random(seed)
    pairs = []
    for i, ids in enumerate(prompts):
        room = rng.randrange(2**63)
        rp, rd = req(f"p{i}", ids, room, port=bport), req(f"d{i}", ids, room, port=bport)
        P.add_request(rp)
        D.add_request(rd)
        pairs.append((rp, rd))
    run_until(lambda: all(rp.finished and rd.finished for rp, rd in pairs), P, D)
    return pairs


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    # one prompt of one chunk, one of three chunks (the layer pipeline in every chunk), a short one
    return [[rng.randrange(100, 40000) for _ in range(n)] for n in (200, 700, 40)]


def test_layer_wise_transfer_gives_decode_the_same_kv(prompts):
    out = {}
    for mode in ("chunks", "layers"):
        kw = {}
        if mode == "layers":
            kw = dict(
                enable_disagg_layer_pipeline=True,
                disagg_layer_group_size=1,
                disagg_layer_pipeline_min_prefill_len=100,
            )
        P, D, bport = pair(**kw)
        try:
            ends = timed_forwards(P, wait_for_a_write=mode == "layers")
            # the one-chunk prompt first and alone, so that the first forward is its (on a loaded
            # host the others could bootstrap first: CI saw its first write 40 ms after the first
            # forward, another prompt's)
            pairs = serve(P, D, bport, prompts[:1]) + serve(P, D, bport, prompts[1:], seed=1)
            transfers = {t["rid"]: t for t in P.pd.recent_transfers}
            out[mode] = (
                [(rd.output_ids, [v for v, _ in rd.output_token_logprobs]) for _, rd in pairs],
                [transfers[rp.rid]["kv_bytes"] for rp, _ in pairs],
                [rp.timeline["kv_first_write"] for rp, _ in pairs],
                ends,
            )
            for s in (P, D):
                info = s.check_integrity()
                assert info["in_use_pages"] == 0
                assert info["metadata_slots_free"] == info["metadata_slots_total"]
        finally:
            close(P, D)
    tokens, nbytes, first, ends = out["layers"]
    # logprobs up to the float32 order of decode batches that formed at other times
    for (ids, lps), (ref_ids, ref_lps) in zip(tokens, out["chunks"][0]):
        assert ids == ref_ids
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4
    assert nbytes == out["chunks"][1]  # the same bytes (in other batches of descriptors)
    # the one-chunk prompt ran alone in the first forward: layer-wise, its first write completed
    # before that forward returned; chunk-wise, after
    assert first[0] < ends[0], (first[0], ends[0])
    assert out["chunks"][2][0] > out["chunks"][3][0]


def test_an_abort_while_layers_go_out_leaves_no_late_write(prompts):
    """The room fails during the forward, right after its first layer group was queued (the
    transfer worker is made to wait before each write): that write, under way, completes; the
    later groups and the rest are never written; decode hears of the failure only after the
    write completed (the notice follows the room's earlier jobs), so nothing lands in pages it
    freed; both sides end with everything free."""
    P, D, bport = pair(
        enable_disagg_layer_pipeline=True,
        disagg_layer_group_size=1,
        disagg_layer_pipeline_min_prefill_len=0,
        disaggregation_fault_prob=1.0,
        disaggregation_fault_mode="delay_transfer",
        disaggregation_fault_delay=0.3,
    )
    try:
        role = P.pd.mgr.role
        writes, count = [], role.count_written

        def counting(room, descriptors, nbytes):
            writes.append(time.time())
            count(room, descriptors, nbytes)

        role.count_written = counting
        hook = P.pd.layer_hook

        def aborting(batch):
            done = hook(batch)

            def layer_done(layer):
                done(layer)
                if layer == 0:  # once the worker holds the write (it waits before writing)
                    deadline = time.monotonic() + 5
                    while not any(role.workers._current) and time.monotonic() < deadline:
                        time.sleep(0.005)
                    time.sleep(0.05)
                    for r, _ in batch:
                        r.disagg.sender.abort("aborted by a test while its layers went out")

            return layer_done if done is not None else None

        P.pd.layer_hook = aborting
        room = random.Random(5).randrange(2**63)
        ids = prompts[0]
        rp, rd = req("pa", ids, room, port=bport), req("da", ids, room, port=bport)
        P.add_request(rp)
        D.add_request(rd)
        run_until(lambda: rp.finished and rd.finished, P, D)
        heard = time.time()
        time.sleep(1.0)  # a write still queued would have landed by now
        assert len(writes) == 1, writes  # the layer group under way; nothing after the abort
        assert writes[0] < heard
        assert "aborted by a test" in rd.finish_reason.message, rd.finish_reason
        for s in (P, D):
            run_until(lambda: s.check_integrity()["in_use_pages"] == 0, P, D)
            info = s.check_integrity()
            assert info["metadata_slots_free"] == info["metadata_slots_total"], info
    finally:
        close(P, D)


def test_a_forward_longer_than_decodes_waiting_timeout_keeps_the_room_alive(prompts):
    """Decode ends a room whose prefill stays silent for ``--disaggregation-waiting-timeout``;
    a prefill inside one long forward (here 1.6 s, against 1 s) is busy, not silent: it sends
    keepalives between layers, chunk-wise and layer-wise alike."""
    for layered in (False, True):
        quick = dict(disaggregation_waiting_timeout=1.0)
        P, D, bport = pair(
            decode_kw=quick,
            enable_disagg_layer_pipeline=layered,
            disagg_layer_pipeline_min_prefill_len=0,
            **quick,
        )
        try:
            for layer in P.runner.model.model.own_layers:
                layer.register_forward_hook(lambda *_: time.sleep(0.8))
            ((rp, rd),) = serve(P, D, bport, prompts[:1], seed=7)
            assert rd.finish_reason.kind.name == "LENGTH", (layered, rd.finish_reason)
            assert len(rd.output_ids) == 6
        finally:
            close(P, D)


def test_bad_settings_are_refused():
    from pdserve.config import ServerArgs

    with pytest.raises(ValueError, match="disagg_layer_group_size: must be at least 1"):
        ServerArgs(model_path="unused", disagg_layer_group_size=0)
    with pytest.raises(ValueError, match="disagg_layer_pipeline_min_prefill_len: must be >= 0"):
        ServerArgs(model_path="unused", disagg_layer_pipeline_min_prefill_len=-1)
