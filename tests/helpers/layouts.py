"""A model served colocated under several cache layouts, checked against HF transformers: the
prompts' outputs, a next turn's, the cache groups and the pools after each layout (one engine per
layout, shut down before the next), and HF's greedy reference computed once per prompt."""

from __future__ import annotations

from typing import Callable

from tests.e2e.test_engine import make_engine
from tests.e2e.test_engine_moe import hf_reference


def hf_references(path: str, new_tokens: int) -> Callable[[list[int]], tuple]:
    """``reference(ids)``: HF's greedy tokens and logprobs for ``ids`` (``hf_reference`` keeps
    the last ones computed)."""
    return lambda ids: hf_reference(path, ids, new_tokens)


def serve_layouts(path: str, prompts: list[list[int]], layouts, sp: dict, extra: list[int]) -> dict:
    """Per (page size, chunked prefill size, attention backend) layout: the cache groups, the
    prompts' outputs, the next turn of the longest conversation (its last prompt, answer and
    ``extra``) with its output, and ``check_integrity`` after them."""
    out = {}
    for page, chunk, backend in layouts:
        eng = make_engine(
            path,
            page_size=page,
            chunked_prefill_size=chunk,
            dtype="float32",
            attention_backend=backend,
        )
        try:
            groups = [(g.kind, g.layers) for g in eng.scheduler.runner.cache_groups]
            outs = eng.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)
            follow = prompts[-1] + outs[-1]["output_ids"] + extra
            again = eng.generate(input_ids=follow, sampling_params=sp, return_logprob=True)
            out[page, chunk, backend] = groups, outs, (follow, again), eng.check_integrity()
        finally:
            eng.shutdown()
    return out


def assert_matches(reference, ids: list[int], out: dict, what: str) -> None:
    """``out`` has HF's tokens, each logprob within 1e-4 of HF's (float32)."""
    tokens, logprobs = reference(ids)
    assert out["output_ids"] == tokens, f"{what}: prompt of {len(ids)} tokens"
    for k, (v, tok, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        assert abs(v - logprobs[len(ids) - 1 + k, tok].item()) < 1e-4, (what, len(ids), k)
