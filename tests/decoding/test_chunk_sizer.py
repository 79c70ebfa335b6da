"""The prefill chunk sized by measured time (decoding.batch.prefill.ChunkSizer), on injected round
times: closed-form sizes, its clamps, a request alone, and a per-row cost that grows with the
prompt's cached part shrinking the chunk."""

import pytest

from decoding.batch.prefill import ChunkSizer, parse_chunk

RUNNING = 3


def timed(sizer: ChunkSizer, base_ms: float = 4.0, rounds: int = 8) -> ChunkSizer:
    for _ in range(rounds):
        sizer.record(base_ms, 0, RUNNING)
    return sizer


def test_a_chunk_costs_stall_minus_one_base():
    """base 4 ms, 0.5 ms a row: a round of 2x the base carries 8 rows; 3x carries 16."""
    for stall, want in ((2.0, 8), (3.0, 16)):
        s = timed(ChunkSizer(stall=stall, first=16))
        s.record(4.0 + 0.5 * 16, 16, RUNNING)
        assert s.ms_per_row == pytest.approx(0.5)
        assert s.size(RUNNING) == want


def test_the_base_is_the_median_of_recent_rounds_without_prompt_rows():
    s = timed(ChunkSizer(stall=2.0, first=16))
    s.record(40.0, 0, RUNNING)  # one slow round (a hiccup) moves no median
    s.record(4.0 + 0.5 * 8, 8, RUNNING)
    assert s.size(RUNNING) == 8


def test_clamps_and_progress():
    cheap = timed(ChunkSizer(lo=4, hi=64, grow=1e9))
    cheap.record(4.0, 100, RUNNING)  # no measurable cost a row: as many as allowed
    assert cheap.size(RUNNING) == 64
    dear = timed(ChunkSizer(lo=4, hi=64))
    dear.record(4.0 + 50.0 * 2, 2, RUNNING)  # 50 ms a row: none would fit, lo still goes in
    assert dear.size(RUNNING) == 4


def test_a_chunk_grows_at_most_by_its_factor():
    s = timed(ChunkSizer(lo=4, first=16, grow=2.0))
    assert s.size(RUNNING) == 16  # measured base, no row cost yet: the first chunk
    s.record(4.0 + 0.001 * 16, 16, RUNNING)
    assert [s.size(RUNNING) for _ in range(4)] == [32, 64, 128, 256]


def test_a_request_alone_takes_the_most():
    s = ChunkSizer(hi=512)
    assert s.size(0) == 512
    s.record(1000.0, 512, 0)  # nobody waited: nothing learnt
    assert s.base == {} and s.ms_per_row is None


def test_before_any_base_the_filling_requests_sit_one_round_out_then_take_the_first_chunk():
    s = ChunkSizer(stall=2.0, first=16, probe_every=4)
    assert [s.size(RUNNING) for _ in range(6)] == [0, 16, 16, 16, 0, 16]
    s.record(4.0, 0, RUNNING)  # the round they sat out is the base
    s.record(4.0 + 0.5 * 16, 16, RUNNING)
    assert s.size(RUNNING) == 8
    assert s.size(RUNNING + 1) == 0  # another count of running requests has its own base


def test_a_growing_cost_per_row_shrinks_the_chunk():
    """As the prompt's cached part grows, each row reads more keys: the chunk follows down."""
    s = timed(ChunkSizer(lo=1, alpha=0.5))
    sizes, cost = [], 0.1
    for _ in range(12):
        n = s.size(RUNNING)
        sizes.append(n)
        s.record(4.0 + cost * n, n, RUNNING)
        cost *= 1.5
    assert sizes[-1] < sizes[3] and sizes[-1] <= 2
    assert all(b <= a for a, b in zip(sizes[3:], sizes[4:]))  # once measured, never back up


@pytest.mark.parametrize("bad", [dict(stall=1.0), dict(stall=float("nan")), dict(stall=float("inf")),
                                 dict(lo=0), dict(lo=32, first=16), dict(first=1024), dict(whole=-1)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        ChunkSizer(**bad)


def test_the_defaults_aim_low_and_advance_a_row_at_a_time():
    """The shipped aim (docs/server.md, reports/prefill-stall-2026-11-29): 1.5x, one row at least,
    4 rows before a row is timed, prompts of up to 256 tokens whole."""
    s = ChunkSizer()
    assert (s.stall, s.lo, s.first, s.whole) == (1.5, 1, 4, 256) and parse_chunk("auto").stall == 1.5
    assert parse_chunk("auto", whole=0).whole == 0
    timed(s)
    assert s.size(RUNNING) == 4
    s.record(4.0 + 3.0 * 4, 4, RUNNING)  # 3 ms a row: no row fits in 0.5 base, one still goes in
    assert s.size(RUNNING) == 1


def test_the_option_parses_auto_a_size_or_none():
    assert parse_chunk("auto", 3.0).stall == 3.0
    assert parse_chunk("128") == 128 and parse_chunk("0") is None
    for bad in ("-1", "1.5", "big", ""):
        with pytest.raises(ValueError, match="--prefill-chunk"):
            parse_chunk(bad)
