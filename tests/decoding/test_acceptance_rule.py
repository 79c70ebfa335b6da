"""Acceptance math on closed-form cases (never / always / sometimes accepted)."""

import itertools
import math

import pytest
import torch

from decoding import acceptance as acc
from decoding.sampling import SamplingConfig, draw_candidates, warp
from decoding.tree import layout_from_k_config, fork_k_config

P = torch.tensor([0.5, 0.5, 0.0, 0.0])


def test_always_accepted_when_q_equals_p():
    for u in (0.0, 0.5, 0.999):
        idx, _ = acc.multi_candidate(P, P.clone(), [1, 0], [u, u], replacement=False)
        assert idx == 0


def test_never_accepted_when_supports_are_disjoint():
    q = torch.tensor([0.0, 0.0, 0.3, 0.7])
    idx, final = acc.multi_candidate(P, q, [3, 2], [0.0, 0.0], replacement=False)
    assert idx is None
    assert torch.allclose(final, P)  # residual of disjoint p, q is p itself


def test_sometimes_accepted_threshold_and_residual():
    q = torch.tensor([0.25, 0.75, 0.0, 0.0])  # p(1)/q(1) = 2/3
    assert acc.multi_candidate(P, q, [1], [0.66], replacement=True)[0] == 0
    idx, final = acc.multi_candidate(P, q, [1], [0.67], replacement=True)
    assert idx is None
    assert torch.allclose(final, torch.tensor([1.0, 0.0, 0.0, 0.0]))  # norm(max(0, p - q))


def test_without_replacement_renormalises_q():
    q = torch.tensor([0.25, 0.75, 0.0, 0.0])
    # x=1 rejected; p' = [1,0,0,0], q' = [1,0,0,0] -> x=0 accepted with prob 1
    idx, _ = acc.multi_candidate(P, q, [1, 0], [0.9, 0.999], replacement=False)
    assert idx == 1
    # with replacement q stays [0.25, 0.75]: p'(0)/q(0) = 4 -> also accepted
    assert acc.multi_candidate(P, q, [1, 0], [0.9, 0.999], replacement=True)[0] == 1
    # with replacement a repeated rejected token is now rejected for sure: p'(1) = 0
    assert acc.multi_candidate(P, q, [1, 1], [0.9, 0.0], replacement=True)[0] is None


def _draws(q, k, replacement):
    """Every candidate sequence draw_candidates can return, with its probability in closed
    form: sequential draws from q, renormalised after each draw without replacement; slots
    beyond q's support are invalid."""
    support = torch.nonzero(q).flatten().tolist()
    if replacement:
        for xs in itertools.product(support, repeat=k):
            yield list(xs), [True] * k, math.prod(float(q[x]) for x in xs)
        return
    n = min(k, len(support))
    for xs in itertools.permutations(support, n):
        prob, left = 1.0, 1.0
        for x in xs:
            prob, left = prob * float(q[x]) / left, left - float(q[x])
        yield list(xs) + [xs[0]] * (k - n), [True] * n + [False] * (k - n), prob


def _threshold(accepts) -> float:
    """sup{u in [0, 1): accepts(u)} for an acceptance region [0, t), located by bisection."""
    if not accepts(0.0):
        return 0.0
    if accepts(1.0 - 1e-16):
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if accepts(mid) else (lo, mid)
    assert accepts(lo / 2) and not accepts((hi + 1) / 2)  # one interval, as assumed
    return lo


def _emitted(p, q, cands, valid, replacement):
    """Exact distribution of the token one node emits for fixed candidates, integrating the
    uniforms through the project's own multi_candidate: candidate i is taken when u_i falls
    in its acceptance interval, whose length the function alone decides (found by bisection);
    if every candidate is rejected the node samples the distribution it returns."""
    out, acc_mass, mass, us, k = torch.zeros_like(p), 0.0, 1.0, [], len(cands)
    for i in range(k):
        rest = [1.0 - 1e-16] * (k - i - 1)
        t = _threshold(lambda u, i=i, rest=rest: acc.multi_candidate(
            p, q, cands, us + [u] + rest, replacement, valid)[0] == i)
        out[cands[i]] += mass * t
        acc_mass += mass * t
        mass *= 1 - t
        if mass == 0:
            return out, acc_mass
        us.append((t + 1) / 2)  # a uniform that rejects candidate i
    idx, final = acc.multi_candidate(p, q, cands, us, replacement, valid)
    assert idx is None
    return out + mass * final, acc_mass


def exact_node_distribution(p, q, k, replacement):
    """(P(emitted token = x) for every x, P(a draft candidate is accepted)), enumerated."""
    out, accepted = torch.zeros_like(p), 0.0
    for cands, valid, prob in _draws(q, k, replacement):
        o, a = _emitted(p, q, cands, valid, replacement)
        out += prob * o
        accepted += prob * a
    return out, accepted


def _cases():
    """(name, p, q) over a vocabulary of 5: draft always / never / sometimes accepted, and
    supports smaller than k (top-p) on either side."""
    g = torch.Generator().manual_seed(0)
    rnd = lambda: torch.softmax(torch.randn(5, generator=g, dtype=torch.float64) * 2, 0)
    p = rnd()
    yield "always", p, p.clone()
    yield "never", torch.tensor([0.5, 0.5, 0, 0, 0], dtype=torch.float64), \
        torch.tensor([0, 0, 0.2, 0.3, 0.5], dtype=torch.float64)
    for i in range(3):
        yield f"sometimes{i}", rnd(), rnd()
    yield "narrow-q", rnd(), torch.tensor([0, 0.7, 0, 0.3, 0], dtype=torch.float64)
    yield "narrow-p", torch.tensor([0, 0, 0.6, 0.4, 0], dtype=torch.float64), rnd()


@pytest.mark.parametrize("replacement", [False, True])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_multi_candidate_is_exactly_lossless(k, replacement):
    for name, p, q in _cases():
        out, accepted = exact_node_distribution(p, q, k, replacement)
        assert torch.allclose(out, p, atol=1e-9), name
        if name == "always":
            assert accepted == pytest.approx(1.0)
        elif name == "never":
            assert accepted == 0.0
        elif name.startswith("sometimes"):
            assert 0.0 < accepted < 1.0


def test_enumeration_catches_a_broken_rule(monkeypatch):
    # no residual after a rejection (resample from p itself): over-produces p's likely tokens
    monkeypatch.setattr(acc, "residual", lambda p, q: p)
    _, p, q = list(_cases())[2]
    assert not torch.allclose(exact_node_distribution(p, q, 2, False)[0], p, atol=1e-3)


@pytest.mark.parametrize("replacement", [False, True])
def test_multi_candidate_samples_follow_p(replacement):
    """The real function with real candidate draws: empirical output vs p."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.05, 0.4, 0.3, 0.25])
    q = torch.tensor([0.6, 0.1, 0.1, 0.2])
    cfg = SamplingConfig(temperature=1.0)
    n, counts = 8000, torch.zeros(4)  # atol 0.02 is 3.5 sd of the largest cell (p = 0.5)
    for _ in range(n):
        cands, valid = draw_candidates(q, 2, cfg, replacement, g)
        u = torch.rand(2, generator=g).tolist()
        idx, final = acc.multi_candidate(p, q, cands, u, replacement, valid)
        x = cands[idx] if idx is not None else int(torch.multinomial(final, 1, generator=g))
        counts[x] += 1
    assert torch.allclose(counts / n, p, atol=0.02)


def test_greedy_walk():
    lay = layout_from_k_config("2,2")  # 0 1 | 2 3 (under 0) 4 5 (under 1)
    tokens = [7, 8, 1, 2, 3, 4]
    # argmax at anchor = 8 -> node 1; at node 1 = 4 -> node 5; at node 5 = 9 (bonus)
    argmax = [8, 0, 4, 0, 0, 0, 9]
    w = acc.walk_greedy(lay.children, tokens, argmax)
    assert w.path == [1, 5] and w.next_token == 9
    w = acc.walk_greedy(lay.children, tokens, [5, 0, 0, 0, 0, 0, 0])  # first level misses
    assert w.path == [] and w.next_token == 5


def test_longest_branch_picks_longest_run():
    lay = layout_from_k_config(fork_k_config(2, 3))  # chains 0-2-4 and 1-3-5
    tokens = [10, 11, 12, 13, 14, 15]
    argmax = [-1, 99, 13, 99, 15, 0, 0]  # branch 0 stops at once, branch 1 accepts 3 and 5
    w = acc.longest_branch(lay.children, tokens, True, argmax, None, None, None)
    assert w.path == [1, 3, 5] and w.next_token is None


def test_top_p_warp_keeps_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = warp(logits, SamplingConfig(temperature=1.0, top_p=0.8))
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0, 0]))
    g = warp(logits, SamplingConfig(temperature=0.0))
    assert torch.allclose(g, torch.softmax(logits, 0))


def test_argmax_rows_is_torch_argmax_first_index_at_ties():
    """The greedy walk's argmax (numpy on CPU float32) picks what torch.argmax picks, ties to
    the first index, on strided views and in every dtype."""
    from decoding.sampling import argmax_rows

    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 300, generator=g)
    x[2, [5, 17, 290]] = 10.0  # a three-way tie
    x[4] = 0.0  # all tied
    for v in (x, x[1::2], x[:, ::3], x.t().contiguous().t(), x.to(torch.bfloat16), x.double()):
        assert argmax_rows(v) == v.argmax(-1).tolist()
    assert argmax_rows(x)[2] == 5 and argmax_rows(x)[4] == 0
    assert argmax_rows(x[-1:]) == [int(x[-1].argmax())]
