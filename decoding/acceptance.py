"""Acceptance rules as pure functions, in the paper's names: `p` target, `q` draft.

Lossless rules keep the committed tokens distributed exactly as the (warped) target's:
  * greedy: accept the child equal to argmax p; the first miss yields argmax p as bonus;
  * multi-candidate (MCSD): for each candidate x_i, accept with min(1, p(x_i) / q(x_i));
    on reject p <- norm(max(0, p - q)); without replacement also q(x_i) <- 0, q <- norm(q).
    If all are rejected the next token is sampled from the final p.
`longest_branch` is the paper's released rule: it is NOT lossless (it picks the branch by
its accepted length) and is only used by the mode that says so in its name.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable, Sequence

import torch

from decoding.sampling import sample, uniforms

_EPS = 1e-12


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)); falls back to p when p <= q everywhere (then p == q up to rounding)."""
    r = (p - q).clamp_min_(0.0)
    s = r.sum()
    return r / s if s > _EPS else p


def accept_one(p: torch.Tensor, q: torch.Tensor, x: int, u: float) -> bool:
    """Accept draft token x (drawn from q) given a uniform u in [0, 1)."""
    qx = float(q[x])
    return qx > 0 and u * qx < float(p[x])  # u < p/q without dividing by a tiny q


def multi_candidate(
    p: torch.Tensor,
    q: torch.Tensor,
    candidates: Sequence[int],
    uniforms: Sequence[float],
    replacement: bool,
    valid: Sequence[bool] | None = None,
) -> tuple[int | None, torch.Tensor]:
    """Verify candidates drawn from q at one node, in draw order.

    Returns (index of the accepted candidate or None, the distribution to sample from if
    none was accepted).
    """
    for i, x in enumerate(candidates):
        if valid is not None and not valid[i]:
            continue
        if accept_one(p, q, x, uniforms[i]):
            return i, p
        p = residual(p, q)
        if not replacement:
            q = q.clone()
            q[x] = 0.0
            s = q.sum()
            if s <= _EPS:
                break
            q = q / s
    return None, p


@dataclass
class WalkResult:
    path: list[int]
    """Accepted node ids, first level first."""
    next_token: int | None
    """The bonus / correction token after the path (None in longest-branch mode)."""


def walk_greedy(children, tokens: Sequence[int], target_argmax: Sequence[int]) -> WalkResult:
    """Greedy tree walk. target_argmax[0] is argmax p at the anchor, [i+1] at node i."""
    path: list[int] = []
    node = -1
    while True:
        want = target_argmax[node + 1]
        nxt = next((c for c in children[node + 1] if tokens[c] == want), None)
        if nxt is None:
            return WalkResult(path, want)
        path.append(nxt)
        node = nxt


def walk_sampling(
    children,
    tokens: Sequence[int],
    valid: Sequence[bool],
    p_at: Callable[[int], torch.Tensor],
    q_at: Callable[[int], torch.Tensor],
    replacement: bool,
    generator: torch.Generator | None,
) -> WalkResult:
    """Multi-candidate sampling walk; p_at(-1)/q_at(-1) give the anchor's distributions."""
    path: list[int] = []
    node = -1
    while True:
        p = p_at(node)
        kids = children[node + 1]
        if kids:
            u = uniforms(len(kids), generator)
            idx, p = multi_candidate(
                p, q_at(node), [tokens[c] for c in kids], u, replacement, [valid[c] for c in kids]
            )
            if idx is not None:
                path.append(kids[idx])
                node = kids[idx]
                continue
        return WalkResult(path, sample(p, generator))


def longest_branch(
    children,
    tokens: Sequence[int],
    greedy: bool,
    target_argmax: Sequence[int],
    p_at: Callable[[int], torch.Tensor],
    q_at: Callable[[int], torch.Tensor],
    generator: torch.Generator | None,
) -> WalkResult:
    """LOSSY (the released DynaSD rule): first-level roots are taken unverified, each root's
    chain is checked token by token, and the branch with the longest accepted run wins."""
    best: list[int] = []
    for root in children[0]:
        run = [root]
        node = root
        while children[node + 1]:  # chains: one child per node
            child = children[node + 1][0]
            if greedy:
                ok = target_argmax[node + 1] == tokens[child]
            else:
                ok = accept_one(p_at(node), q_at(node), tokens[child], uniforms(1, generator)[0])
            if not ok:
                break
            run.append(child)
            node = child
        if len(run) > len(best):
            best = run
    return WalkResult(best, None)
