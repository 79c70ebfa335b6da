"""decoding.batch.measured: whether a round of several requests drafts at all, by its own timings."""

from decoding.batch.measured import MeasuredChoice


def test_measured_choice_drafts_while_drafting_measures_faster():
    """decoding.batch.measured: both kinds timed first (drafted, then alternating), then the faster
    kind at that request count, the slower once every `explore_every` x (its rate gap)^2 rounds;
    a count not timed yet takes the nearest timed count's winner, the other kind every
    `explore_every` rounds until it is timed."""
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
    assert [m.drafts(1) for _ in range(8)].count(True) == 2  # fewer: plain as at 4, a tree every 4th
    assert [m.drafts(6) for _ in range(8)].count(True) == 2  # more: the same
    fresh = MeasuredChoice(warmup=1, explore_every=4)
    assert fresh.drafts(2) is True  # nothing timed anywhere: drafted first
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


def test_looks_at_a_losing_tree_are_spaced_by_their_cost():
    """Drafted rounds that take 10 ms more than a 5 ms plain round, at a 1% share: a look every
    10 / 0.05 = 200th round at least, more than the rate gap alone asks (4 x 8 = 32)."""
    m = MeasuredChoice(warmup=1, explore_every=4, look_share=0.01)
    m.record(4, True, 4, 15.0)
    m.record(4, False, 4, 5.0)
    assert m._every(4, False) == 200
    picks = [m.drafts(4) for _ in range(400)]
    assert picks.count(True) == 2
    m2 = MeasuredChoice(warmup=1, explore_every=4, max_every=50)
    m2.record(4, True, 4, 15.0)
    m2.record(4, False, 4, 5.0)
    assert m2._every(4, False) == 50  # capped: the load drifts
    for _ in range(10):
        m.record(4, True, 12, 5.0)  # drafting wins now: plain looks by the rate gap only
    assert m._faster_drafted(4) and m._every(4, True) <= 4 * 8


def test_a_decisive_neighbour_spaces_the_looks_at_untimed_counts():
    """Count 8 timed with plain 3x ahead (15 ms drafted rounds against 5 ms plain ones): counts 7
    and 6, never timed, take plain and look at a tree as rarely as count 8 does (every 200th
    round), not every `explore_every`; a close call there leaves them every `explore_every`."""
    m = MeasuredChoice(warmup=1, explore_every=4, look_share=0.01)
    m.record(8, True, 4, 15.0)
    m.record(8, False, 4, 5.0)
    for n in (7, 6):
        assert [m.drafts(n) for _ in range(400)].count(True) == 2
    close = MeasuredChoice(warmup=1, explore_every=4)
    close.record(8, True, 4, 6.0)
    close.record(8, False, 4, 5.0)
    assert [close.drafts(7) for _ in range(16)].count(True) == 4


def test_the_choice_says_how_many_plain_rounds_come_before_its_look():
    """Where plain rounds win, lookahead() after each is exactly the plain rounds before the next
    look at drafting at that count (0 while it drafts), as the batch-1 gate's."""
    m = MeasuredChoice(warmup=1, explore_every=4)
    m.record(4, True, 4, 10.0)
    m.record(4, False, 8, 10.0)  # plain twice as fast: a look every 16th round
    went, ahead = [], []
    for _ in range(40):
        went.append(m.drafts(4))
        ahead.append(m.lookahead())
    looks = [i for i, go in enumerate(went) if go]
    assert looks == [15, 31]
    for i, a in enumerate(ahead[:32]):
        nxt = next(j for j in looks if j >= i)
        assert a == (0 if i == nxt else nxt - i - 1)
    m.drafts(4, explore=False)
    assert m.lookahead() == 0  # a round not timed promises nothing
