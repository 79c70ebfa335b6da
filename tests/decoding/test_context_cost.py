"""The cost curve's context term (decoding.forward.cost): every verify row reads every cached key,
so at a long context rows cost more than the curve timed at 256 cached tokens says, and the grow
rules (one request's, and the joint budget's) read the curve at the context they draft after."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from support.models import tiny_llama
from decoding.batch.budget import JointGrow
from decoding.decider.context import ContextIndex, Snapshot
from decoding.forward.cost import CostCurve, measure_cost, per_key
from decoding.growth import GrowPolicy, q_scores
from decoding.stopping import Frontier

# 10 ms a forward of any size at 256 cached tokens; each cached token beyond adds 0.1 us to a
# step and 10 us to a forward of 16 tokens
CURVE = CostCurve([1, 16, 64], [10.0, 10.0, 10.0], [1.0, 1.0, 1.0], context=256, key_sizes=[1, 16],
                  target_key_ms=[1e-4, 1e-2], draft_key_ms=[0.0, 1e-4])


def test_a_curve_read_at_another_context():
    long = CURVE.at_context(1286)  # read at 1,280 (steps of 16)
    assert long.context == 1280 and long.target(1) == pytest.approx(10.0 + 1024 * 1e-4)
    assert long.target(16) == pytest.approx(10.0 + 1024 * 1e-2) and long.draft(16) == pytest.approx(1.0 + 1024 * 1e-4)
    assert long.target(64) == pytest.approx(long.target(16))  # the slope is flat past its last size
    assert CURVE.at_context(1290) is long  # one curve a step of 16, kept
    assert CURVE.at_context(0) is CURVE and CURVE.at_context(270) is CURVE  # not priced under the timed curve
    plain = CostCurve([1, 16], [10.0, 12.0], [1.0, 1.0])
    assert plain.at_context(4096) is plain  # no context term timed: the curve as it is
    back = CostCurve.from_dict(CURVE.to_dict())
    assert back == CURVE and back.at_context(1286).target(16) == pytest.approx(long.target(16))
    with pytest.raises(ValueError, match="key_sizes"):
        CostCurve.from_dict({**CURVE.to_dict(), "target_key_ms": [1e-4]})


def test_a_far_slope_prices_keys_beyond_the_second_context():
    # one step: 1e-4 ms a key up to 1,280 cached tokens, 2e-4 beyond; 16 tokens: 1e-2, then 5e-3
    far = replace(CURVE, far_context=1280, target_far_key_ms=[2e-4, 5e-3], draft_far_key_ms=[0.0, 1e-4])
    assert far.at_context(1286).target(1) == pytest.approx(CURVE.at_context(1286).target(1))  # up to it: the same
    long = far.at_context(2400)
    assert long.target(1) == pytest.approx(10.0 + 1024 * 1e-4 + 1120 * 2e-4)
    assert long.target(16) == pytest.approx(10.0 + 1024 * 1e-2 + 1120 * 5e-3)
    assert long.draft(16) == pytest.approx(1.0 + 2144 * 1e-4) and long.far_context == 0  # read once: a plain curve
    back = CostCurve.from_dict(far.to_dict())
    assert back == far and back.at_context(2400).target(16) == pytest.approx(long.target(16))
    lined = CostCurve.from_dict({**far.to_dict(), "far_context": 0})  # the far slope dropped: one line
    assert lined.at_context(2400).target(1) == pytest.approx(10.0 + 2144 * 1e-4)
    with pytest.raises(ValueError, match="far_context"):
        CostCurve.from_dict({**far.to_dict(), "target_far_key_ms": [1e-4]})


def test_the_slope_per_key_is_the_gap_between_two_contexts():
    assert per_key([1, 4], [10.0, 12.0], [1, 4], [11.0, 16.0], 100) == pytest.approx([0.01, 0.04])
    # a noisy long timing under the short one is no negative cost; a row never costs less than fewer
    assert per_key([1, 4], [10.0, 12.0], [1, 4], [9.0, 13.0], 100) == pytest.approx([0.0, 0.01])
    assert per_key([1, 4], [10.0, 12.0], [1, 4], [13.0, 12.5], 100) == pytest.approx([0.005, 0.005])


def test_measure_cost_times_a_second_context():
    model = tiny_llama(0, vocab=32, layers=1, max_pos=512)
    c = measure_cost(model, model, sizes=[1, 4], repeats=1, contexts=(16, 200), key_sizes=(1, 2, 4, 8))
    assert c.context == 16 and c.key_sizes == [1, 2, 4]  # only sizes the curve has
    assert all(k >= 0 for k in c.target_key_ms) and c.target_key_ms == sorted(c.target_key_ms)
    assert c.far_context == 0  # two contexts: one slope
    c = measure_cost(model, model, sizes=[1, 4], repeats=1, contexts=(16, 100, 200), key_sizes=(1, 4))
    assert c.far_context == 100 and len(c.target_far_key_ms) == len(c.draft_far_key_ms) == 2
    assert c.target_far_key_ms == sorted(c.target_far_key_ms) and min(c.target_far_key_ms) >= 0
    assert measure_cost(model, model, sizes=[1, 4], repeats=1, contexts=(16, 200, 4096)).far_context == 200  # timed within max_pos
    assert measure_cost(model, model, sizes=[1, 4], repeats=1, contexts=(16, 600, 4096)).far_context == 0  # 600 takes what room is left
    few = tiny_llama(0, vocab=32, layers=1, max_pos=24)  # no room for a second context
    c = measure_cost(few, few, sizes=[1, 4], repeats=1, contexts=(16, 200))
    assert c.key_sizes == [] and c.at_context(4096) is c


def _frontier(upto: int) -> Frontier:
    q = torch.tensor([[0.9, 0.05, 0.03, 0.02]])
    return Frontier(depth=1, nodes=[-1], q=q, path_logq=[0.0], valid=[True], size=0,
                    context=Snapshot(SimpleNamespace(context=ContextIndex()), [1] * upto, upto))


def test_one_request_grows_less_at_a_long_context():
    pol = GrowPolicy(q_scores, CURVE, max_width=4, max_nodes=16)
    at_timed = sum(pol.widths(_frontier(256)))
    at_long = sum(pol.widths(_frontier(8192)))
    assert at_timed >= 2 and at_long < at_timed
    no_term = GrowPolicy(q_scores, CostCurve([1, 16, 64], [10.0] * 3, [1.0] * 3), max_width=4, max_nodes=16)
    assert sum(no_term.widths(_frontier(8192))) == at_timed  # untimed context: as before


def test_the_joint_budget_reads_the_curve_at_its_requests_mean_context():
    jg = JointGrow(q_scores, CURVE)
    jg.begin([1, 1], [True, True], [1000, 3000])
    assert jg._cost.curve.context == 2000 and jg._cost.target(16) == pytest.approx(10.0 + 1744 * 1e-2)
    jg.begin([1, 1], [True, True])
    assert jg._cost.curve is CURVE
