"""Exact sampling test: the distribution of short continuations produced by speculative
decoding is compared (chi-square) with the target's exact distribution, enumerated over a
tiny vocabulary. The same test must catch the lossy longest-branch mode and a broken rule.
"""

import pytest

from support.engine import random_decider, with_forward
from support.exact import (LENGTH, PROMPT, SAMPLES, T1, VOCAB, WARPED, chi2_pvalue, exact_distribution,
                           speculative_counts)
from support.models import tiny, tiny_llama
from decoding import acceptance
from decoding.strategies import StrategyConfig, build_engine

LOSSY_BAR = 1e-4  # a lossy case must fall ten times under the lossless bar (support/exact.py)


@pytest.fixture(scope="module")
def models():
    # independent weights: the draft is often wrong, so residual resampling really matters
    target = tiny_llama(0, vocab=VOCAB, layers=1, hidden=16, scale=3)
    draft = tiny_llama(1, vocab=VOCAB, layers=1, hidden=16, scale=3)
    return target, draft


CASES = [
    # (id, strategy, sampling, broken rule?, expected lossless)
    ("mcsd-without-replacement", StrategyConfig(strategy="mcsd", k_config="2,2"), T1, False, True),
    ("mcsd-with-replacement", StrategyConfig(strategy="mcsd", k_config="3,1", replacement=True),
     T1, False, True),
    ("ti-mcsd+confidence-top-p", StrategyConfig(strategy="ti-mcsd", width=2, depth=2, stop="confidence",
                                                confidence_threshold=0.2), WARPED, False, True),
    ("ti-mcsd-longest-branch-LOSSY", StrategyConfig(strategy="ti-mcsd", width=2, depth=2,
                                                    mode="longest-branch"), T1, False, False),
    ("mcsd-broken-residual", StrategyConfig(strategy="mcsd", k_config="2,2"), T1, True, False),
    ("ti-mcsd+decider-specdecpp", StrategyConfig(strategy="ti-mcsd", width=2, depth=2, stop="decider"),
     T1, False, True),
    ("ti-mcsd+decider-tree", StrategyConfig(strategy="ti-mcsd", width=2, depth=3, stop="decider"),
     T1, False, True),
    ("mcsd+confidence-tree", StrategyConfig(strategy="mcsd", k_config="2,2,1", stop="confidence",
                                            confidence_threshold=0.2, confidence_rule="tree"), T1, False, True),
]


# every case on the reference forward. The packed and lean forwards (decoding.forward.packed,
# decoding.forward.lean) change how the models compute, not the rules or the stop policies: a
# fixed tree, a dynamic tree under temperature + top-p, and the lossy case (the test must catch a
# bias there too) cover each without doubling the suite's longest tests.
# Every case on the reference forward; on packed and lean (greedy-equal on every strategy, their
# logits within rounding of eager's) the one case that exercises warping and a stop rule at once.
FAST = ("ti-mcsd+confidence-top-p",)
RUNS = [(*c, "eager") for c in CASES] + [(*c, f) for f in ("packed", "lean") for c in CASES if c[0] in FAST]


@pytest.mark.parametrize("name,cfg,sampling,broken,lossless,forward", RUNS, ids=[f"{c[0]}-{c[5]}" for c in RUNS])
def test_continuations_follow_target(models, monkeypatch, name, cfg, sampling, broken, lossless, forward):
    target, draft = with_forward(models, forward)
    if broken:  # the classic bug: resample from p instead of norm(max(0, p - q)) after a reject
        monkeypatch.setattr(acceptance, "residual", lambda p, q: p)
    rule = name.rsplit("-", 1)[-1] if cfg.stop == "decider" else None
    # thresholds at which each depth ends >= 5% of rounds (tree: 8% / 67% / 25% for depths 1 / 2 / 3)
    stop = random_decider(rule, {"specdecpp": 0.5, "tree": 0.4}[rule], cut=0.18) if rule else None
    engine = build_engine(target, draft, cfg, sampling, stop=stop)
    exact = exact_distribution(models[0], sampling)  # the eager target's law
    counts, depths, sizes = speculative_counts(engine, SAMPLES)
    if cfg.stop != "fixed":  # a stop policy that never (or always) stops would prove little
        assert depths[1] > 0.05 * sum(depths.values()) and depths[2] > 0.05 * sum(depths.values())
    if name.endswith("tree"):  # ... and a dynamic tree that never prunes a branch as little
        assert len(sizes) >= 3, sizes
    pvalue = chi2_pvalue(counts, exact, SAMPLES)
    tv = 0.5 * sum(abs(counts.get(s, 0) / SAMPLES - p) for s, p in exact.items())
    if lossless:
        assert pvalue > 1e-3, f"{name}: p={pvalue:.2e}, TV={tv:.4f}"
        print(f"{name}: chi-square p={pvalue:.3f}, TV={tv:.4f}")
    else:
        assert pvalue < LOSSY_BAR, f"{name} should be detected: p={pvalue:.2e}, TV={tv:.4f}"
        print(f"{name}: detected, chi-square p={pvalue:.2e}, TV={tv:.4f}")


def test_one_token_a_round_keeps_the_target_s_law(models):
    """Trace collection's commit_limit (`collect --every-position`) commits only the first token
    of each lossless outcome: the continuations still follow the target exactly."""
    target, draft = models
    engine = build_engine(target, draft, StrategyConfig(strategy="mcsd", k_config="2,2"), T1)
    engine.commit_limit = 1
    out, stats = engine.generate(PROMPT, LENGTH, seed=0)
    assert stats.rounds == len(out) == LENGTH and stats.drafted > 0  # a tree every round, one token kept
    counts, _, _ = speculative_counts(engine, SAMPLES)
    pvalue = chi2_pvalue(counts, exact_distribution(target, T1), SAMPLES)
    assert pvalue > 1e-3, f"p={pvalue:.2e}"


def test_sliding_window_that_bites_keeps_the_target_s_law():
    """A Gemma 3 target with local (window 2) and global layers, and a draft of its own kind:
    the third new token no longer sees the prompt's first token in the local layer, and a tree
    node's window counts from its own position. The window changes the law (checked), and the
    speculative continuations follow the windowed one."""
    small = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, head_dim=4, sliding_window=2)
    target = tiny("gemma3+window", 0, scale=3, **small)
    draft = tiny("gemma3+window", 1, scale=3, **small)
    wide = tiny("gemma3+window", 0, scale=3, **{**small, "sliding_window": 64})
    exact = exact_distribution(target, T1)
    unwindowed = exact_distribution(wide, T1)
    assert 0.5 * sum(abs(exact[s] - unwindowed[s]) for s in exact) > 0.02
    cfg = StrategyConfig(strategy="mcsd", k_config="2,2")
    counts, _, _ = speculative_counts(build_engine(target, draft, cfg, T1), SAMPLES)
    pvalue = chi2_pvalue(counts, exact, SAMPLES)
    assert pvalue > 1e-3, f"p={pvalue:.2e}"
    assert chi2_pvalue(counts, unwindowed, SAMPLES) < LOSSY_BAR  # the test tells the two laws apart
