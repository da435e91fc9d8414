"""Trees of drafts (``--speculative-eagle-topk`` > 1) from EAGLE, EAGLE-3 and MTP heads: greedy
tokens and logprobs identical to plain decoding in mixed batches with a penalized sampled request
beside them, with rows whose accepted path leaves the first branch (their KV moved); the head's
state after such rows equals a cold run's; seeded sampling gives the plain tokens; the tokens
follow the target's distribution (chi-square); bad settings refused. (The attention of tree rows:
tests/unit/test_tree_attention.py; PD: tests/unit/test_pd_queues.py.)"""

from __future__ import annotations

import pytest
import torch

import pdserve
from pdserve.config import ServerArgs
from pdserve.engine.request import Req, SamplingParams
from tests.e2e.test_speculative import chi_square_at_speculative_rows, greedy, prompts
from tests.helpers.checkpoints import build_eagle3_head, build_eagle_head, build_tiny_checkpoint

torch.set_num_threads(1)

NEW = 40
# (children per token, drafts per row, levels)
TREES = [(2, 6, 3), (4, 8, 4)]


def target() -> str:
    return build_tiny_checkpoint("llama")


def tree(topk: int, drafts: int, steps: int) -> dict:
    return dict(
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=drafts,
        speculative_num_steps=steps,
    )


def engine(algorithm=None, head=None, **kw) -> pdserve.Engine:
    kw.setdefault("page_size", 4)
    kw.setdefault("max_total_tokens", 16384)
    if algorithm is not None:
        kw.update(speculative_algorithm=algorithm, speculative_draft_model_path=head)
    return pdserve.Engine(
        model_path=kw.pop("model_path", target()),
        torch_num_threads=1,
        chunked_prefill_size=32,
        **kw,
    )


@pytest.fixture(scope="module")
def plain():
    return engine()


@pytest.fixture(scope="module")
def head():
    return build_eagle_head(target(), scale=0.5)


def same_tokens_and_logprobs(ref: list[dict], out: list[dict]) -> None:
    for k, (r, o) in enumerate(zip(ref, out)):
        assert o["output_ids"] == r["output_ids"], f"prompt {k}"
        a = [v for v, _, _ in o["meta_info"]["output_token_logprobs"]]
        b = [v for v, _, _ in r["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, f"prompt {k}"


@pytest.mark.parametrize("shape", TREES, ids=lambda s: "topk{}-n{}-depth{}".format(*s))
def test_greedy_tokens_and_logprobs_equal_plain_decoding(plain, head, shape, request):
    spec = engine("EAGLE", head, **tree(*shape))
    request.node._engine = spec
    ps = prompts(0) + prompts(4)[2:]
    # top_k: the tiny model's distribution is nearly flat, where the order of nearly equal
    # probabilities (and so a top_p draw) moves with any change of arithmetic, a cache hit's too
    sampled = {"temperature": 0.5, "top_k": 3, "max_new_tokens": 20, "ignore_eos": True}
    sampled.update(seed=11, frequency_penalty=0.5)
    params = [greedy(NEW)] * len(ps) + [sampled]
    ids = ps + [ps[2]]
    ref = plain.generate(input_ids=ids, sampling_params=params, return_logprob=True)
    out = spec.generate(input_ids=ids, sampling_params=params, return_logprob=True)
    same_tokens_and_logprobs(ref, out)
    lengths = [o["meta_info"]["spec_accept_length"] for o in out[:-1]]
    assert max(lengths) > 1.5 and len(set(lengths)) > 1, lengths
    stats = spec.scheduler.stats
    # some rows kept a path off the first branch: their drafts' KV moved to their positions
    assert stats["spec_moved_rows"] > 0, stats
    alone = spec.generate(input_ids=ps[4], sampling_params=greedy(NEW))
    assert alone["output_ids"] == ref[4]["output_ids"]
    info = spec.check_integrity()
    assert info["in_use_pages"] == 0 and info["running"] == 0


def test_bf16_trees_give_the_plain_tokens(head, request):
    """bf16 on the cpu backend: tree tokens run as one-query rows of the kernel plain decode rows
    run on, so their attention has plain decoding's bits."""
    plain = engine(dtype="bfloat16")
    spec = engine("EAGLE", head, dtype="bfloat16", **tree(4, 8, 4))
    request.node._engine = spec
    ps = prompts(0) + prompts(4)[2:]
    ref = plain.generate(input_ids=ps, sampling_params=greedy(NEW), return_logprob=True)
    out = spec.generate(input_ids=ps, sampling_params=greedy(NEW), return_logprob=True)
    same_tokens_and_logprobs(ref, out)
    assert spec.scheduler.stats["spec_moved_rows"] > 0
    info = spec.check_integrity()
    assert info["in_use_pages"] == 0 and info["running"] == 0


def test_the_heads_state_after_a_moved_row_is_a_cold_runs(head, request):
    """After a row whose kept drafts moved, the head's first level for the next step (its pairs
    computed from the moved rows' hidden states) equals that of a fresh engine given the same
    sequence as its prompt."""
    spec = engine("EAGLE", head, **tree(2, 6, 3))
    cold = engine("EAGLE", head, disable_radix_cache=True)
    request.node._engine = spec
    sched, checked = spec.scheduler, 0
    for i, ids in enumerate(prompts(0) + prompts(4)[2:]):
        req = Req(rid=f"r{i}", input_ids=ids, sampling=SamplingParams.from_dict(greedy(NEW)))
        sched.add_request(req)
        while not req.finished:
            moved = sched.stats["spec_moved_rows"]
            sched.step()
            if sched.stats["spec_moved_rows"] > moved and not req.finished:
                seq = req.all_ids
                ref = Req(
                    rid=f"c{i}-{checked}",
                    input_ids=seq[:-1],
                    sampling=SamplingParams.from_dict(greedy(2)),
                )
                cold.scheduler.add_request(ref)
                while not ref.output_ids:
                    cold.scheduler.step()
                assert ref.output_ids[0] == seq[-1]
                ids_a, p_a = req.spec.next_topk
                ids_b, p_b = ref.spec.next_topk
                assert ids_a[:2] == ids_b[:2], (i, checked)
                assert max(abs(x - y) for x, y in zip(p_a[:2], p_b[:2])) < 1e-3
                checked += 1
                while not ref.finished:
                    cold.scheduler.step()
        sched.drain()
    assert checked >= 3, checked


def test_seeded_sampling_gives_the_plain_tokens(plain, head, request):
    spec = engine("EAGLE", head, **tree(4, 8, 4))
    request.node._engine = spec
    ps = prompts(3)[:2]
    params = [
        {"temperature": 0.3, "top_k": 3, "max_new_tokens": 24, "seed": s, "ignore_eos": True}
        for s in range(8)
    ]
    ids = [ps[s % 2] for s in range(8)]
    ref = plain.generate(input_ids=ids, sampling_params=params)
    out = spec.generate(input_ids=ids, sampling_params=params)
    assert [o["output_ids"] for o in out] == [r["output_ids"] for r in ref]
    assert any(o["meta_info"].get("spec_accept_length", 1) > 1 for o in out)


def test_unseeded_sampling_follows_the_target_distribution(request):
    """Two drafts fit at the second token: the head's two best first tokens, so a draw that
    equals the second of them is kept too."""
    path = build_tiny_checkpoint("llama", vocab_size=16)
    common = dict(model_path=path, max_total_tokens=65536, page_size=4)
    plain = engine(**common)
    spec = engine(
        "EAGLE", build_eagle_head(path, scale=0.5), random_seed=1234, **tree(2, 2, 2), **common
    )
    request.node._engine = spec
    chi_square_at_speculative_rows(plain, spec, new=4)
    assert spec.scheduler.stats["spec_moved_rows"] > 0


def test_retractions_and_prefix_hits_under_a_small_kv_budget(plain, head, request):
    """Trees in a pool small enough that requests are retracted (their scratch pages set aside
    from it), then a follow-up turn that hits the prefix cache: the plain tokens, the pool
    whole."""
    spec = engine("EAGLE", head, max_total_tokens=400, page_size=4, **tree(2, 6, 3))
    request.node._engine = spec
    ps = prompts(0) * 2
    outs = spec.generate(input_ids=ps, sampling_params=greedy(NEW))
    stats = spec.scheduler.stats
    assert stats["retractions"] > 0 and stats["spec_accepted_tokens"] > 0, stats
    ref = plain.generate(input_ids=ps, sampling_params=greedy(NEW))
    assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in ref]
    follow = ps[1] + outs[1]["output_ids"] + prompts(1)[2][:20]
    out = spec.generate(input_ids=follow, sampling_params=greedy(NEW))
    assert out["meta_info"]["cached_tokens"] > 0
    assert (
        out["output_ids"]
        == plain.generate(input_ids=follow, sampling_params=greedy(NEW))["output_ids"]
    )
    info = spec.check_integrity()
    assert info["in_use_pages"] == 0 and info["running"] == 0


def greedy_equals_plain(plain, spec, ps: list[list[int]]) -> None:
    """Greedy tokens and logprobs of ``spec`` equal ``plain``'s, with drafts accepted; the
    pool whole after."""
    ref = plain.generate(input_ids=ps, sampling_params=greedy(NEW), return_logprob=True)
    out = spec.generate(input_ids=ps, sampling_params=greedy(NEW), return_logprob=True)
    same_tokens_and_logprobs(ref, out)
    assert max(o["meta_info"]["spec_accept_length"] for o in out) > 1.3
    info = spec.check_integrity()
    assert info["in_use_pages"] == 0 and info["running"] == 0


def test_eagle3_trees(plain, request):
    spec = engine("EAGLE3", build_eagle3_head(target()), **tree(3, 6, 3))
    request.node._engine = spec
    greedy_equals_plain(plain, spec, prompts(0) + prompts(4)[2:])


def test_mtp_trees_on_latent_attention(request):
    """DeepSeek-V3's next-token-prediction layer: tree rows on the target's and the layer's
    latent attention."""
    from tests.e2e.test_speculative_mtp import engine as mtp_engine
    from tests.e2e.test_speculative_mtp import mtp_prompts

    plain, spec = mtp_engine(), mtp_engine(speculative_algorithm="MTP", **tree(2, 5, 3))
    request.node._engine = spec
    greedy_equals_plain(plain, spec, mtp_prompts())


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(speculative_eagle_topk=17), r"speculative_eagle_topk: must be in \[1, 16\], got 17"),
        (
            dict(speculative_algorithm="NGRAM", speculative_eagle_topk=2),
            r"speculative_eagle_topk: 2 builds a tree .* 'NGRAM' proposes a chain",
        ),
        (
            dict(speculative_eagle_topk=2, enable_deterministic_inference=True),
            r"speculative_eagle_topk: 2: a tree's rows attend under a mask",
        ),
    ],
)
def test_bad_tree_settings_are_refused(kw, message):
    base = dict(speculative_algorithm="EAGLE", speculative_draft_model_path="unused")
    if kw.get("speculative_algorithm") == "NGRAM":
        base = {}
    with pytest.raises(ValueError, match=message):
        ServerArgs(model_path="unused", **(base | kw))
