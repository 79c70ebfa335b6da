"""The machinery of the exact-sampling tests: the target's exact law of every short continuation,
enumerated over a tiny vocabulary, the engine's sampled counts and a chi-square between the two
(tests/decoding/test_exact_sampling.py and the head / CUDA / quantized variants)."""

import itertools
from collections import Counter

import torch
from scipy.stats import chisquare

from decoding.sampling import SamplingConfig, warp

VOCAB, LENGTH = 6, 3
# Every case draws SAMPLES continuations. A lossless case must give p > 1e-3; a lossy one must
# give p < 1e-4, ten times under that bar, so the test is shown to catch a bias of its size. The
# two lossy cases below move ~0.10 of total variation: at 4000 samples they give p ~ 2e-5
# (longest-branch) and ~1e-9 (broken residual), so a lossless case with a bias of that size
# fails its bar by 50x or more. (6000 samples pushed those to 3e-10 / 2e-16 and cost half the
# suite's time; 3000 leave longest-branch at 2e-4, too near the bar.)
SAMPLES = 4_000
PROMPT = [1, 4]


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
