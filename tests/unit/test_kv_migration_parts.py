"""The parts of KV migration that need no server: the moved request's messages round-trip, the
target preallocates pages for the prompt and the output so far (the window of a windowed group
only), logprob lists line up after the commit, which requests may move, and the flag's check."""

from __future__ import annotations

import msgspec
import pytest

from pdserve.config import ServerArgs
from pdserve.disagg.migration import commit_resumed, movable
from pdserve.engine.request import FinishKind, FinishReason, Req, SamplingParams
from pdserve.server.messages import GenerateReq, decode_to_scheduler, encode
from pdserve.server.migrate_api import MigrateBody, MigrateIn
from tests.unit.test_kv_cache import WINDOW, integrity, manager


def test_moved_request_messages_round_trip():
    spec = GenerateReq(
        rid="r", input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 9}, resume_output_ids=[4]
    )
    back = decode_to_scheduler(encode(spec))
    assert back == spec
    req = Req.from_spec(back)
    assert req.output_ids == [4] and req.resumed and req.seq_len == 4
    assert not Req.from_spec(GenerateReq(rid="s", input_ids=[1], sampling_params={})).resumed
    body = MigrateIn(
        rid="r",
        input_ids=[1],
        output_ids=[2, 3],
        sampling_params={"seed": 5},
        bootstrap_host="h",
        bootstrap_port=1,
        bootstrap_room=7,
        return_logprob=True,
    )
    assert msgspec.json.decode(msgspec.json.encode(body), type=MigrateIn) == body
    for raw in (b'{"target": "d:1"}', b'{"target": ["a", "b"], "rid": ["x"]}'):
        assert msgspec.json.encode(msgspec.json.decode(raw, type=MigrateBody))
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"target": "d", "rids": "all"}', type=MigrateBody)


def test_target_preallocates_prompt_and_output_so_far():
    ps = 4
    m = manager(ps)
    # 30 prompt tokens and 19 of output before the last token: KV for 49 tokens comes over
    r = Req("r", list(range(100, 130)), SamplingParams(max_new_tokens=100))
    r.output_ids = list(range(200, 219))
    pages, cached = m.prealloc(r, reserve=0)
    assert cached == 0 and len(pages[0]) == -(-49 // ps)
    start = m.transfer_start(1, 49, 0)  # the window at the end of the 49 tokens
    assert start == (49 - WINDOW + 1) // ps and len(pages[1]) == -(-49 // ps) - start
    integrity(m, r)
    m.free(m.park(r))
    integrity(m)


def test_commit_lines_up_the_logprobs():
    r = Req("r", [1, 2], SamplingParams(), return_logprob=True, top_logprobs_num=1)
    r.output_ids = [5, 6, 7]  # 5 and 6 came along, 7 with the KV (its logprob from the row)
    r.output_token_logprobs = [(-0.5, 7)]
    r.output_top_logprobs = [[(-0.5, 7)]]
    commit_resumed(r, before=2)
    assert [t for _, t in r.output_token_logprobs] == [5, 6, 7]
    assert r.output_token_logprobs[-1] == (-0.5, 7) and len(r.output_top_logprobs) == 3
    assert r.sent_output_len == 3 and r.sent_input_logprobs  # the source streamed them


def test_which_requests_may_move():
    from pdserve.engine.request import KVSlots

    r = Req("r", [1, 2, 3], SamplingParams())
    assert "not decoding" in movable(r)
    r.output_ids, r.kv, r.kv_len = [4], KVSlots(pages=[[1]]), 3
    assert movable(r) == ""
    r.kv_len = 2  # the last token's KV is being computed (a retracted request coming back)
    assert "not decoding" in movable(r)
    r.kv_len, r.spec = 3, object()
    assert movable(r) == ""  # a speculating request moves with its draft's state
    r.drafts = [9]
    assert "inside a speculative step" in movable(r)
    r.drafts, r.kv.draft_len = [], 1  # a draft model's KV two tokens behind
    assert "2 tokens behind" in movable(r)
    r.kv.draft_len = 2  # one behind: the target's draft computes that position again
    assert movable(r) == ""
    r.spec, r.finish_reason = None, FinishReason(FinishKind.STOP)
    assert "finished" in movable(r)


def test_migration_bootstrap_port_is_checked():
    assert ServerArgs(model_path="m", migration_bootstrap_port=0).migration_bootstrap_port == 0
    with pytest.raises(ValueError, match="migration_bootstrap_port"):
        ServerArgs(model_path="m", migration_bootstrap_port=70000)
