"""``routed_dp_rank`` / ``disagg_prefill_dp_rank`` (and the deprecated ``data_parallel_rank``) on
the request bodies: validation, per-prompt split, and the front end -> scheduler message."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from pdserve.engine.request import PDFields
from pdserve.grammar import GrammarSpec
from pdserve.server import generate_api
from pdserve.server.errors import APIError
from pdserve.server.messages import GenerateReq, decode_to_scheduler, encode
from pdserve.server.openai_protocol import (
    ChatRequest,
    CompletionRequest,
    split_dp_ranks,
)


def ranks(routed=None, prefill=None, alias=None, prompts=1, n=1):
    fields = split_dp_ranks(routed, prefill, alias, prompts, n)
    return [(f["routed_dp_rank"], f["disagg_prefill_dp_rank"]) for f in fields]


def test_shapes():
    assert ranks() == [(None, None)]
    assert ranks(1, 0, prompts=3, n=2) == [(1, 0)] * 3  # a scalar is every sample's
    assert ranks([0, 1], [1, 0], prompts=2) == [(0, 1), (1, 0)]  # one per prompt
    # one per sample: a prompt gets its samples' list
    assert ranks([0, 1, 1, 0], None, prompts=2, n=2) == [([0, 1], None), ([1, 0], None)]
    assert ranks([None, 2], prompts=2) == [(None, None), (2, None)]
    assert ranks(alias=3, prompts=2) == [(3, None), (3, None)]  # the alias means routed_dp_rank
    assert ranks(3, alias=3) == [(3, None)]


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"routed": -1}, ["routed_dp_rank", "-1"]),
        ({"routed": True}, ["routed_dp_rank", "True"]),
        ({"routed": "1"}, ["routed_dp_rank"]),
        ({"routed": 2**31}, ["routed_dp_rank"]),
        ({"prefill": 0.0}, ["disagg_prefill_dp_rank"]),
        ({"prefill": [0, -1], "prompts": 2}, ["disagg_prefill_dp_rank", "-1"]),
        ({"alias": False}, ["data_parallel_rank"]),
        ({"routed": [0, 1, 0], "prompts": 2}, ["routed_dp_rank", "3 entries"]),
        ({"alias": [0], "prompts": 2}, ["data_parallel_rank", "1 entries"]),
        ({"prefill": [], "prompts": 1}, ["disagg_prefill_dp_rank"]),
        ({"routed": 1, "alias": 0}, ["data_parallel_rank", "routed_dp_rank"]),
    ],
)
def test_bad_values_are_400_naming_the_field(kwargs, words):
    with pytest.raises(APIError) as e:
        ranks(**kwargs)
    assert e.value.status == 400
    for word in words:
        assert word in str(e.value), (word, str(e.value))


def test_openai_bodies_carry_them_per_prompt():
    body = (
        b'{"prompt": ["a", "b"], "routed_dp_rank": [1, 0], "disagg_prefill_dp_rank": 2, '
        b'"bootstrap_room": 7}'
    )
    fields = msgspec.json.decode(body, type=CompletionRequest).bootstrap(2)
    assert [
        (f["routed_dp_rank"], f["disagg_prefill_dp_rank"], f["bootstrap_room"]) for f in fields
    ] == [(1, 2, 7), (0, 2, 8)]
    chat = msgspec.json.decode(
        b'{"messages": [], "n": 2, "data_parallel_rank": [0, 1], "bootstrap_room": [4, 5]}',
        type=ChatRequest,
    )
    assert chat.bootstrap()[0] == {
        "bootstrap_host": None,
        "bootstrap_port": None,
        "bootstrap_room": [4, 5],
        "routed_dp_rank": [0, 1],
        "disagg_prefill_dp_rank": None,
    }
    bad = msgspec.json.decode(b'{"prompt": "a", "routed_dp_rank": "x"}', type=CompletionRequest)
    with pytest.raises(APIError, match="routed_dp_rank"):
        bad.bootstrap(1)


class _SpecRecorder:
    """Stands in for the TokenizerManager: records what ``parse`` asks it to build."""

    takes_images = False  # a text model

    def make_spec(self, prompt, sampling, *, default_max_new_tokens, **fields):
        return SimpleNamespace(fields=fields, sampling=SimpleNamespace(n=1))


def test_generate_parse_passes_them_to_the_spec():
    req = msgspec.json.decode(
        b'{"text": ["a", "b"], "routed_dp_rank": [0, 1], "disagg_prefill_dp_rank": 1}',
        type=generate_api.GenerateRequest,
    )
    specs, many = generate_api.parse(_SpecRecorder(), req, stream=False)
    assert many and [
        (s.fields["routed_dp_rank"], s.fields["disagg_prefill_dp_rank"]) for s in specs
    ] == [(0, 1), (1, 1)]
    req = msgspec.json.decode(
        b'{"text": "a", "data_parallel_rank": 3}', type=generate_api.GenerateRequest
    )
    specs, _ = generate_api.parse(_SpecRecorder(), req, stream=False)
    assert (
        specs[0].fields["routed_dp_rank"] == 3 and specs[0].fields["disagg_prefill_dp_rank"] is None
    )


def test_generate_req_round_trip_and_old_messages_decode():
    msg = GenerateReq(
        rid="r",
        input_ids=[1, 2],
        sampling_params={},
        pd=PDFields(bootstrap_room=5, routed_dp_rank=1, disagg_prefill_dp_rank=0),
        grammar=GrammarSpec("regex", "[a-z]+"),
    )
    back = decode_to_scheduler(encode(msg))
    assert back == msg and back.pd.routed_dp_rank == 1 and back.pd.disagg_prefill_dp_rank == 0
    assert back.grammar == GrammarSpec("regex", "[a-z]+")
    old = {
        "type": "generate",
        "rid": "r",
        "input_ids": [1],
        "sampling_params": {},
    }  # before the fields existed
    back = decode_to_scheduler(msgspec.msgpack.encode(old))
    assert back.pd == PDFields() and back.grammar is None
