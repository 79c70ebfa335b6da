"""Cost-aware tree growth (decoding.growth): the level rule on closed-form cost curves, the
value bookkeeping, greedy equality with ar, and shapes that really vary."""

from collections import Counter

import pytest
import torch

from support.models import noisy_copy, tiny_llama
from support.engine import random_decider
from decoding.forward.cost import CostCurve
from decoding.growth import GrowPolicy, candidate_level, candidate_order, child_values, pooled, q_scores
from decoding.sampling import SamplingConfig
from decoding.stopping import DraftLevel, Frontier
from decoding.strategies import StrategyConfig, build_engine


def flat(ms=10.0, draft=1.0):
    """Verification costs the same for any tree: every node with value > 0 pays."""
    return CostCurve([1, 1024], [ms, ms], [draft, draft])


def frontier(q_rows, depth=1, nodes=None, path_logq=None):
    q = torch.tensor(q_rows, dtype=torch.float32)
    n = len(q_rows)
    return Frontier(depth=depth, nodes=nodes or ([-1] if depth == 1 else list(range(n))), q=q,
                    path_logq=path_logq or [0.0] * n, valid=[True] * n, size=0)


def test_cost_curve_interpolates_and_refuses_a_broken_model():
    d = {"sizes": [1, 5, 16], "target_ms": [36.6, 41.0, 42.0], "draft_ms": [3, 3, 4]}
    c = CostCurve.from_dict({**d, "unit": "tokens"})
    assert c.target(1) == pytest.approx(36.6) and c.target(3) == pytest.approx(38.8)
    assert c.target(100) == pytest.approx(42.0)  # flat past the last measured size
    # a curve stored before the unit existed was timed with one token more than its size says
    old = CostCurve.from_dict(d)
    assert old.unit == "nodes" and old.target(3) == pytest.approx(c.target(2)) and old.target(1) == pytest.approx(36.6)
    for bad in ({}, {"sizes": [1, 2], "target_ms": [1.0], "draft_ms": [1.0, 2.0]}, None):
        with pytest.raises(ValueError, match="cost model"):
            CostCurve.from_dict(bad)
    with pytest.raises(ValueError, match="unit"):
        CostCurve.from_dict({**d, "unit": "ms"}).target(2)


def test_time_forwards_size_counts_the_new_tokens_fed(monkeypatch):
    """Size n = n new tokens in one forward (the pending token + n - 1 nodes), the unit every
    reader uses (`target(1 + nodes)`): timing n nodes instead overstated each size by a token,
    which on a CPU whose kernels jump between 3 and 4 tokens mispriced the best small trees."""
    from decoding import kv_cache as cache
    from decoding.forward.cost import COST_SIZES, measure_cost, time_forwards

    fed = []
    real = cache.CachedModel.feed

    def spy(self, committed, layout, node_tokens, start, end, hidden=False):
        if self.length == len(committed) - 1:  # the timed call: one pending token
            fed.append(1 + end - start)
        return real(self, committed, layout, node_tokens, start, end, hidden)

    monkeypatch.setattr(cache.CachedModel, "feed", spy)
    model = tiny_llama(0, vocab=32, layers=1)
    ms = time_forwards(model, [1, 2, 5], repeats=1, context=8)
    assert len(ms) == 3 and ms == sorted(ms) and fed == [1, 2, 5] * 2  # warm-up pass + 1 repeat
    assert measure_cost(model, model, sizes=[1, 3], repeats=1).unit == "tokens"
    assert list(COST_SIZES[:16]) == list(range(1, 17))  # dense where CPU kernels jump
    with pytest.raises(ValueError, match=">= 1"):
        time_forwards(model, [0, 2], repeats=1, context=8)


def test_candidate_level_is_what_greedy_would_draw():
    fr = frontier([[0.1, 0.6, 0.3, 0.0]])
    lv = candidate_level(fr, 3)
    assert lv.tokens == [1, 2, 0] and lv.branch == [0, 1, 2] and lv.parent_of == [0, 0, 0]
    assert torch.allclose(lv.q_token, torch.tensor([0.6, 0.3, 0.1]))
    assert torch.allclose(lv.path_logq, torch.log(torch.tensor([0.6, 0.3, 0.1])))
    assert candidate_level(fr, 4).valid == [True, True, True, False]  # a token without mass


def test_candidate_features_reuse_the_candidates_top_k_exactly():
    """The candidates' top-k comes with the features' top-10: the features equal those of the
    same level drawn by the proposer (parent_top unset), which is what the traces record."""
    from dataclasses import replace

    from decoding.decider.features import node_features

    g = torch.Generator().manual_seed(0)
    for vocab, width in ((64, 3), (6, 4)):  # a vocabulary below the top-10 is padded alike
        q = torch.softmax(3 * torch.randn(2, vocab, generator=g), -1)
        lv = candidate_level(frontier(q.tolist(), depth=2, nodes=[3, 5]), width)
        assert lv.parent_top is not None
        assert torch.equal(node_features(lv), node_features(replace(lv, parent_top=None)))
    # a q-only level takes just its top-w: it offers the features no truncated top-10
    assert candidate_level(frontier(q.tolist(), depth=2, nodes=[3, 5]), 3, features=False).parent_top is None


def test_candidates_over_a_drafts_own_vocabulary_are_the_same_level():
    """A frontier that carries q over the draft's own columns too (a feature head's) finds its top
    tokens there: the same level, target ids and features alike."""
    from dataclasses import replace

    from decoding.decider.features import node_features

    g = torch.Generator().manual_seed(1)
    ids = torch.randperm(40, generator=g)[:24].sort().values
    own = torch.softmax(3 * torch.randn(2, 24, generator=g), -1)
    fr = frontier(torch.zeros(2, 40).index_copy_(-1, ids, own).tolist(), depth=2, nodes=[3, 5])
    for width, features in ((3, True), (3, False), (24, True)):
        lv = candidate_level(fr, width, features)
        small = candidate_level(replace(fr, q_own=own, vocab_ids=ids.tolist()), width, features)
        assert small.tokens == lv.tokens and small.valid == lv.valid
        assert torch.equal(small.q_token, lv.q_token) and torch.equal(small.path_logq, lv.path_logq)
        if features:
            assert torch.equal(node_features(small), node_features(lv))


def test_child_values_never_exceed_the_parent():
    # one parent worth 0.5; scores 0.9, 0.8, 0.1: siblings can share at most 0.5 in total
    lv = candidate_level(frontier([[0.5, 0.3, 0.2]], depth=2, nodes=[7]), 3)
    vals = child_values([0.5], lv.parent_of, lv.valid, torch.tensor([0.9, 0.8, 0.1]))
    assert vals == pytest.approx([0.45, 0.05, 0.0])
    # a decider may rate the second draw above the first: its value stands
    assert child_values([0.5], lv.parent_of, lv.valid, torch.tensor([0.2, 0.6, 0.1])) == pytest.approx([0.1, 0.3, 0.05])


def test_candidates_are_ordered_so_every_prefix_is_drawable():
    # pooling adjacent violators: 0.1 then 0.3 is a block worth 0.2 a node
    assert pooled([0.1, 0.3, 0.05]) == pytest.approx([0.2, 0.2, 0.05])
    assert pooled([0.5, 0.2, 0.1]) == pytest.approx([0.5, 0.2, 0.1])  # q's values: unchanged
    assert pooled([0.0, 0.0, 0.9]) == pytest.approx([0.3, 0.3, 0.3])
    # parent 0: 0.1, 0.3 (pooled 0.2, 0.2); parent 1: 0.25, 0.0 (worth nothing: left out)
    order = candidate_order([0.1, 0.3, 0.25, 0.0], [0, 0, 1, 1], [0, 1, 0, 1])
    assert order == [2, 0, 1]
    # the engine takes the second draw with the first, where the pair pays
    cost = CostCurve([1, 2, 3, 4], [10.0, 10.5, 11.0, 40.0], [0.0] * 4, unit="tokens")
    pol = GrowPolicy(lambda lv: torch.tensor([0.05, 0.9, 0.0][:len(lv.nodes)]), cost, max_width=3)
    assert pol.widths(frontier([[0.5, 0.3, 0.2]])) == [2]


def test_flat_cost_takes_every_candidate_up_to_the_caps():
    pol = GrowPolicy(q_scores, flat(), max_width=3, max_nodes=64)
    assert pol.widths(frontier([[0.5, 0.3, 0.2, 0.0]])) == [3]  # the zero-mass 4th is never taken
    pol = GrowPolicy(q_scores, flat(), max_width=3, max_nodes=2)
    assert pol.widths(frontier([[0.5, 0.3, 0.2, 0.0]])) == [2]


def test_steep_cost_takes_only_what_beats_the_current_rate():
    # rate with no tree: 1 token / 10 ms. Candidates 0.6, 0.3, 0.1: the first gives 1.6 / 12 ms;
    # the second 1.9 / 20 < 1.6 / 12: the level takes exactly one.
    steep = CostCurve([1, 2, 3, 4], [10.0, 12.0, 20.0, 40.0], [0.0] * 4)
    pol = GrowPolicy(q_scores, steep, max_width=3)
    assert pol.widths(frontier([[0.6, 0.3, 0.1]])) == [1]
    # a draft too unsure to pay for any node: nothing is drafted
    pol = GrowPolicy(q_scores, steep, max_width=3)
    assert pol.widths(frontier([[0.05] * 20])) == [0]


def test_widths_follow_the_values_across_parents():
    # two frontier nodes at depth 2 worth 0.9 and 0.1: the confident one gets the children.
    # Rate now 2 / 11 ms; 0.63 -> 2.63 / 11.5; 0.18 -> 2.81 / 12; 0.09 -> 2.90 / 40: stop.
    cost = CostCurve([1, 2, 3, 4, 5, 6], [10, 10.5, 11, 11.5, 12, 40], [0.0] * 6)
    pol = GrowPolicy(q_scores, cost, max_width=3)
    pol._round = {"value": {-1: 1.0, 0: 0.9, 1: 0.1}, "E": 2.0, "N": 2, "feeds": 0.0}
    assert pol.widths(frontier([[0.7, 0.2, 0.1], [0.7, 0.2, 0.1]], depth=2, nodes=[0, 1])) == [2, 0]


def test_expand_stops_when_the_next_draft_forward_cannot_pay():
    lv = DraftLevel(depth=1, nodes=[0], tokens=[3], valid=[True], q_token=torch.tensor([0.9]),
                    parent_q=torch.full((1, 4), 0.25), parent_of=[0], parent_nodes=[-1], branch=[0],
                    path_logq=torch.log(torch.tensor([0.9])))
    cheap = GrowPolicy(q_scores, flat(10.0, draft=1.0))
    cheap._round = {"value": {-1: 1.0}, "E": 1.0, "N": 1, "feeds": 0.0}
    assert cheap.expand(lv) == [True]
    costly = GrowPolicy(q_scores, flat(10.0, draft=500.0))
    costly._round = {"value": {-1: 1.0}, "E": 1.0, "N": 1, "feeds": 0.0}
    assert costly.expand(lv) == [False]


def test_caps_are_validated():
    with pytest.raises(ValueError, match="max-nodes"):
        GrowPolicy(q_scores, flat(), max_nodes=0)
    with pytest.raises(ValueError, match="max_nodes"):
        StrategyConfig(strategy="ti-mcsd", stop="confidence", confidence_rule="grow", max_nodes=5000)


# a cost curve shaped like the CPU's (cheap up to ~16 nodes, then not), with a draft forward
# that is not free: trees then vary from one round to the next
CPU_LIKE = CostCurve([1, 5, 16, 45, 64], [36.6, 41.0, 42.0, 55.0, 59.0], [4.0, 4.0, 5.0, 6.0, 7.0])


@pytest.fixture(scope="module")
def sharp_pair():
    """Sharp next-token distributions and a draft that mostly agrees: trees of every shape."""
    target = tiny_llama(0, scale=40)
    return target, noisy_copy(target, 0.005)


def grow_engine(target, draft, sampling, scorer="q", width=3, depth=4, max_nodes=24, envelope=None):
    """envelope: a k-config the tree grows within (strategy mcsd), else ti-mcsd's any-node width."""
    if envelope is None:
        cfg = StrategyConfig(strategy="ti-mcsd", width=width, depth=depth, stop="confidence",
                             confidence_rule="grow", max_nodes=max_nodes)
    else:
        cfg = StrategyConfig(strategy="mcsd", k_config=",".join(map(str, envelope)), stop="confidence",
                             confidence_rule="grow", max_nodes=max_nodes)
    score = q_scores if scorer == "q" else random_decider("tree", 0.0, cut=0.3).scores
    pol = GrowPolicy(score, CPU_LIKE, max_width=width if envelope is None else max(envelope),
                     max_nodes=max_nodes, label=scorer, level_widths=envelope)
    return build_engine(target, draft, cfg, sampling, stop=pol)


@pytest.mark.parametrize("scorer,envelope", [("q", None), ("decider", None), ("q", (3, 2, 1, 1)),
                                             ("decider", (3, 1, 1, 1))])
def test_grow_greedy_equals_ar_and_varies_the_tree(sharp_pair, scorer, envelope):
    target, draft = sharp_pair
    greedy = SamplingConfig()
    ar = build_engine(target, None, StrategyConfig(strategy="ar"), greedy)
    eng = grow_engine(target, draft, greedy, scorer, envelope=envelope)
    sizes, depths, widest = Counter(), Counter(), Counter()

    def watch(tree, *_):  # most children of any node at each depth (0 = the anchor)
        for i, kids in enumerate(tree.layout.children):
            d = 0 if i == 0 else tree.layout.depths[i - 1]
            widest[d] = max(widest[d], len(kids))

    eng.observer = watch
    for prompt in ([1, 2, 3], [5, 9], [7, 7, 7, 1]):
        want, _ = ar.generate(prompt, 40)
        got, stats = eng.generate(prompt, 40)
        assert got == want
        assert stats.block_efficiency > 1.0  # it does speculate
        sizes.update(stats.tree_sizes)
        depths.update(stats.drafted_depths)
    assert len(sizes) >= 3 and len(depths) >= 2, (sizes, depths)
    if envelope is not None:  # the k-config caps every node's children at its depth
        assert all(widest[d] <= envelope[d] for d in widest if d < len(envelope)), (widest, envelope)


def test_grow_gives_nodes_different_child_counts(sharp_pair):
    target, draft = sharp_pair
    eng = grow_engine(target, draft, SamplingConfig(), "q")
    seen = Counter()
    eng.observer = lambda tree, *_: seen.update(len(c) for c in tree.layout.children[1:] if c)
    eng.generate([1, 2, 3], 40)
    assert len(seen) >= 2, seen  # some nodes got one child, others several


def test_grow_runs_through_session_config(pair):
    # the names the CLIs and the bench use
    cfg = StrategyConfig(strategy="ti-mcsd", width=4, depth=8, stop="confidence", confidence_rule="grow")
    assert cfg.name == "ti-mcsd[W=4,D=8]+confidence(grow)"
    with pytest.raises(ValueError, match="cost model"):
        build_engine(*pair, cfg, SamplingConfig())  # no cost model without a Session / decider


@pytest.mark.parametrize("scorer,envelope", [("q", None), ("decider", None), ("q", (3, 2, 1))])
def test_grow_sampling_is_exact_while_shapes_vary(scorer, envelope):
    """Continuations under grow follow the target's exact distribution (chi-square over a tiny
    vocabulary), with the policy really choosing different trees and child counts."""
    from support.exact import LENGTH, PROMPT, SAMPLES, VOCAB, chi2_pvalue, exact_distribution

    samples = SAMPLES  # a lossless check; test_exact_sampling shows this size catches ~0.1 TV of bias
    target = tiny_llama(0, vocab=VOCAB, layers=1, hidden=16, scale=10)
    draft = tiny_llama(1, vocab=VOCAB, layers=1, hidden=16, scale=10)
    sampling = SamplingConfig(temperature=1.0)
    eng = grow_engine(target, draft, sampling, scorer, width=3, depth=3, max_nodes=12, envelope=envelope)
    eng.stop.cost = CostCurve([1, 3, 6, 12], [10.0, 10.5, 11.5, 14.0], [0.5] * 4)  # varied trees here
    counts, sizes, kids = Counter(), Counter(), Counter()
    eng.observer = lambda tree, *_: kids.update(len(c) for c in tree.layout.children)
    for seed in range(samples):
        out, stats = eng.generate(PROMPT, LENGTH, seed=seed)
        counts[tuple(out)] += 1
        sizes.update(stats.tree_sizes)
    assert len(sizes) >= 3 and len([k for k in kids if k > 0]) >= 2, (sizes, kids)
    p = chi2_pvalue(counts, exact_distribution(target, sampling), samples)
    assert p > 1e-3, f"grow({scorer}) sampling: chi-square p = {p:.2e}"
