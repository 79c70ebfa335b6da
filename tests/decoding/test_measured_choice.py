"""decoding.batch.measured: whether a round drafts, by this engine's own timings of each kind,
each timed only after a round of its own kind (a drafted round after plain ones pays the feature
head's catch-up for them)."""

from decoding.batch.measured import MeasuredChoice


def play(choice, n, rounds, cost):
    """Run `rounds` rounds of `n` requests; cost(drafted, previous kind) -> (tokens, ms)."""
    kinds, prev = [], None
    for _ in range(rounds):
        d = choice.drafts(n)
        choice.record(n, d, *cost(d, prev))
        kinds.append(d)
        prev = d
    return kinds


def steady(drafted, prev):
    """Drafting is faster in a streak (3 tokens in 6 ms against 1 in 3), but its first round after
    plain ones pays a catch-up that makes it look 4x slower."""
    if drafted:
        return (3, 6.0) if prev else (3, 24.0)
    return 1, 3.0


def test_warm_up_runs_each_kind_twice_in_a_row_and_times_the_second():
    c = MeasuredChoice(warmup=2)
    kinds = play(c, 1, 8, steady)
    assert kinds == [True, True, False, False, True, True, False, False]
    assert c.timed == {(1, True): 2, (1, False): 2}  # the first round of each pair is never timed
    assert c.rate[(1, True)] == 0.5 and c.rate[(1, False)] == 1 / 3


def test_a_catch_up_does_not_hide_that_drafting_wins():
    c = MeasuredChoice(warmup=2, explore_every=16)
    kinds = play(c, 1, 200, steady)
    assert sum(kinds[8:]) > 0.85 * len(kinds[8:])  # drafting, with a pair of plain rounds now and then
    assert c._faster_drafted(1) and abs(c.rate[(1, True)] - 0.5) < 1e-9  # never a catch-up's time


def test_the_slower_kind_is_explored_two_rounds_at_a_time():
    c = MeasuredChoice(warmup=1, explore_every=4)
    kinds = play(c, 2, 60, steady)
    runs, k = [], 0
    for i in range(1, len(kinds)):
        if kinds[i] != kinds[i - 1]:
            runs.append(i - k)
            k = i
    assert min(runs) >= 2  # no kind ever runs a single round (it would be timed after the other)
