"""Chunked prefill in batched rounds: a long prompt fed `chunk` tokens a round beside the running
requests' trees changes no request's greedy output (its own included), with a stand-alone draft
and with a feature head reading the chunks' features, for a fixed chunk and for one sized each
round by (injected) time, rounds sat out included; rounds carrying prompt rows are no steady
timings for the draft gate; its exact sampling is in test_batched_sampling.py (chunked-prompts)."""

import pytest
import torch

from decoding.batch import scheduler
from decoding.batch.budget import JointGrow
from decoding.batch.measured import MeasuredChoice
from decoding.batch.prefill import ChunkSizer
from decoding.batch.scheduler import BatchEngine
from decoding.forward.cost import CostCurve
from decoding.growth import q_scores
from decoding.options import fork_k_config
from decoding.sampling import SamplingConfig
from decoding.strategies import StrategyConfig, build_engine
from decoding.tree import layout_from_k_config
from support.head import fit_head
from support.models import tiny_llama

N = 16
LAYOUT = layout_from_k_config(fork_k_config(2, 3))


def prompts(vocab):
    g = torch.Generator().manual_seed(0)
    return [[1, 5, 7], torch.randint(0, vocab, (70,), generator=g).tolist(), [2, 9]]


def run(engine, ps, joins):
    reqs, first = {}, {}
    while len(reqs) < len(ps) or engine.active:
        for i, (p, j) in enumerate(zip(ps, joins)):
            if i not in reqs and engine.rounds >= j:
                reqs[i] = engine.add(p, N)
        engine.step()
        for i, r in reqs.items():
            if r.out and i not in first:
                first[i] = engine.rounds - joins[i]
    return [reqs[i].out for i in range(len(ps))], first


class ScriptedSizer(ChunkSizer):
    """Sized by made-up round times: 4 ms a round, and a prompt row costing more each round it
    rides (its cached part grows), so the chunk changes from round to round."""

    def __init__(self):
        super().__init__(lo=2, first=6, hi=64, probe_every=3, whole=0)
        self.sizes, self.rows = [], 0

    def size(self, running):
        self.sizes.append(super().size(running))
        return self.sizes[-1]

    def record(self, ms, rows, running):
        self.rows += rows
        super().record(4.0 + rows * 0.04 * (1 + self.rows / 8), rows, running)


@pytest.mark.parametrize("chunk", ["fixed", "auto"])
@pytest.mark.parametrize("draft_kind", ["standalone", "feature-head"])
def test_a_chunked_prompt_changes_no_greedy_output(pair, draft_kind, chunk):
    target, draft = pair if draft_kind == "standalone" else (lambda t: (t, fit_head(t)))(
        tiny_llama(0, vocab=40, layers=4, hidden=32, scale=6))
    ps = prompts(target.config.vocab_size)
    ar = build_engine(target, None, StrategyConfig("ar"), SamplingConfig())
    want = [ar.generate(p, N)[0] for p in ps]
    sizer = ScriptedSizer()
    got, first = run(BatchEngine(target, draft, LAYOUT, chunk=16 if chunk == "fixed" else sizer), ps, [0, 2, 3])
    assert got == want
    if chunk == "fixed":
        assert first[1] >= 70 // 16  # the long prompt took several rounds, the others ran meanwhile
        assert first[0] == 1 and first[2] == 1
    else:  # sat out rounds (0) and chunks of several sizes, shrinking as a row's cost grew
        beside = [n for n in sizer.sizes if n < sizer.hi]
        assert 0 in beside and len(set(beside) - {0}) >= 3, sizer.sizes
        assert first[1] >= 5 and first[0] == 1  # 4 chunks and a round sat out


def test_rounds_carrying_prompt_rows_are_not_timed_as_steady(pair, monkeypatch):
    """The draft gate's timings (MeasuredChoice.record) come only from rounds without prompt rows:
    a chunk riding in a round inflates whichever kind ran."""
    target, draft = pair
    rows, seen = [], []
    verify = scheduler.verify_many
    monkeypatch.setattr(scheduler, "verify_many", lambda t, segs: rows.append(max(len(s.pending) for s in segs))
                        or verify(t, segs))
    measured = MeasuredChoice(warmup=1, explore_every=2)
    record = measured.record
    monkeypatch.setattr(measured, "record", lambda *a: seen.append(rows[-1]) or record(*a))
    grow = JointGrow(lambda level: 0.5 + 0.5 * q_scores(level), CostCurve([1, 8, 64], [10.0, 10.5, 30.0],
                                                                        [0.1, 0.1, 0.2]), max_width=2, max_nodes=8)
    engine = BatchEngine(target, draft, LAYOUT, budget=grow, measured=measured, chunk=8)
    run(engine, prompts(target.config.vocab_size), [0, 2, 3])
    assert max(rows) > 1 and seen  # chunks rode beside timed rounds
    assert set(seen) == {1}, seen


def test_a_short_prompt_goes_in_whole_beside_running_requests(pair):
    """auto chunks only prompts longer than `whole`: one of 70 tokens goes in one round when
    whole is 70 and in several when it is 69; greedy outputs unchanged either way."""
    target, draft = pair
    ps = prompts(target.config.vocab_size)
    ar = build_engine(target, None, StrategyConfig("ar"), SamplingConfig())
    want = [ar.generate(p, N)[0] for p in ps]
    for whole, rounds in ((70, 1), (69, 2)):
        sizer = ChunkSizer(lo=2, first=6, hi=64, probe_every=3, whole=whole)
        got, first = run(BatchEngine(target, draft, LAYOUT, chunk=sizer), ps, [0, 2, 3])
        assert got == want
        assert (first[1] == 1) == (rounds == 1), (whole, first)
