"""Exact sampling test: the distribution of short continuations produced by speculative
decoding is compared (chi-square) with the target's exact distribution, enumerated over a
tiny vocabulary. The same test must catch the lossy longest-branch mode and a broken rule.
"""

import itertools
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from arch_models import tiny
from conftest import tiny_llama
from test_engine_greedy import random_decider, with_forward
from decoding import acceptance
from decoding.sampling import SamplingConfig, warp
from decoding.strategies import StrategyConfig, build_engine

VOCAB, LENGTH = 6, 3
# Every case draws SAMPLES continuations. A lossless case must give p > 1e-3; a lossy one must
# give p < 1e-4, ten times under that bar, so the test is shown to catch a bias of its size. The
# two lossy cases below move ~0.10 of total variation: at 4000 samples they give p ~ 2e-5
# (longest-branch) and ~1e-9 (broken residual), so a lossless case with a bias of that size
# fails its bar by 50x or more. (6000 samples pushed those to 3e-10 / 2e-16 and cost half the
# suite's time; 3000 leave longest-branch at 2e-4, too near the bar.)
SAMPLES = 4_000
LOSSY_BAR = 1e-4
PROMPT = [1, 4]


@pytest.fixture(scope="module")
def models():
    # independent weights: the draft is often wrong, so residual resampling really matters
    target = tiny_llama(0, vocab=VOCAB, layers=1, hidden=16, scale=3)
    draft = tiny_llama(1, vocab=VOCAB, layers=1, hidden=16, scale=3)
    return target, draft


def exact_distribution(target, sampling):
    """P(x1..xL | prompt) for every continuation, from one batched forward."""
    seqs = list(itertools.product(range(VOCAB), repeat=LENGTH))
    ids = torch.tensor([PROMPT + list(s) for s in seqs])
    with torch.no_grad():
        logits = target(ids).logits[:, len(PROMPT) - 1 : -1]
    probs = warp(logits, sampling)  # [seqs, L, V]
    tok = torch.tensor(seqs)
    seq_p = probs.gather(-1, tok[..., None])[..., 0].double().prod(-1)
    return dict(zip(seqs, seq_p.tolist()))


def chi2_pvalue(counts: Counter, exact: dict, n: int) -> float:
    """Chi-square goodness of fit; cells with expected count < 5 are pooled."""
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for seq, p in exact.items():
        if p * n >= 5:
            obs.append(counts.get(seq, 0))
            exp.append(p * n)
        else:
            pool_o += counts.get(seq, 0)
            pool_e += p * n
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    exp = [e * n / sum(exp) for e in exp]  # absorb float rounding
    return float(chisquare(obs, exp).pvalue)


def speculative_counts(engine, n):
    counts, depths, sizes = Counter(), Counter(), Counter()
    for seed in range(n):
        out, stats = engine.generate(PROMPT, LENGTH, seed=seed)
        counts[tuple(out)] += 1
        depths.update(stats.drafted_depths)
        sizes.update(stats.tree_sizes)
    return counts, depths, sizes


T1 = SamplingConfig(temperature=1.0)
WARPED = SamplingConfig(temperature=0.8, top_p=0.9)
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
FAST = ("mcsd-without-replacement", "ti-mcsd+confidence-top-p", "ti-mcsd-longest-branch-LOSSY")
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
