"""Exact sampling under batching: each request's short continuations follow the target's exact
(enumerated) distribution while other requests, with other prompts and sampling settings, join
at other rounds and share its verify forwards and, with the joint budget, its rows. The method is
tests/decoding/test_exact_sampling.py's (support.exact) (chi-square against the enumerated law over a 6-token vocabulary),
and the same bar shows it catches a broken rule here too."""

import itertools
from collections import Counter

import pytest
import torch

from decoding import acceptance
from decoding.batch.budget import JointGrow
from decoding.batch.measured import MeasuredChoice
from decoding.batch.prefill import ChunkSizer
from decoding.batch.scheduler import BatchEngine
from decoding.forward.cost import CostCurve
from decoding.growth import q_scores
from decoding.options import fork_k_config
from decoding.sampling import SamplingConfig, warp
from decoding.tree import layout_from_k_config
from support.exact import VOCAB, LENGTH, chi2_pvalue
from support.models import tiny_llama

BATCHES = 1_400  # 3 requests of each kind a batch: 4,200 samples per kind
LOSSY_BAR = 1e-4
T1 = SamplingConfig(temperature=1.0)
WARPED = SamplingConfig(temperature=0.8, top_p=0.9)
# (prompt, sampling, round it joins): two kinds of request side by side in every batch
KINDS = [([1, 4], T1, 0), ([3, 0, 5], WARPED, 1)]
COST = CostCurve([1, 8, 16, 64], [10.0, 10.5, 12.0, 30.0], [0.1, 0.1, 0.12, 0.2])


def optimistic(level):
    """A draft-side estimate above q (the random draft's q would rarely pay for a second level):
    any such estimate keeps the rule exact, and this one makes the joint trees vary in depth."""
    return 0.5 + 0.5 * q_scores(level)


@pytest.fixture(scope="module")
def models():
    # independent weights: the draft is often wrong, so residual resampling really matters
    return tuple(tiny_llama(s, vocab=VOCAB, layers=1, hidden=16, scale=3) for s in (0, 1))


def exact_distribution(target, prompt, sampling):
    seqs = list(itertools.product(range(VOCAB), repeat=LENGTH))
    ids = torch.tensor([prompt + list(s) for s in seqs])
    with torch.no_grad():
        probs = warp(target(ids).logits[:, len(prompt) - 1: -1], sampling)
    p = probs.gather(-1, torch.tensor(seqs)[..., None])[..., 0].double().prod(-1)
    return dict(zip(seqs, p.tolist()))


def batched_counts(models, budget: bool, batches=BATCHES, chunk=None):
    """Continuations of every request, per kind; 3 requests of each kind a batch, own seeds."""
    target, draft = models
    layout = layout_from_k_config(fork_k_config(2, 3))
    counts, sizes = [Counter() for _ in KINDS], Counter()
    # "measured": rounds drafted or plain by the engine's own timings, shared by every batch, so
    # later batches pick a kind by this machine's clock and still try the other (every 3rd round)
    measured = MeasuredChoice(warmup=2, explore_every=3) if budget == "measured" else None
    for b in range(batches):
        grow = JointGrow(optimistic, COST, max_width=2, max_nodes=8) if budget else None
        # auto: 1 or 2 prompt tokens a round by this machine's clock, and the first round beside a
        # new count of running requests sat out
        sized = ChunkSizer(lo=1, first=1, hi=2, probe_every=2, whole=0) if chunk == "auto" else chunk
        eng = BatchEngine(target, draft, layout, budget=grow, measured=measured, chunk=sized)
        reqs: list[tuple[int, object]] = []
        todo = [(k, j) for j in range(3) for k in range(len(KINDS))]
        while todo or eng.active:
            for k, j in [t for t in todo if KINDS[t[0]][2] <= eng.rounds]:
                prompt, sampling, _ = KINDS[k]
                reqs.append((k, eng.add(prompt, LENGTH, sampling, seed=b * 10 + 3 * k + j)))
                todo.remove((k, j))
            eng.step()
        for k, r in reqs:
            counts[k][tuple(r.out)] += 1
            sizes.update(r.stats.tree_sizes)
    return counts, sizes


@pytest.mark.parametrize("budget,chunk", [(False, None), (True, None), ("measured", None), (False, 1),
                                          (False, "auto")],
                         ids=["independent", "joint", "joint-measured", "chunked-prompts", "auto-chunked-prompts"])
def test_each_request_follows_its_target_law(models, budget, chunk):
    """chunked-prompts: every prompt fed one token a round beside the others' trees first; auto:
    chunks sized by time, rounds sat out among them."""
    counts, sizes = batched_counts(models, budget, chunk=chunk)
    assert len(sizes) >= (4 if budget else 1), sizes  # the joint budget really sizes the trees
    if budget == "measured":
        assert sizes[0] > 0  # plain rounds were mixed in
    for (prompt, sampling, _), c in zip(KINDS, counts):
        n = sum(c.values())
        exact = exact_distribution(models[0], prompt, sampling)
        pvalue = chi2_pvalue(c, exact, n)
        tv = 0.5 * sum(abs(c.get(s, 0) / n - p) for s, p in exact.items())
        assert pvalue > 1e-3, f"prompt {prompt}: p={pvalue:.2e}, TV={tv:.4f}"


def test_a_broken_rule_is_caught_under_batching(models, monkeypatch):
    """Resampling from p instead of norm(max(0, p - q)) after a reject: detected."""
    monkeypatch.setattr(acceptance, "residual", lambda p, q: p)
    counts, _ = batched_counts(models, True)
    prompt, sampling, _ = KINDS[0]
    n = sum(counts[0].values())
    assert chi2_pvalue(counts[0], exact_distribution(models[0], prompt, sampling), n) < LOSSY_BAR
