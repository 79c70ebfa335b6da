"""The acceptance rules of decoding.acceptance as fixed-shape tensor programs, in the paper's names
(`p` target, `q` draft): no `.item()`, no data-dependent shape, so a whole round can run on the
device and be captured. Same rules, same laws:
  * greedy: walk down while a child equals argmax p; argmax p at the last node is the bonus;
  * multi-candidate (MCSD), without replacement: for each child x_i of the current node, in draw
    order, accept with min(1, p(x_i) / q(x_i)); on reject p <- norm(max(0, p - q)),
    q(x_i) <- 0, q <- norm(q); when all are rejected the next token is drawn from the final p.

Rows are those of decoding.round.shape (row 0: the pending token). Randomness comes in as
tensors: `u` uniforms [D, k_max] for the accept tests, `e` Exp(1) draws [V] for the final token
(argmax p / e is a draw from p: the exponential race).
"""

from __future__ import annotations

import torch

from decoding.round.shape import ShapeTensors

EPS = 1e-12
"""As decoding.acceptance: a residual or a q with less mass than this is treated as empty."""


def pick(t: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """t[i] for a 0-d index tensor, as a gather: indexing by a tensor scalar would read it on the
    host (a sync, and a graph break when traced)."""
    return t.index_select(0, i.reshape(1)).squeeze(0)


def path_rows(st: ShapeTensors, best: torch.Tensor, depth: int) -> torch.Tensor:
    """[depth] rows on the path from row 0 down to row `best`, level 1 first (0 past its end)."""
    rows = st.depths.numel()
    on = pick(st.ancestors, best)  # [R]
    at = st.depths[None, :] == torch.arange(1, depth + 1, device=on.device)[:, None]  # [D, R]
    return ((on[None, :] & at) * torch.arange(rows, device=on.device)).sum(-1)


def greedy_walk(tokens: torch.Tensor, argmax_p: torch.Tensor, st: ShapeTensors, depth: int):
    """tokens [R] (row 0 the pending token), argmax_p [R] -> (accepted count [], path rows [D],
    bonus token [])."""
    match = (tokens == argmax_p[st.parents]) | (st.depths == 0)
    ok = (~st.ancestors | match[None, :]).all(-1)  # every row from row 0 down to it matched
    best = torch.argmax(st.depths * ok)  # siblings differ, so at most one accepted row a depth
    return pick(st.depths, best), path_rows(st, best, depth), pick(argmax_p, best)


def exponential_race(p: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """A draw from p given Exp(1) draws e of its shape: argmax p_i / e_i."""
    return torch.argmax(p / e, dim=-1)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)); p where that is empty (p == q up to rounding)."""
    r = (p - q).clamp_min(0.0)
    s = r.sum(-1, keepdim=True)
    return torch.where(s > EPS, r / s.clamp_min(EPS), p)


def sampling_walk(p_rows: torch.Tensor, q_rows: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor,
                  st: ShapeTensors, ks: tuple[int, ...], u: torch.Tensor, e: torch.Tensor):
    """The multi-candidate walk. p_rows [R, V] the warped target at each row; q_rows [R, V] the
    law each row's children were drawn from (without replacement, in row order); tokens [R];
    valid [R] (a child with q = 0 is never accepted). -> (accepted count [], path rows [D], next
    token [])."""
    dev = p_rows.device
    vocab = torch.arange(p_rows.shape[-1], device=dev)
    cur = torch.zeros((), dtype=torch.long, device=dev)
    done = torch.zeros((), dtype=torch.bool, device=dev)
    p = p_rows[0]
    q = q_rows[0] if q_rows is not None else p  # no tree: q is never read
    for d, k in enumerate(ks):
        first = pick(st.first_child, cur)
        nxt, moved, spent = cur, torch.zeros_like(done), torch.zeros_like(done)
        for i in range(k):
            child = first + i
            x = pick(tokens, child)
            px, qx = pick(p, x), pick(q, x)
            live = ~done & ~moved & ~spent & pick(valid, child) & (qx > 0)
            ok = live & (u[d, i] * qx < px)
            nxt = torch.where(ok, child, nxt)
            moved = moved | ok
            rejected = live & ~ok
            q_left = torch.where(vocab == x, 0.0, q)
            s = q_left.sum()
            p = torch.where(rejected, residual(p, q), p)
            q = torch.where(rejected, q_left / s.clamp_min(EPS), q)
            spent = spent | (rejected & (s <= EPS))  # no mass left for the other candidates
        cur = nxt
        p = torch.where(moved, pick(p_rows, cur), p)
        q = torch.where(moved, pick(q_rows, cur), q)
        done = done | ~moved
    depth = len(ks)
    return pick(st.depths, cur), path_rows(st, cur, depth), exponential_race(p, e)
