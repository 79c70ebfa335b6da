"""The batch-1 engine's measured choice (SpeculativeEngine.measured): a round without a tree
where this engine's drafted rounds have been slower than plain ones at this context length.
Whether a round drafts is decided from earlier rounds' timings before any node is drawn, so the
text keeps the target's law; a feature head takes in the target's features of a plain round and
drafts again after it."""

from pathlib import Path

from support.exact import chi2_pvalue, exact_distribution, speculative_counts
from support.head import GREEDY, N, PROMPTS, SAMPLES, ar_output
from decoding.batch.measured import MeasuredChoice
from decoding.engine import context_bucket
from decoding.forward.cost import CostCurve
from decoding.models.session import Session
from decoding.sampling import SamplingConfig
from decoding.strategies import StrategyConfig, build_engine

GROW = StrategyConfig(strategy="ti-mcsd", width=2, depth=4)


def alternate() -> MeasuredChoice:
    """Never warm: drafted and plain rounds take turns (a drafted one first)."""
    return MeasuredChoice(warmup=10 ** 9)


def test_greedy_equals_ar_with_plain_rounds_between(feature_pair):
    target, draft = feature_pair
    eng = build_engine(target, draft, GROW, GREEDY)
    eng.measured = alternate()
    accepted = 0
    for prompt in PROMPTS:
        out, stats = eng.generate(prompt, N)
        assert out == ar_output(target, prompt)
        accepted += stats.accepted
    timed = eng.measured.timed
    assert timed[(1, True)] >= 3 and timed[(1, False)] >= 3
    assert accepted > 0  # the head drafted (and was right) after plain rounds


def test_sampling_is_exact_with_plain_rounds_between(tiny_pair):
    target, draft = tiny_pair
    sampling = SamplingConfig(temperature=1.0)
    eng = build_engine(target, draft, StrategyConfig(strategy="mcsd", k_config="2,2"), sampling)
    eng.measured = alternate()
    counts, depths, sizes = speculative_counts(eng, SAMPLES)
    assert sum(v for d, v in depths.items() if d >= 1) > 0.3 * SAMPLES
    assert sizes[0] > 0.3 * SAMPLES  # plain rounds: no tree
    assert chi2_pvalue(counts, exact_distribution(target, sampling), SAMPLES) > 1e-3


def test_a_longer_context_is_a_later_bucket():
    assert [context_bucket(n) for n in (0, 100, 255, 256, 511, 512, 1300, 5000)] == [1, 1, 1, 2, 2, 3, 4, 6]
    m = MeasuredChoice(warmup=2)
    for _ in range(2):  # short contexts: drafting timed faster; 256-511: plain faster
        m.record(1, True, 4, 10.0), m.record(1, False, 1, 5.0)
        m.record(2, True, 2, 10.0), m.record(2, False, 1, 4.0)
    assert m.drafts(1) and not m.drafts(2)
    assert not m.drafts(3)  # not timed yet, and plain won at a shorter context


def test_a_measured_grow_rule_brings_the_choice(feature_pair, monkeypatch):
    target, draft = feature_pair
    sess = Session(target, draft, None, Path("."), None)
    curve = CostCurve([1, 64], [10.0, 12.0], [1.0, 1.0])
    monkeypatch.setattr(Session, "measured_cost", lambda self: curve)
    grow = StrategyConfig(strategy="ti-mcsd", width=2, depth=4, stop="confidence", confidence_rule="grow",
                          grow_cost="measure")
    assert isinstance(sess.engine(grow, GREEDY).measured, MeasuredChoice)
    fixed = StrategyConfig(strategy="ti-mcsd", width=2, depth=4)  # a fixed tree is run as asked
    assert sess.engine(fixed, GREEDY).measured is None
