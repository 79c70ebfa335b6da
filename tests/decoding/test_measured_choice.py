"""decoding.batch.measured: whether a round of several requests drafts at all, by its own timings."""

from decoding.batch.measured import MeasuredChoice


def test_measured_choice_drafts_while_drafting_measures_faster():
    """decoding.batch.measured: both kinds timed first (drafted, then alternating), then the faster
    kind at that request count, the slower once every `explore_every` x (its rate gap)^2 rounds;
    counts apart, but a count above one where plain won starts plain."""
    m = MeasuredChoice(warmup=2, explore_every=4)
    seen = []
    for _ in range(4):
        d = m.drafts(4)
        seen.append(d)
        m.record(4, d, 8 if d else 4, 10.0)  # drafted: 0.8 tokens / ms, plain 0.4
    assert seen == [True, False, True, False]
    picks = [m.drafts(4) for _ in range(32)]
    assert picks.count(False) == 2  # the slower every 4 x (0.8 / 0.4)^2 = 16th round
    for _ in range(20):  # now plain rounds get faster
        m.record(4, False, 12, 10.0)
    assert [m.drafts(4) for _ in range(3)].count(False) >= 2
    assert m.drafts(1) is True and (1, True) not in m.rate  # fewer requests start over
    assert [m.drafts(6) for _ in range(8)].count(True) == 2  # more: plain, a tree every 4th to time it
    m.record(2, True, 0, 5.0)
    assert (2, True) not in m.timed  # an empty or zero-time round teaches nothing


def test_measured_choice_does_not_explore_in_rounds_it_does_not_time():
    """Prompt rows riding in a round keep its time out of the record: such a round runs the faster
    kind as timed (plain before both are) and never pays for a look at the other."""
    m = MeasuredChoice(warmup=1, explore_every=2)
    assert m.drafts(3, explore=False) is False  # nothing timed: plain
    m.record(3, True, 8, 10.0)
    m.record(3, False, 4, 10.0)
    assert all(m.drafts(3, explore=False) for _ in range(40))  # drafted is faster: never the look
    assert [m.drafts(3) for _ in range(8)].count(False) == 1  # exploring: every 2 x 2^2 = 8th
