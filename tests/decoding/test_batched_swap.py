"""BatchEngine.swap: requests in flight finish on the draft and stop policy / scorer they were
admitted with, requests admitted after the swap use the new ones, one round may draft with both
heads (one head step per head), every greedy output equals plain `ar`, and the old head is freed
when its last request leaves."""

import copy
import gc
import weakref

import pytest

from decoding.batch import drafting
from decoding.batch.budget import JointGrow
from decoding.batch.scheduler import BatchEngine
from decoding.forward.cost import CostCurve
from decoding.growth import q_scores
from decoding.options import fork_k_config
from decoding.sampling import SamplingConfig
from decoding.stopping import DraftConfidence
from decoding.strategies import StrategyConfig, build_engine
from decoding.tree import layout_from_k_config
from support.models import noisy_copy

LAYOUT = layout_from_k_config(fork_k_config(3, 3))
COST = CostCurve([1, 8, 16, 64], [10.0, 10.5, 11.0, 20.0], [0.1, 0.1, 0.1, 0.2])
PROMPTS = [[1, 5, 7, 3], [2, 8], [9, 9, 4, 4, 11, 30, 17]]
N = 24


@pytest.fixture(scope="module", autouse=True)
def pristine(feature_pair):
    """Another head for the pair, never run (a head that has drafted holds state deepcopy refuses):
    each test takes a copy. Autouse: made before this module's first test drafts with the pair's
    head, whichever test a worker runs first."""
    return noisy_copy(feature_pair[1], 0.02)


def _counting(tag: str, calls: list):
    def score(level):
        calls.append(tag)
        return 0.5 + 0.5 * q_scores(level)
    return score


def _spy_drafts(engine, seen: dict) -> None:
    """seen[request id] = the set of draft objects its proposer drafted with, round by round."""
    propose = engine._propose

    def spy(reqs):
        for r in reqs:
            seen.setdefault(r.id, set()).add(id(r.proposer.model.draft))
        return propose(reqs)
    engine._propose = spy


@pytest.mark.parametrize("kind", ["joint", "independent"])
def test_requests_keep_their_models_across_a_swap_and_equal_ar(feature_pair, pristine, monkeypatch, kind):
    target, head = feature_pair
    new_head = copy.deepcopy(pristine)
    calls: list[str] = []
    if kind == "joint":
        eng = BatchEngine(target, head, LAYOUT, budget=JointGrow(_counting("old", calls), COST, max_width=3))
    else:
        eng = BatchEngine(target, head, LAYOUT, stop=lambda: DraftConfidence(0.3))
    seen: dict = {}
    _spy_drafts(eng, seen)
    steps = []
    head_steps = drafting.head_steps
    monkeypatch.setattr(drafting, "head_steps",
                        lambda d, *a: steps.append((eng.rounds, id(d))) or head_steps(d, *a))

    old = [eng.add(p, N) for p in PROMPTS[:2]]
    eng.step()
    if kind == "joint":
        models = eng.swap(new_head, budget=JointGrow(_counting("new", calls), COST, max_width=3))
    else:
        models = eng.swap(new_head, stop=lambda: DraftConfidence(0.3))
    assert models.version == 1 and eng.draft is new_head
    assert all(r.models.draft is head and r.version == 0 for r in old)  # in flight: still the old head
    new = eng.add(PROMPTS[2], N)
    assert new.models.draft is new_head and new.proposer.model.draft is new_head and new.version == 1
    calls.clear()
    eng.run()
    if kind == "joint":  # a round with both heads live steps each head once a level, never mixing them
        per_round: dict = {}
        for rnd, d in steps:
            per_round.setdefault(rnd, set()).add(d)
        assert {id(head), id(new_head)} in per_round.values()
        assert {"old", "new"} <= set(calls)  # each request scored by its own budget's scorer
    ar = build_engine(target, None, StrategyConfig(strategy="ar"), SamplingConfig())
    for p, r in zip(PROMPTS, [*old, new]):
        assert r.out == ar.generate(p, N)[0]
    assert seen[old[0].id] == seen[old[1].id] == {id(head)} and seen[new.id] == {id(new_head)}


def test_the_old_head_is_freed_when_its_last_request_leaves(feature_pair, pristine):
    target, head = feature_pair
    first = copy.deepcopy(pristine)
    gone = weakref.ref(first)
    eng = BatchEngine(target, first, LAYOUT, budget=JointGrow(q_scores, COST, max_width=3))
    del first
    a = eng.add(PROMPTS[0], N)
    eng.step()
    eng.swap(head, budget=JointGrow(q_scores, COST, max_width=3))
    b = eng.add(PROMPTS[1], N)
    eng.step()
    gc.collect()
    assert gone() is not None  # request `a` still drafts with it
    while a in eng.active:
        eng.step()
    gc.collect()
    assert gone() is None and b.version == 1


def test_a_swap_keeps_the_engine_s_kind(feature_pair):
    target, head = feature_pair
    eng = BatchEngine(target, head, LAYOUT, budget=JointGrow(q_scores, COST))
    with pytest.raises(ValueError, match="joint budget"):
        eng.swap(head, stop=lambda: DraftConfidence(0.3))
    with pytest.raises(ValueError, match="draft for a draft"):
        BatchEngine(target, None).swap(head)
    assert eng.models.version == 0


def test_a_faulty_round_rebuilds_each_request_from_its_own_models(feature_pair, pristine, monkeypatch):
    """Fault isolation after a swap: every request of the round is rebuilt, the old one on the old
    head, the new one on the new head, and both still write `ar`'s text."""
    from decoding.batch import scheduler as S

    target, head = feature_pair
    new_head = copy.deepcopy(pristine)
    eng = BatchEngine(target, head, LAYOUT, budget=JointGrow(q_scores, COST, max_width=3))
    old = eng.add(PROMPTS[0], N)
    eng.step()
    eng.swap(new_head, budget=JointGrow(q_scores, COST, max_width=3))
    new = eng.add(PROMPTS[1], N)
    eng.step()
    verify, hit = S.verify_many, []

    def once(*a):
        if not hit:
            hit.append(1)
            raise RuntimeError("injected verify fault")
        return verify(*a)
    monkeypatch.setattr(S, "verify_many", once)
    eng.step()
    assert hit and not eng.failed
    assert old.proposer.model.draft is head and new.proposer.model.draft is new_head
    eng.run()
    ar = build_engine(target, None, StrategyConfig(strategy="ar"), SamplingConfig())
    assert old.out == ar.generate(PROMPTS[0], N)[0] and new.out == ar.generate(PROMPTS[1], N)[0]
