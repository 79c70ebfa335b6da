"""The multi-request verify (decoding.batch.forward.verify_many): requests' rows stacked in one
target forward give each request the logits of its own batch-1 CachedModel.feed, over prompts,
random trees and random accepted paths; bit for bit on the lean forward within the fp32 panels,
to rounding elsewhere and past the panels."""

import copy
import random

import pytest
import torch

from decoding.batch.forward import Segment, verify_many
from decoding.forward.packed import set_forward
from decoding.kv_cache import CachedModel
from decoding.tree import TreeLayout, layout_from_k_config
from support.kernels import require_kernels

PROMPTS = [[1, 5, 7, 3], [2], [9, 9, 9, 4, 4, 4, 11, 30, 17]]
"""Prompts of different lengths, one request each. The tiny pair is conftest's `pair`."""


def random_round(rng, n_nodes) -> TreeLayout:
    """A random tree of n_nodes nodes, numbered breadth-first."""
    return TreeLayout(tuple(_bfs([rng.choice([-1, *range(i)]) for i in range(n_nodes)])))


def _bfs(parents):
    """Renumber a parent list breadth-first (depth order, parents first)."""
    depth = []
    for p in parents:
        depth.append(0 if p == -1 else depth[p] + 1)
    order = sorted(range(len(parents)), key=lambda i: (depth[i], i))
    new = {old: n for n, old in enumerate(order)}
    return [-1 if parents[o] == -1 else new[parents[o]] for o in order]


@pytest.mark.parametrize("kind,threads", [("eager", 1), ("packed", 1), ("lean", 1), ("lean", 2),
                                          ("lean-onednn", 1)])
def test_stacked_rows_equal_batch1_rows(pair, kind, threads):
    """Three requests over four rounds (prompts, random trees, random accepted paths): each
    request's logits from the stacked forward equal its own CachedModel.feed's. The lean forward
    on the kernels, every round's rows within the fp32 panels (<= 32): bit for bit (on 2 threads
    the one-call layer attends one segment a thread); it skips only where the kernels cannot
    exist. Eager, packed and lean on oneDNN (`lean-onednn`, as on an AVX2 CPU; not
    batch-invariant by contract): to rounding."""
    if kind == "lean":
        require_kernels()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _stacked_rows_equal_batch1_rows(pair, kind)
    finally:
        torch.set_num_threads(before)


def _stacked_rows_equal_batch1_rows(pair, kind):
    target = pair[0] if kind == "eager" else copy.deepcopy(pair[0])
    if kind != "eager":
        forward = kind.removesuffix("-onednn")
        assert set_forward(target, forward, kernels=kind != "lean-onednn") == forward
    rng = random.Random(0)
    texts = [list(p) for p in PROMPTS[:3]]
    solo, batched = [CachedModel(target) for _ in texts], [CachedModel(target) for _ in texts]
    for _ in range(4):
        lays = [random_round(rng, rng.randint(0, 6)) for _ in texts]
        toks = [[rng.randrange(32) for _ in range(lay.size)] for lay in lays]
        want = [c.feed(t, lay, tk, 0, lay.size)[0] for c, t, lay, tk in zip(solo, texts, lays, toks)]
        segs = [Segment(c, list(t), lay, tk) for c, t, lay, tk in zip(batched, texts, lays, toks)]
        assert sum(s.rows for s in segs) <= 32
        got = verify_many(target, segs)
        for w, g in zip(want, got):
            if kind == "lean":
                assert torch.equal(w, g)
            else:
                torch.testing.assert_close(w, g, rtol=1e-5, atol=1e-5)
        for c1, c2, t, lay, tk in zip(solo, batched, texts, lays, toks):
            leaf = rng.randrange(lay.size) if lay.size else None
            path = lay.path_to(leaf) if leaf is not None else []
            c1.commit(path, lay.size)
            c2.commit(path, lay.size)
            t += [tk[i] for i in path] + [rng.randrange(32)]


def test_rows_past_the_panels_agree_to_rounding(pair):
    """Above 32 stacked rows the lean linears leave the batch-invariant panels: rows then agree
    with batch-1 to rounding, not bit for bit (what the module docstring says)."""
    target = copy.deepcopy(pair[0])
    set_forward(target, "lean")
    texts = [[1, 2, 3], [4, 5], [6]]
    lay = layout_from_k_config([3, 2, 1])  # 15 nodes each: 3 x 16 rows
    toks = [[(7 * i + j) % 32 for i in range(lay.size)] for j in range(3)]
    solo = [CachedModel(target) for _ in texts]
    for c, t in zip(solo, texts):
        c.feed(t, TreeLayout(()), [], 0, 0)
        c.commit([], 0)
    batched = [CachedModel(target) for _ in texts]
    for c, t in zip(batched, texts):
        c.feed(t, TreeLayout(()), [], 0, 0)
        c.commit([], 0)
    texts = [t + [9] for t in texts]
    want = [c.feed(t, lay, tk, 0, lay.size)[0] for c, t, tk in zip(solo, texts, toks)]
    got = verify_many(target, [Segment(c, t, lay, tk) for c, t, tk in zip(batched, texts, toks)])
    for w, g in zip(want, got):
        torch.testing.assert_close(w, g, rtol=1e-4, atol=1e-4)
