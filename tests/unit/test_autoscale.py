"""The autoscaler's decision (``router/autoscale.py``): which role falls behind, from the backlog
samples of one split, and the router flags that configure it."""

import pytest

from pdserve.router.args import parse_args
from pdserve.router.autoscale import Sample, backlog, decide, demand
from pdserve.router.workers import DECODE, PREFILL

MIN = {PREFILL: 1, DECODE: 1}


def samples(per_server: list[tuple[float, float]], prefills: int, decodes: int) -> list[Sample]:
    return [
        Sample(float(i), {PREFILL: p, DECODE: d}, {PREFILL: prefills, DECODE: decodes})
        for i, (p, d) in enumerate(per_server)
    ]


def test_a_lasting_prefill_backlog_takes_a_decode_server():
    move = decide(samples([(6, 0), (5, 0), (7, 0)], prefills=1, decodes=2), queue=2, minimum=MIN)
    assert (move.source, move.target) == (DECODE, PREFILL)
    assert move.before == 6 and move.after == 3  # 6 per prefill spread over two


def test_a_lasting_decode_backlog_takes_a_prefill_server():
    move = decide(samples([(0, 4), (0, 4)], prefills=2, decodes=1), queue=2, minimum=MIN)
    assert (move.source, move.target) == (PREFILL, DECODE) and move.after == 2


def test_a_burst_is_not_a_backlog():
    # one sample under --autoscale-queue in the window: nothing moves
    assert (
        decide(samples([(6, 0), (1, 0), (7, 0)], prefills=1, decodes=2), queue=2, minimum=MIN)
        is None
    )


def test_no_move_that_only_moves_the_queue():
    # both roles behind: a decode fewer would leave the decodes 3 * 2 / 1 = 6 per server, worse than
    # 5 today
    assert decide(samples([(5, 3)] * 3, prefills=1, decodes=2), queue=2, minimum=MIN) is None
    # the same prefill backlog with decodes that keep up does move one
    assert (
        decide(samples([(5, 0.5)] * 3, prefills=1, decodes=2), queue=2, minimum=MIN).target
        == PREFILL
    )


def test_the_minimum_of_each_role_stays():
    assert decide(samples([(9, 0)] * 3, prefills=1, decodes=1), queue=2, minimum=MIN) is None
    assert (
        decide(
            samples([(9, 0)] * 3, prefills=1, decodes=2), queue=2, minimum={PREFILL: 1, DECODE: 2}
        )
        is None
    )


def test_the_better_of_two_moves():
    # both roles behind, decode more so: a prefill moves (5 * 3 / 2 = 7.5 < 9), not a decode
    move = decide(samples([(5, 9)] * 2, prefills=3, decodes=3), queue=2, minimum=MIN)
    assert (move.source, move.target) == (PREFILL, DECODE) and move.after == 7.5


def test_no_samples_no_move():
    assert decide([], queue=2, minimum=MIN) is None


def test_backlog_of_each_role():
    load = [
        {
            "dp_rank": 0,
            "num_reqs": 9,
            "num_waiting_reqs": 2,
            "num_tokens": 100,
            "prealloc_queue": 3,
            "transfer_queue": 4,
        },
        {"dp_rank": 1, "num_reqs": 1, "num_waiting_reqs": 1, "num_tokens": 10},
    ]
    assert backlog(PREFILL, load) == 3  # not prefilled yet
    assert (
        backlog(DECODE, load) == 6
    )  # waiting for a batch slot or for KV pages; not those whose KV is under way
    assert backlog(PREFILL, {"num_waiting_reqs": 5}) == 5  # one dict (sglang's older answer)
    assert backlog(DECODE, ["junk", {}]) == 0


def test_refused_requests_count_as_demand():
    """A capped queue that is full stops growing: the requests it refused (429) since the last
    sample are added to its backlog, so a role that sheds load shows it is behind."""
    load = [
        {"num_waiting_reqs": 4, "num_shed_reqs": 10},
        {"num_waiting_reqs": 4, "num_shed_reqs": 2},
    ]
    assert demand(PREFILL, load, None) == (8, 12)  # the first sample has no before
    load[0]["num_shed_reqs"] = 25
    assert demand(PREFILL, load, 12) == (8 + 15, 27)
    assert demand(PREFILL, load, 27) == (8, 27)  # nothing refused since
    assert demand(DECODE, [{"prealloc_queue": 1}], 3) == (1, 0)  # a restarted server: no negatives


PD = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]


def test_flags():
    a = parse_args(
        [
            *PD,
            "--autoscale",
            "--autoscale-window",
            "5",
            "--autoscale-queue",
            "1.5",
            "--autoscale-min-decode",
            "2",
        ]
    )
    assert (a.autoscale, a.autoscale_window, a.autoscale_queue, a.autoscale_min_decode) == (
        True,
        5,
        1.5,
        2,
    )
    assert parse_args(PD).autoscale is False
    assert parse_args([*PD, "--drain-migrate"]).drain_migrate is True
    assert parse_args(PD).drain_migrate is False


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--worker", "http://127.0.0.1:1", "--autoscale"], "needs PD mode"),
        ([*PD, "--autoscale", "--workers", "2"], "--workers 1"),
        (["--prefill-dns", "p:1", "--decode-dns", "d:2", "--autoscale"], "kubectl scale"),
        ([*PD, "--autoscale", "--autoscale-window", "0"], "autoscale_window: must be positive"),
        (
            [*PD, "--autoscale", "--autoscale-min-prefill", "0"],
            "autoscale_min_prefill: must be at least 1",
        ),
        (
            [*PD, "--autoscale", "--autoscale-cooldown", "-1"],
            "autoscale_cooldown: must not be negative",
        ),
    ],
)
def test_bad_flags_name_the_problem(argv, match):
    with pytest.raises(ValueError, match=match):
        parse_args(argv)
