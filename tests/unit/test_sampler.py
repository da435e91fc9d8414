import math

import pytest
import torch

from pdserve.engine.logprobs import input_logprobs, token_logprobs, top_logprobs
from pdserve.engine.request import Req, SamplingParams
from pdserve.engine.sampler import Sampler, _inverse_cdf

torch.set_num_threads(1)

V = 8
EOS = 7
# chi-square critical value for 7 degrees of freedom at p = 0.001
CHI2_CRIT_DF7 = 24.32


def make_req(input_ids=(0, 1), output_ids=(), return_logprob=False, top_logprobs_num=0, **sp):
    return Req(
        rid="r",
        input_ids=list(input_ids),
        output_ids=list(output_ids),
        sampling=SamplingParams(**sp),
        return_logprob=return_logprob,
        top_logprobs_num=top_logprobs_num,
    )


def make_sampler(vocab=V, seed=0):
    return Sampler(vocab, "cpu", {EOS}, seed=seed)


def draw_counts(logits_row, n=20000, seed=1234, **sp):
    """Frequencies of n unseeded draws from one logits row (one batched call)."""
    req = make_req(**sp)
    out = make_sampler(vocab=logits_row.numel(), seed=seed).sample(
        logits_row.expand(n, -1).contiguous(), [req] * n
    )
    return torch.bincount(torch.tensor(out.next_ids), minlength=logits_row.numel()).double()


def chi_square(counts, expected_probs):
    expected = expected_probs.double() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "drew a token with zero expected probability"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


BASE = torch.tensor([1.0, 0.5, 2.0, -1.0, 0.0, 1.5, -0.5, 0.3])


def test_greedy_equals_argmax_fp32_and_bf16():
    torch.manual_seed(0)
    logits = torch.randn(5, 100)
    reqs = [make_req(temperature=0.0) for _ in range(4)] + [make_req(temperature=0.9, top_k=1)]
    sampler = make_sampler(vocab=100)
    assert sampler.sample(logits, reqs).next_ids == logits.argmax(-1).tolist()
    bf = logits.bfloat16()
    assert sampler.sample(bf, reqs).next_ids == bf.float().argmax(-1).tolist()


def test_padded_vocab_columns_never_chosen():
    logits = torch.zeros(2, V + 4)
    logits[:, V + 1] = 100.0
    logits[:, 3] = 1.0
    reqs = [make_req(temperature=0.0), make_req(temperature=1.0, top_k=2)]
    out = make_sampler().sample(logits, reqs)
    assert out.next_ids[0] == 3
    assert out.next_ids[1] < V


def test_temperature_zero_ignores_seed():
    torch.manual_seed(1)
    logits = torch.randn(1, 50)
    results = set()
    for seed in (None, 1, 2, 99):
        req = make_req(temperature=0.0, seed=seed)
        results.add(make_sampler(vocab=50).sample(logits, [req]).next_ids[0])
        assert req.generator is None
    assert results == {int(logits.argmax())}


def _run_steps(sampler, req, logits_fn, steps, others=()):
    """Decode `steps` tokens for `req`, optionally batched with `others` (placed around it)."""
    for step in range(steps):
        batch = list(others[: len(others) // 2]) + [req] + list(others[len(others) // 2 :])
        logits = torch.stack([logits_fn(step, i) for i in range(len(batch))])
        pos = len(others) // 2
        logits[pos] = logits_fn(step, -1)
        out = sampler.sample(logits, batch)
        req.output_ids.append(out.next_ids[pos])
    return req.output_ids


@pytest.mark.parametrize(
    "sp", [dict(temperature=1.0, top_p=0.95, seed=42), dict(temperature=0.8, seed=42)]
)
def test_seeded_request_reproducible_across_batch_composition(sp):
    vocab = 64
    flat = torch.randn(40, vocab, generator=torch.Generator().manual_seed(5)) * 0.3

    def logits_fn(step, i):
        return flat[step] if i == -1 else flat[(step + 7 * i + 3) % 40] * 2

    alone = _run_steps(make_sampler(vocab, seed=0), make_req(**sp), logits_fn, 20)
    others = [
        make_req(temperature=1.0),
        make_req(temperature=0.0),
        make_req(temperature=0.7, top_k=5, seed=7),
        make_req(temperature=1.3, min_p=0.1, repetition_penalty=1.3),
    ]
    batched = _run_steps(make_sampler(vocab, seed=123), make_req(**sp), logits_fn, 20, others)
    assert alone == batched
    other_seed = _run_steps(make_sampler(vocab), make_req(**{**sp, "seed": 43}), logits_fn, 20)
    assert other_seed != alone

    # A fresh request holding the same output prefix (retraction, or the decode side of a
    # prefill/decode split) draws the same next token.
    resumed = make_req(output_ids=alone[:10], **sp)
    out = make_sampler(vocab, seed=9).sample(flat[10:11], [resumed])
    assert out.next_ids[0] == alone[10]


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_distribution_matches_softmax(temperature):
    counts = draw_counts(BASE, temperature=temperature)
    expected = torch.softmax(BASE / temperature, -1)
    assert chi_square(counts, expected) < CHI2_CRIT_DF7
    # The same check rejects a wrong distribution: the other temperature, or a shuffled one.
    wrong_temp = torch.softmax(BASE / (1.5 - temperature), -1)
    assert chi_square(counts, wrong_temp) > CHI2_CRIT_DF7
    assert chi_square(counts, expected[torch.tensor([1, 0, 2, 3, 4, 5, 7, 6])]) > CHI2_CRIT_DF7


def test_seeded_draws_follow_distribution():
    req = make_req(temperature=1.0, seed=3)
    sampler = make_sampler()
    counts = torch.zeros(V, dtype=torch.float64)
    for _ in range(3000):
        counts[sampler.sample(BASE[None], [req]).next_ids[0]] += 1
        req.output_ids.append(0)  # advance the step; logits stay fixed
    assert chi_square(counts, torch.softmax(BASE, -1)) < CHI2_CRIT_DF7


def test_top_k_only_best_two():
    counts = draw_counts(BASE, n=5000, top_k=2)
    assert set(torch.nonzero(counts).view(-1).tolist()) == {2, 5}
    expected = torch.zeros(V)
    expected[[2, 5]] = torch.softmax(BASE[[2, 5]], -1)
    assert chi_square(counts, expected) < CHI2_CRIT_DF7


def probs_logits(probs):
    return torch.tensor(probs).log()


def test_top_p_keeps_nucleus():
    logits = probs_logits([0.15, 0.5, 0.05, 0.3])
    counts = draw_counts(logits, n=5000, top_p=0.75)
    assert counts[0] == counts[2] == 0
    assert abs(counts[1] / 5000 - 0.625) < 0.03
    # top_p=0.85: token 0 is needed (0.8 of mass before it), token 2 is not
    counts = draw_counts(logits, n=5000, top_p=0.85)
    assert counts[2] == 0 and counts[0] > 0
    # tiny top_p keeps the most likely token only
    assert draw_counts(logits, n=500, top_p=0.01)[1] == 500


def test_top_p_applies_to_top_k_renormalised_distribution():
    logits = probs_logits([0.4, 0.3, 0.2, 0.1])
    # after top_k=2 the probabilities are 4/7 and 3/7; 4/7 already exceeds top_p=0.5
    assert draw_counts(logits, n=500, top_k=2, top_p=0.5)[0] == 500


def test_filters_beyond_the_candidate_tokens():
    # 300 equally likely tokens hold 98.5% of the mass: nuclei wider than the 256 candidates
    # the sampler looks at first, batched with a row that the candidates do cover.
    wide = torch.zeros(1000)
    wide[:300] = 5.0
    narrow = torch.zeros(1000)
    narrow[500], narrow[501] = 10.0, 9.5
    n = 2000
    logits = torch.cat([wide.expand(2 * n, -1), narrow.expand(n, -1)])
    reqs = (
        [make_req(top_p=0.95)] * n  # 290 * p_token = 0.952 > 0.95: keeps 0..289
        # over the renormalised top 300: 245 / 300 > 0.815 keeps 0..244 (over the whole
        # distribution it would keep 0..248)
        + [make_req(top_k=300, top_p=0.815)] * n
        + [make_req(top_k=2)] * n
    )
    ids = make_sampler(vocab=1000).sample(logits, reqs).next_ids
    for drawn, kept in ((ids[:n], 290), (ids[n : 2 * n], 245)):
        assert set(drawn) <= set(range(kept))
        assert max(drawn) >= kept - 3
    assert set(ids[2 * n :]) == {500, 501}


def test_inverse_cdf_never_picks_zero_probability():
    probs = torch.tensor([[0.0, 0.0, 0.3, 0.0, 0.7, 0.0]] * 4)
    u = torch.tensor([0.0, 0.3, 1.0 - 2**-24, 1.0])
    assert _inverse_cdf(probs, u).tolist() == [2, 4, 4, 4]


def test_min_p():
    logits = probs_logits([0.15, 0.5, 0.05, 0.3])
    counts = draw_counts(logits, n=5000, min_p=0.35)  # threshold 0.175
    assert counts[0] == counts[2] == 0 and counts[1] > 0 and counts[3] > 0
    counts = draw_counts(logits, n=5000, min_p=0.25)  # threshold 0.125
    assert counts[2] == 0 and counts[0] > 0


def test_repetition_penalty_divides_positive_multiplies_negative():
    logits = torch.tensor([[2.0, -1.0, 1.5, -3.0, 0.5, 0.0, 0.0, 0.0]])
    req = make_req(input_ids=[0, 1, 0], output_ids=[3, 3], repetition_penalty=2.0)
    got = make_sampler().process_logits(logits, [req])
    expected = torch.tensor([[1.0, -2.0, 1.5, -6.0, 0.5, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(got, expected)
    # the caller's tensor is left alone
    assert logits[0, 0] == 2.0


def test_frequency_and_presence_penalties_count_output_only():
    logits = torch.zeros(1, V)
    req = make_req(
        input_ids=[1, 4], output_ids=[3, 3, 5, 3], frequency_penalty=0.5, presence_penalty=0.25
    )
    got = make_sampler().process_logits(logits, [req])
    expected = torch.zeros(1, V)
    expected[0, 3] = -(0.5 * 3 + 0.25)
    expected[0, 5] = -(0.5 + 0.25)
    torch.testing.assert_close(got, expected)


def test_penalties_per_row_and_in_sampling():
    logits = torch.tensor([[2.0, 1.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]] * 3)
    reqs = [
        make_req(input_ids=[0], temperature=0.0, repetition_penalty=1.4),  # 2/1.4 < 1.5
        make_req(input_ids=[0], temperature=0.0),  # no penalty: row untouched
        make_req(input_ids=[2], output_ids=[0], temperature=0.0, presence_penalty=0.6),
    ]
    assert make_sampler().sample(logits, reqs).next_ids == [1, 0, 1]
    neg = torch.tensor([[-1.0, -1.5] + [-9.0] * 6])
    # 1.6 multiplies -1.0 to -1.6 (dividing would give -0.625 and keep token 0)
    assert make_sampler().sample(
        neg, [make_req(input_ids=[0], temperature=0.0, repetition_penalty=1.6)]
    ).next_ids == [1]


def test_min_new_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros(1, V)
    logits[0, EOS] = 10.0
    logits[0, 5] = 9.0
    logits[0, 2] = 1.0
    sampler = make_sampler()
    for ignore_eos in (False, True):
        req = make_req(
            output_ids=[4],
            temperature=0.0,
            min_new_tokens=2,
            max_new_tokens=4,
            stop_token_ids=[5],
            ignore_eos=ignore_eos,
        )
        assert sampler.sample(logits, [req]).next_ids == [2]
        req.output_ids.append(2)
        assert sampler.sample(logits, [req]).next_ids == [EOS]
    sampled = make_req(temperature=1.0, min_new_tokens=1)
    out = sampler.sample(logits.expand(500, -1).contiguous(), [sampled] * 500)
    assert EOS not in out.next_ids and 5 in out.next_ids


def test_logprobs_match_log_softmax_of_raw_logits():
    torch.manual_seed(3)
    logits = torch.randn(4, 30) * 3
    reqs = [
        make_req(temperature=0.0, return_logprob=True, top_logprobs_num=5),
        make_req(temperature=0.8, return_logprob=False, top_logprobs_num=3),
        make_req(temperature=1.0, return_logprob=True, repetition_penalty=1.5, seed=1),
        make_req(
            temperature=0.0,
            return_logprob=True,
            top_logprobs_num=2,
            presence_penalty=1.0,
            output_ids=[int(logits[3].argmax())],
        ),
    ]
    out = make_sampler(vocab=30).sample(logits, reqs)
    ref = torch.log_softmax(logits, -1)
    for i in (0, 2, 3):
        assert abs(out.logprobs[i] - ref[i, out.next_ids[i]].item()) < 1e-6
    assert out.logprobs[1] is None and out.top_logprobs[1] is None
    assert out.top_logprobs[2] is None
    for i, k in ((0, 5), (3, 2)):
        top = out.top_logprobs[i]
        vals, idx = ref[i].topk(k)
        assert [t for _, t in top] == idx.tolist()
        assert all(abs(a - b) < 1e-6 for (a, _), b in zip(top, vals.tolist()))
    # nobody asked: no logprob work shows up in the output
    plain = make_sampler(vocab=30).sample(logits, [make_req(temperature=0.0)] * 4)
    assert plain.logprobs == [None] * 4 and plain.top_logprobs == [None] * 4


def test_logprob_helpers():
    torch.manual_seed(4)
    logits = (torch.randn(3, 20) * 4).bfloat16()
    ref = torch.log_softmax(logits.float(), -1)
    targets = torch.tensor([0, 7, 19])
    got = token_logprobs(logits, targets)
    assert all(abs(g - ref[i, t].item()) < 1e-6 for i, (g, t) in enumerate(zip(got, targets)))
    tops = top_logprobs(logits, 4)
    for i, row in enumerate(tops):
        assert [lp for lp, _ in row] == sorted((lp for lp, _ in row), reverse=True)
        assert all(abs(lp - ref[i, t].item()) < 1e-6 for lp, t in row)
    assert top_logprobs(logits, 0) == [[], [], []]


def test_input_logprobs_alignment():
    torch.manual_seed(5)
    ids = [3, 1, 4, 1, 5]
    pos_logits = torch.randn(len(ids), 6)  # logits at every prompt position
    ref = torch.log_softmax(pos_logits, -1)

    def expect(tok):  # prompt token tok is predicted by position tok - 1
        return ref[tok - 1, ids[tok]].item()

    toks, tops = input_logprobs(pos_logits[0:4], ids, start=0, top_k=2)
    assert toks[0] == (None, 3) and tops[0] is None
    assert [t for _, t in toks] == ids
    assert all(abs(lp - expect(i)) < 1e-6 for i, (lp, _) in enumerate(toks) if i > 0)
    assert [t for _, t in tops[1]] == ref[0].topk(2).indices.tolist()

    toks2, tops2 = input_logprobs(pos_logits[1:4], ids, start=2, top_k=0)
    assert [t for _, t in toks2] == ids[2:]
    assert all(abs(lp - expect(i + 2)) < 1e-6 for i, (lp, _) in enumerate(toks2))
    assert tops2 == [[], [], []]

    # chunks [0, 2) and [2, 4) reproduce the single call
    first = input_logprobs(pos_logits[0:2], ids[:3], start=0, top_k=2)
    second = input_logprobs(pos_logits[2:4], ids[:5], start=3, top_k=2)
    assert first[0] + second[0] == toks and first[1] + second[1] == tops

    assert input_logprobs(pos_logits[:0], [9], start=0, top_k=3) == ([(None, 9)], [None])
    assert input_logprobs(pos_logits[3:4], ids, start=4, top_k=1)[0][0][1] == 5
    assert math.isfinite(input_logprobs(pos_logits[3:4], ids, start=4, top_k=1)[0][0][0])


def test_a_row_with_non_finite_logits_draws_no_token_and_the_others_are_untouched():
    """A NaN in a sampled row would send the inverse CDF past the vocabulary: that row is reported
    failed (the scheduler ends its request with a 500) and the batch's other rows draw as usual."""
    s = make_sampler()
    logits = torch.randn(3, V)
    logits[1, 5] = float("nan")
    reqs = [make_req(temperature=0.8, seed=7), make_req(temperature=0.8), make_req(temperature=0.0)]
    out = s.sample(logits, reqs)
    assert out.failed == [1]
    assert all(0 <= t < V for t in out.next_ids) and out.next_ids[2] == int(logits[2].argmax())


def test_a_temperature_too_small_for_float32_samples_greedily():
    """Logits divided by 1e-40 (a float32 subnormal) or 1e-300 (0 in float32) overflow: such a
    row is greedy (below SAMPLING_EPS, as SGLang does), not a draw past the vocabulary."""
    torch.manual_seed(3)
    logits = torch.randn(4, V)
    reqs = [make_req(temperature=t) for t in (1e-300, 1e-40, 1e-7)] + [make_req(temperature=0.0)]
    out = make_sampler().sample(logits, reqs)
    assert out.next_ids == logits.argmax(-1).tolist() and not out.failed
    for bad in (float("nan"), float("inf"), -1e-9):
        with pytest.raises(ValueError, match="temperature: must be"):
            SamplingParams(temperature=bad).validate()


def test_a_repetition_penalty_that_would_make_logits_infinite_is_refused():
    for bad in (1e-208, 1e-7, 1e7, 0.0, -1.0):
        with pytest.raises(ValueError, match="repetition_penalty: must be in"):
            SamplingParams(repetition_penalty=bad).validate()
    SamplingParams(repetition_penalty=1e-6).validate()


@pytest.mark.parametrize(
    "sp",
    [
        dict(frequency_penalty=1.5),
        dict(presence_penalty=2.0),
        dict(repetition_penalty=3.0),
        dict(min_new_tokens=4, ignore_eos=True),
    ],
)
def test_tokens_ahead_of_a_row_count_as_output(sp):
    """A speculative row draws after its request's earlier drafts: penalties and the
    min_new_tokens ban see them as output, exactly as a request that had drawn them would, and
    they change the draw here (token 5 penalized, or EOS no longer banned)."""
    sampler = make_sampler()
    logits = torch.zeros(1, V)
    logits[0, 5], logits[0, 6] = 3.0, 2.9
    logits[0, EOS] = 3.5 if "min_new_tokens" in sp else 2.0
    req = make_req(output_ids=(1,), temperature=0, **sp)
    ahead = [2, 3, 4] if "min_new_tokens" in sp else [5, 2, 5]
    drawn = int(sampler.sample(logits, [req], ahead=[ahead]).next_ids[0])
    as_output = make_req(output_ids=(1, *ahead), temperature=0, **sp)
    assert drawn == int(sampler.process_logits(logits, [as_output]).argmax(dim=-1)[0])
    assert drawn != int(sampler.sample(logits, [req]).next_ids[0])
