"""The PD queues inside the scheduler, without HTTP: state machine on the fake backend, and the
real local backend between two schedulers in one process."""

from __future__ import annotations

import random
import time

import pytest
import torch

from pdserve.config import ServerArgs
from pdserve.disagg.poll import KVPoll
from pdserve.disagg.setup import attach_disaggregation
from pdserve.engine.request import FinishKind, Req, SamplingParams
from pdserve.engine.scheduler import Scheduler
from tests.helpers.checkpoints import build_tiny_checkpoint
from tests.helpers.cluster import free_port

torch.set_num_threads(1)


def make(mode: str, backend: str, model: str | None = None, **kw) -> Scheduler:
    defaults = dict(
        max_total_tokens=4096,
        page_size=16,
        chunked_prefill_size=64,
        torch_num_threads=1,
        disaggregation_waiting_timeout=3,
        disaggregation_bootstrap_timeout=3,
    )
    args = ServerArgs(
        model_path=model or build_tiny_checkpoint("llama"),
        disaggregation_mode=mode,
        disaggregation_transfer_backend=backend,
        **(defaults | kw),
    )
    return attach_disaggregation(args)


def req(rid: str, ids: list[int], room: int, host: str = "127.0.0.1", port: int = 1, **sp) -> Req:
    return Req(
        rid=rid,
        input_ids=list(ids),
        return_logprob=True,
        bootstrap_host=host,
        bootstrap_port=port,
        bootstrap_room=room,
        sampling=SamplingParams(
            **{"temperature": 0, "max_new_tokens": 6, "ignore_eos": True, **sp}
        ),
    )


def run_until(cond, *schedulers, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        for s in schedulers:
            s.step()


def test_fake_backend_prefill_state_machine():
    P = make("prefill", "fake")
    r = req("a", range(100, 170), room=7)
    P.add_request(r)
    assert r in P.pd.bootstrap and r.sampling.max_new_tokens == 1
    # fake sender: WaitingForInput at once, so the first step moves it to prefill
    assert r.disagg.sender.poll() == KVPoll.WaitingForInput
    P.step()
    assert r not in P.pd.bootstrap
    run_until(lambda: r.finished, P)
    assert r.finish_reason.kind == FinishKind.LENGTH and len(r.output_ids) == 1
    info = P.check_integrity()
    assert info["in_use_pages"] == 0 and info["metadata_slots_free"] == info["metadata_slots_total"]


def test_fake_backend_decode_computes_locally():
    D = make("decode", "fake")
    r = req("b", range(200, 240), room=9)
    D.add_request(r)
    assert r in D.pd.prealloc
    run_until(lambda: r.finished, D)
    # nothing arrived (fake): the row's room does not match, so decode ran the prompt itself
    import pdserve

    ref = pdserve.Engine(
        model_path=build_tiny_checkpoint("llama"), torch_num_threads=1, max_total_tokens=4096
    )
    out = ref.generate(
        input_ids=list(range(200, 240)),
        sampling_params={"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
    )
    assert r.output_ids == out["output_ids"]
    info = D.check_integrity()
    assert info["in_use_pages"] == 0 and info["metadata_slots_free"] == info["metadata_slots_total"]


@pytest.fixture(scope="module")
def local_pair():
    bport = free_port()
    P = make("prefill", "local", disaggregation_bootstrap_port=bport)
    D = make("decode", "local")
    yield P, D, bport
    P.pd.mgr.close()
    D.pd.mgr.close()
    P.pd.bootstrap_server.shutdown()


def submit_pairs(
    P, D, bport: int, prompts: list[list[int]], rng: random.Random, tag: str = ""
) -> list:
    """One prefill and one decode request per prompt, sharing a random room;
    [(prefill's, decode's)]."""
    pairs = []
    for i, ids in enumerate(prompts):
        room = rng.randrange(2**63)
        rp, rd = req(f"{tag}p{i}", ids, room, port=bport), req(f"{tag}d{i}", ids, room, port=bport)
        P.add_request(rp)
        D.add_request(rd)
        pairs.append((rp, rd))
    return pairs


def test_local_backend_queues_and_metadata(local_pair):
    P, D, bport = local_pair
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (1, 16, 17, 63, 64, 65, 200)]
    pairs = submit_pairs(P, D, bport, prompts, rng)
    seen = set()

    def progress():
        for _, rd in pairs:
            if rd in D.pd.prealloc:
                seen.add("prealloc")
            if rd in D.pd.transfer:
                seen.add("transfer")
        for rp, _ in pairs:
            if rp in P.pd.inflight:
                seen.add("inflight")
        return all(rd.finished for _, rd in pairs)

    run_until(progress, P, D)
    assert {"prealloc", "transfer"} <= seen
    run_until(lambda: all(rp.finished for rp, _ in pairs), P, D)
    import pdserve

    ref = pdserve.Engine(
        model_path=build_tiny_checkpoint("llama"), torch_num_threads=1, max_total_tokens=8192
    )
    outs = ref.generate(
        input_ids=prompts,
        sampling_params={"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
        return_logprob=True,
    )
    for (rp, rd), out in zip(pairs, outs):
        assert rp.finish_reason.kind == FinishKind.LENGTH and rp.output_ids == out["output_ids"][:1]
        assert rd.output_ids == out["output_ids"]
        for (a, _), (b, _, _) in zip(
            rd.output_token_logprobs, out["meta_info"]["output_token_logprobs"]
        ):
            assert abs(a - b) < 1e-4
    for s in (P, D):
        info = s.check_integrity()
        assert (
            info["in_use_pages"] == 0
            and info["metadata_slots_free"] == info["metadata_slots_total"]
        )


def test_decode_batch_limit_holds_requests_whose_kv_arrived(local_pair):
    """--max-running-requests bounds decode's batch for PD requests too: a request whose KV has
    arrived waits in the transfer queue (GET /get_load: num_waiting_reqs) until a place frees."""
    P, D, bport = local_pair
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(5, 80))] for _ in range(5)]
    pairs = submit_pairs(P, D, bport, prompts, rng, tag="l")
    most, waited = 0, 0
    D.args.max_running_requests = 2
    try:

        def progress():
            nonlocal most, waited
            most, waited = max(most, len(D.running)), max(waited, D.pd.kv_ready)
            return all(rd.finished for _, rd in pairs)

        run_until(progress, P, D)
    finally:
        D.args.max_running_requests = ServerArgs.max_running_requests
    assert most == 2 and waited >= 1
    import pdserve

    ref = pdserve.Engine(
        model_path=build_tiny_checkpoint("llama"), torch_num_threads=1, max_total_tokens=8192
    )
    outs = ref.generate(
        input_ids=prompts,
        sampling_params={"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
    )
    assert [rd.output_ids for _, rd in pairs] == [o["output_ids"] for o in outs]
    run_until(lambda: all(rp.finished for rp, _ in pairs), P, D)
    for s in (P, D):
        info = s.check_integrity()
        assert (
            info["in_use_pages"] == 0
            and info["metadata_slots_free"] == info["metadata_slots_total"]
        )


def test_decode_times_out_a_room_whose_prefill_never_comes(local_pair):
    P, D, bport = local_pair
    rd = req("lonely", [5, 6, 7], room=12345, port=bport)
    D.add_request(rd)
    t0 = time.monotonic()
    run_until(lambda: rd.finished, D, P, timeout=20)
    assert rd.finish_reason.kind == FinishKind.ABORT
    assert "timed out" in rd.finish_reason.message
    assert time.monotonic() - t0 < 15
    run_until(lambda: not D.pd.has_work, D, P)
    info = D.check_integrity()
    assert info["in_use_pages"] == 0 and info["metadata_slots_free"] == info["metadata_slots_total"]


def test_the_queues_use_the_scheduler_only_through_its_port():
    """``disagg/prefill.py`` and ``disagg/decode.py`` name no member of the scheduler beyond
    ``SchedulerPort``'s, and the scheduler has every one of them."""
    import ast
    import inspect
    from pathlib import Path

    import pdserve
    from pdserve.engine.pd_queues import SchedulerPort

    allowed = {n for n in vars(SchedulerPort) if not n.startswith("_")}
    allowed |= set(SchedulerPort.__annotations__)
    root = Path(inspect.getfile(pdserve)).parent
    for name in ("disagg/prefill.py", "disagg/decode.py", "disagg/migration.py"):
        used = {
            node.attr
            for node in ast.walk(ast.parse((root / name).read_text()))
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "s"
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "self"
        }
        assert used and used <= allowed, (name, sorted(used - allowed))
    # its methods (the attributes are set per instance)
    missing = [n for n in allowed - set(SchedulerPort.__annotations__) if not hasattr(Scheduler, n)]
    assert not missing, missing


def test_the_proposers_use_the_scheduler_only_through_their_port():
    """Speculative proposers reach the scheduler through ``SpeculatorPort`` alone, and none of
    them writes a request's ``draft_len`` (the KV cache manager's, ``draft_computed``)."""
    import ast
    import inspect
    from pathlib import Path

    from pdserve.engine import speculative
    from pdserve.engine.speculative import SpeculatorPort

    allowed = set(SpeculatorPort.__annotations__)
    ported = 0
    for path in Path(inspect.getfile(speculative)).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "draft_len":
                assert not isinstance(node.ctx, ast.Store), (path.name, node.lineno)
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "port"
            ):
                assert node.attr in allowed, (path.name, node.lineno, node.attr)
                ported += 1
    assert ported >= 6  # the draft model's and the head's records of their KV
    assert all(hasattr(Scheduler, n) or n == "kv" for n in allowed)


def test_a_speculating_decode_gives_the_colocated_tokens(local_pair):
    """Decode with n-gram speculation behind a plain prefill: it speculates from its first step
    (the prompt's KV and first token came from prefill) and gives colocated greedy's tokens."""
    P, _, bport = local_pair
    D = make("decode", "local", speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    try:
        rng = random.Random(8)
        part = [rng.randrange(100, 40000) for _ in range(21)]
        prompts = [part * 3, part[:8] * 5, [rng.randrange(100, 40000) for _ in range(50)]]
        pairs = []
        for i, ids in enumerate(prompts):
            room = rng.randrange(2**63)
            rp = req(f"sp{i}", ids, room, port=bport)
            rd = req(f"sd{i}", ids, room, port=bport, max_new_tokens=30)
            P.add_request(rp)
            D.add_request(rd)
            pairs.append((rp, rd))
        run_until(lambda: all(rd.finished and rp.finished for rp, rd in pairs), P, D)
        import pdserve

        ref = pdserve.Engine(
            model_path=build_tiny_checkpoint("llama"), torch_num_threads=1, max_total_tokens=8192
        )
        outs = ref.generate(
            input_ids=prompts,
            sampling_params={"temperature": 0, "max_new_tokens": 30, "ignore_eos": True},
        )
        assert [rd.output_ids for _, rd in pairs] == [o["output_ids"] for o in outs]
        assert pairs[0][1].spec_accepted > 0 and D.stats["spec_verify_steps"] > 0
        for s in (P, D):
            info = s.check_integrity()
            assert info["in_use_pages"] == 0
            assert info["metadata_slots_free"] == info["metadata_slots_total"]
    finally:
        D.pd.mgr.close()


@pytest.mark.parametrize("algorithm", ["STANDALONE", "EAGLE", "EAGLE-tree", "EAGLE3", "MTP"])
def test_a_draft_model_speculates_through_pd(algorithm):
    """A draft model (STANDALONE) or head (EAGLE) on both sides: prefill runs it over the prompt
    with the target, its KV travels in the same pages (regions of their own), an EAGLE head's
    first draft and hidden state in the metadata row, and decode speculates from its first step
    (accepting what a colocated engine accepts) with colocated greedy's tokens; a plain prefill is
    refused at registration naming both. ``EAGLE-tree``: decode builds trees (top-k 2) from the
    first level a chain-drafting prefill (top-k 1) put in the metadata row."""
    algorithm, _, shape = algorithm.partition("-")
    trees = dict(speculative_eagle_topk=2, speculative_num_draft_tokens=6, speculative_num_steps=3)
    from tests.helpers.checkpoints import (
        build_draft_checkpoint,
        build_eagle3_head,
        build_eagle_head,
        build_mtp_checkpoint,
    )

    target = build_mtp_checkpoint() if algorithm == "MTP" else build_tiny_checkpoint("llama")
    draft = {
        "STANDALONE": lambda: build_draft_checkpoint(target, noise=0.03),
        "EAGLE": lambda: build_eagle_head(target, scale=0.5),
        "EAGLE3": lambda: build_eagle3_head(target),
        "MTP": lambda: target,  # the layer is in the model's own checkpoint
    }[algorithm]()
    spec = dict(speculative_algorithm=algorithm, speculative_draft_model_path=draft)
    model = dict(model=target, dtype="float32")
    bport = free_port()
    P = make("prefill", "local", disaggregation_bootstrap_port=bport, **model, **spec)
    decoding = spec | (trees if shape else {})
    D = make("decode", "local", **model, **decoding)
    plain_port = free_port()
    P0 = make("prefill", "local", disaggregation_bootstrap_port=plain_port, **model)
    try:
        rng = random.Random(9)
        prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (7, 40, 130)]
        if algorithm in ("EAGLE", "EAGLE3"):  # prompts the tiny heads accept drafts on
            from tests.e2e.test_speculative import prompts as accepted_prompts

            prompts = accepted_prompts(0)[:3]
        if algorithm == "MTP":
            from tests.e2e.test_speculative_mtp import mtp_prompts

            prompts = mtp_prompts()[:3]
        pairs = []
        for i, ids in enumerate(prompts):
            room = rng.randrange(2**63)
            rp = req(f"dp{i}", ids, room, port=bport)
            rd = req(f"dd{i}", ids, room, port=bport, max_new_tokens=30)
            P.add_request(rp)
            D.add_request(rd)
            pairs.append((rp, rd))
        run_until(lambda: all(rd.finished and rp.finished for rp, rd in pairs), P, D)
        import pdserve

        ref = pdserve.Engine(
            model_path=target, torch_num_threads=1, max_total_tokens=8192, dtype="float32"
        )
        outs = ref.generate(
            input_ids=prompts,
            sampling_params={"temperature": 0, "max_new_tokens": 30, "ignore_eos": True},
        )
        assert [rd.output_ids for _, rd in pairs] == [o["output_ids"] for o in outs]
        # decode speculated from its first step, on the draft's KV of the prompt computed by
        # prefill: it accepts what a colocated speculating engine accepts, request by request
        colocated = pdserve.Engine(
            model_path=target,
            torch_num_threads=1,
            max_total_tokens=8192,
            page_size=16,
            chunked_prefill_size=64,
            dtype="float32",
            **decoding,
        ).generate(
            input_ids=prompts,
            sampling_params={"temperature": 0, "max_new_tokens": 30, "ignore_eos": True},
        )
        assert [(rd.spec_verify_ct, rd.spec_accepted) for _, rd in pairs] == [
            (
                o["meta_info"]["spec_verify_ct"],
                round(
                    o["meta_info"]["spec_verify_ct"] * (o["meta_info"]["spec_accept_length"] - 1)
                ),
            )
            for o in colocated
        ]
        assert sum(rd.spec_accepted for _, rd in pairs) > 0
        if shape:  # paths off the first branch were kept
            assert D.stats["spec_moved_rows"] > 0
        for s in (P, D):
            info = s.check_integrity()
            assert info["in_use_pages"] == 0
            assert info["metadata_slots_free"] == info["metadata_slots_total"]
        # a prefill without the draft: refused, both sides named
        room = rng.randrange(2**63)
        rp = req("mp", prompts[0], room, port=plain_port)
        rd = req("md", prompts[0], room, port=plain_port)
        P0.add_request(rp)
        D.add_request(rd)
        run_until(lambda: rd.finished, P0, D)
        why = rd.finish_reason.message
        assert f"speculative mismatch: prefill no draft model, decode {algorithm} draft" in why, why
        run_until(lambda: rp.finished, P0, D)
        for s in (P0, D):  # the failed room left nothing behind
            run_until(lambda: s.check_integrity()["in_use_pages"] == 0, P0, D)
            info = s.check_integrity()
            assert info["metadata_slots_free"] == info["metadata_slots_total"], info
    finally:
        for s in (P, D, P0):
            s.pd.mgr.close()
        for s in (P, P0):
            s.pd.bootstrap_server.shutdown()


@pytest.mark.parametrize("algorithm", ["STANDALONE", "EAGLE"])
def test_a_speculating_request_migrates_with_its_draft(algorithm):
    """``POST /migrate`` of a request decoding with a draft model (STANDALONE) or head (EAGLE),
    run in process: its draft's KV goes in the same pages (and a head's next draft and hidden
    state in the metadata row), the target speculates on from it, and the request's tokens are
    plain greedy decoding's."""
    import types

    from pdserve.disagg.migration import migrate_control, movable
    from pdserve.distributed import SINGLE_RANK
    from pdserve.engine.request import Generation, PDFields
    from pdserve.server.messages import GenerateReq
    from tests.e2e.test_speculative import prompts as accepted_prompts
    from tests.helpers.checkpoints import build_draft_checkpoint, build_eagle_head

    target = build_tiny_checkpoint("llama")
    draft = (
        build_draft_checkpoint(target, noise=0.03)
        if algorithm == "STANDALONE"
        else build_eagle_head(target, scale=0.5)
    )
    spec = dict(speculative_algorithm=algorithm, speculative_draft_model_path=draft)
    model = dict(model=target, dtype="float32")
    bport = free_port()
    P = make("prefill", "local", disaggregation_bootstrap_port=bport, **model, **spec)
    D1, D2 = (make("decode", "local", **model, **spec) for _ in range(2))
    try:
        ids = accepted_prompts(0)[1]  # one the tiny head and draft accept drafts on
        rp, rd = req("p", ids, 11, port=bport), req("d", ids, 11, port=bport, max_new_tokens=40)
        P.add_request(rp)
        D1.add_request(rd)
        run_until(lambda: len(rd.output_ids) >= 8 and movable(rd) == "", P, D1)
        loop = types.SimpleNamespace(scheduler=D1, par=SINGLE_RANK, args=D1.args)
        out = migrate_control(loop, {"moves": [["d", 12, "D2"]]})
        assert not out["refused"], out
        (moved,) = out["moved"]
        fields = {k: moved[k] for k in Generation.__struct_fields__}
        pd = PDFields(bootstrap_host="127.0.0.1", bootstrap_port=out["bootstrap_port"])
        pd.bootstrap_room = moved["room"]
        spec_msg = GenerateReq(**fields, rid="d", pd=pd, resume_output_ids=moved["output_ids"][:-1])
        there = Req.from_spec(spec_msg)
        D2.add_request(there)
        run_until(lambda: there.finished and rd.finished and rp.finished, P, D1, D2)
        assert rd.finish_reason.kind == FinishKind.MIGRATED, rd.finish_reason
        import pdserve

        ref = pdserve.Engine(
            model_path=target, torch_num_threads=1, max_total_tokens=8192, dtype="float32"
        )
        want = ref.generate(
            input_ids=ids,
            sampling_params={"temperature": 0, "max_new_tokens": 40, "ignore_eos": True},
        )["output_ids"]
        assert there.output_ids == want
        assert there.spec_verify_ct > 0 and there.spec_accepted > 0  # drafts kept after the move
        for s in (P, D1, D2):
            assert s.check_integrity()["in_use_pages"] == 0
    finally:
        for s in (P, D1, D2):
            s.pd.close()
