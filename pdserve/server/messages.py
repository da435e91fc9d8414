"""Front end <-> scheduler messages (one ZMQ PUSH/PULL pair each way), msgpack via msgspec.

Front end -> scheduler: ``GenerateReq``, ``AbortReq``, ``ControlReq``.
Scheduler -> front end: ``TokenOut`` batches (``BatchOut``) and ``ControlResp``.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec

from pdserve.engine.request import RequestSpec


class GenerateReq(RequestSpec, tag="generate"):
    """A request to run (``engine/request.RequestSpec``, the one description of a request)."""


class AbortReq(msgspec.Struct, tag="abort"):
    rid: str  # "" aborts every request
    message: str = "aborted by client"
    status_code: int = (
        499  # the HTTP status the request ends with (503: the server is switching its role)
    )


class ControlReq(msgspec.Struct, tag="control"):
    """Synchronous control call: ``op`` in
    get_load | flush_cache | integrity | stats | switch_role | ..."""

    req_id: int
    op: str
    args: dict[str, Any] = {}


class TokenOut(msgspec.Struct):
    """New output of one request since its last ``TokenOut``."""

    rid: str
    new_ids: list[int]
    finish_reason: Optional[dict[str, Any]] = None  # FinishReason.to_json() once finished
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # speculative decoding, so far: verify steps and accepted drafts (engine/speculative.py)
    spec_verify_ct: int = 0
    spec_accepted: int = 0
    # [logprob, token_id] per new token; top: list of [logprob, token_id] per new token
    output_token_logprobs: list[tuple[float, int]] = []
    output_top_logprobs: list[list[tuple[float, int]]] = []
    # sent once, with the first output
    input_token_logprobs: Optional[list[tuple[Optional[float], int]]] = None
    input_top_logprobs: Optional[list[Optional[list[tuple[float, int]]]]] = None
    # sent once, with the finish: the scheduler's events of this request (``Req.timeline``)
    timeline: Optional[dict[str, float]] = None
    # sent once, with the finish: little-endian int32 [tokens, layers, top_k]
    # (engine/routed_experts.py)
    routed_experts: Optional[bytes] = None


class BatchOut(msgspec.Struct, tag="batch_out"):
    outs: list[TokenOut]


class ControlResp(msgspec.Struct, tag="control_resp"):
    req_id: int
    ok: bool
    result: Any = None
    error: Optional[str] = None


ToScheduler = Union[GenerateReq, AbortReq, ControlReq]
FromScheduler = Union[BatchOut, ControlResp]

_enc = msgspec.msgpack.Encoder()
_dec_to_sched = msgspec.msgpack.Decoder(ToScheduler)
_dec_from_sched = msgspec.msgpack.Decoder(FromScheduler)


def encode(msg: Any) -> bytes:
    return _enc.encode(msg)


def decode_to_scheduler(data: bytes) -> ToScheduler:
    return _dec_to_sched.decode(data)


def decode_from_scheduler(data: bytes) -> FromScheduler:
    return _dec_from_sched.decode(data)
