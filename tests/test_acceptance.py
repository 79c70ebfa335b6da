"""Acceptance math on closed-form cases (never / always / sometimes accepted)."""

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


def _exact_node_distribution(p, q, k, replacement):
    """Distribution of the token a node emits, enumerating the k candidate draws exactly."""
    out = torch.zeros_like(p)

    def rec(p, q, i, mass):
        if i == k:
            out.add_(mass * p)
            return
        for x in torch.nonzero(q).flatten().tolist():
            a = min(1.0, float(p[x] / q[x]))
            out[x] += mass * q[x] * a
            rest = mass * q[x] * (1 - a)
            if rest <= 0:
                continue
            p2 = acc.residual(p, q)
            q2 = q
            if not replacement:
                q2 = q.clone()
                q2[x] = 0
                if q2.sum() <= 0:
                    out.add_(rest * p2)
                    continue
                q2 = q2 / q2.sum()
            rec(p2, q2, i + 1, rest)

    rec(p, q, 0, 1.0)
    return out


@pytest.mark.parametrize("replacement", [False, True])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_rule_is_exactly_lossless(k, replacement):
    g = torch.Generator().manual_seed(k)
    for _ in range(5):
        p = torch.softmax(torch.randn(5, generator=g) * 2, 0).double()
        q = torch.softmax(torch.randn(5, generator=g) * 2, 0).double()
        assert torch.allclose(_exact_node_distribution(p, q, k, replacement), p, atol=1e-9)


@pytest.mark.parametrize("replacement", [False, True])
def test_multi_candidate_samples_follow_p(replacement):
    """The real function with real candidate draws: empirical output vs p."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.05, 0.4, 0.3, 0.25])
    q = torch.tensor([0.6, 0.1, 0.1, 0.2])
    cfg = SamplingConfig(temperature=1.0)
    n, counts = 20000, torch.zeros(4)
    for _ in range(n):
        cands, valid = draw_candidates(q, 2, cfg, replacement, g)
        u = torch.rand(2, generator=g).tolist()
        idx, final = acc.multi_candidate(p, q, cands, u, replacement, valid)
        x = cands[idx] if idx is not None else int(torch.multinomial(final, 1, generator=g))
        counts[x] += 1
    assert torch.allclose(counts / n, p, atol=0.012)


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
