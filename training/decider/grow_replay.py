"""Replay the grow rule (decoding.growth) on recorded traces, deciding as inference decides.

The rule's decisions are made by the same functions the engine's GrowPolicy calls
(`child_values`, `candidate_order`, `best_count`, `worth_a_level`) on the same inputs: per-node scores (the
draft's q, or a decider's probability of the recorded row) and the cost model. Each round of a
trace drafted a whole tree (e.g. the W4 D8 fork); the replay grows a sub-tree of it level by
level and `ReplaySet.run` prices what it kept, like every other replayed policy.

Exact for greedy traces when the engine grows within the traces' own tree: strategy `mcsd`
(or `sd`) with the traces' k-config as the envelope (GrowPolicy.level_widths), e.g.
`--strategy mcsd --k-config 4,1,1,1,1,1,1,1` for W4 D8 fork traces. Under greedy the drafted
children of a node are its q's top tokens in order, so the grown tree's nodes are recorded rows
with the same features. Under sampling the engine sizes a level from its top-k candidates and
then draws a different sample: pass the candidates' scores as `count_scores`; the replay is then
an estimate. The engine's `ti-mcsd` grow may also give a deeper node 2-4 children, which a fork
trace does not hold: replayed in its envelope, it is an estimate of that row too.
"""

from __future__ import annotations

import numpy as np

from decoding.growth import best_count, candidate_order, child_values, worth_a_level
from decoding.tree import MAX_TREE_NODES

from training.decider.replay import ReplaySet


class _Children:
    """Per round: the level-1 rows, and every row's children, each in draw order."""

    def __init__(self, rs: ReplaySet, branch: np.ndarray):
        self.roots: dict[int, list[int]] = {}
        self.kids: dict[int, list[int]] = {}
        for i in np.lexsort((branch, rs.depth)).tolist():  # parents before children, draw order
            p = int(rs.parent_row[i])
            (self.roots.setdefault(int(rs.rid[i]), []) if p < 0 else self.kids.setdefault(p, [])).append(i)


def grow_kept(rs: ReplaySet, scores: np.ndarray, cost, max_nodes: int = 64,
              level_widths: tuple[int, ...] | None = None, count_scores: np.ndarray | None = None,
              spent: dict | None = None) -> np.ndarray:
    """[rows] bool: the nodes the grow rule drafts in each recorded round. `scores` is the
    per-row acceptance estimate (the engine's scorer on that node); `cost` the decision's cost
    model (the one the engine reads: a CostCurve or replay.CostModel); `level_widths` caps the
    children per node at each depth (None: whatever the trace drafted). `count_scores`: what
    the engine scored when it sized a row's level, before drawing it (under sampling the top-k
    candidates, not the recorded draw; default `scores`, exact for greedy traces). `spent`, if
    given, gets what each round really pays before verifying, as the engine does: "draft_ms"
    (every draft forward fed, the last one included where its level then drew nothing) and
    "consults" (the levels' parents, each a level's host work for one parent; ReplaySet.run prices
    each at its cost's policy_ms). Costs are counted as decoding.growth counts them: the first
    level's parent with the anchor's step, each deeper level's parents with the step feeding it."""
    scores = np.asarray(scores, np.float64)
    count_scores = scores if count_scores is None else np.asarray(count_scores, np.float64)
    ch = _Children(rs, rs.branch)
    kept = np.zeros(len(rs.depth), bool)
    room_cap = min(max_nodes, MAX_TREE_NODES)
    draft_ms, consults = np.zeros(rs.rounds), np.zeros(rs.rounds)
    for rnd in range(rs.rounds):
        value, E, N = {-1: 1.0}, 1.0, 0
        feeds = float(cost.draft(2)) + cost.policy_ms
        draft_ms[rnd], consults[rnd] = float(cost.draft(2)), 1
        frontier, depth = [-1], 1
        while frontier:
            width = level_widths[depth - 1] if level_widths and depth <= len(level_widths) else None
            if width == 0:
                break
            cand, parent_of = [], []
            for r, p in enumerate(frontier):
                rows = ch.roots.get(rnd, []) if p < 0 else ch.kids.get(p, [])
                cand += rows[:width]
                parent_of += [r] * len(rows[:width])
            if not cand:
                break
            pv = [value[p] for p in frontier]
            vals = child_values(pv, parent_of, rs.valid[cand].tolist(), count_scores[cand])
            order = candidate_order(vals, parent_of, rs.branch[cand].tolist())
            k = best_count([vals[i] for i in order], E, N, feeds, cost, room_cap - N)
            if k == 0:
                break
            counts = np.bincount([parent_of[i] for i in order[:k]], minlength=len(frontier))
            # the engine draws every parent's first counts[parent] children
            drawn_at = [i for i, c in enumerate(cand) if rs.branch[c] < counts[parent_of[i]]]
            drawn = [cand[i] for i in drawn_at]
            kept[drawn] = True
            N += len(drawn)
            dvals = child_values(pv, [parent_of[i] for i in drawn_at], rs.valid[drawn].tolist(), scores[drawn])
            value.update(zip(drawn, dvals))
            E += sum(dvals)
            guess = sorted((v * scores[c] for c, v in zip(drawn, dvals)), reverse=True)
            n = max(len(drawn), 1)  # the next level's parents
            next_feeds = feeds + float(cost.draft(n)) + n * cost.policy_ms
            if not worth_a_level(guess, E, N, feeds, next_feeds, cost, max_nodes - N):
                break
            feeds = next_feeds
            draft_ms[rnd] += float(cost.draft(n))
            consults[rnd] += n
            frontier = [c for c in drawn if rs.valid[c] and value[c] > 0.0]
            depth += 1
    if spent is not None:
        spent.update(draft_ms=draft_ms, consults=consults)
    return kept


def grow_policy(scores: np.ndarray, cost, max_nodes: int = 64, level_widths=None, count_scores=None):
    """The grow rule as a replay policy (ReplaySet -> kept mask and what each round spent
    drafting), like replay.fixed et al."""
    def policy(rs):
        spent = {}
        return grow_kept(rs, scores, cost, max_nodes, level_widths, count_scores, spent), spent
    return policy
