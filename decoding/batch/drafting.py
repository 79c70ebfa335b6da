"""Drafting several requests' trees level by level in lockstep, for the joint budget.

Why: TreeProposer.propose drafts one request's whole tree in one call, asking its own stop policy
at each level; a budget across requests must see every request's frontier at the same level
before any child is drawn. `Drafting` is that loop cut at its seams (read a level -> the budget
sizes the children -> draw -> the budget says who goes deeper), over the proposer's own helpers,
so the tree, its q and its bookkeeping are the ones TreeProposer builds. Each request keeps its
own draft cache; a feature head's step of a level runs every request's rows at once
(`read_level`), as the target's verify does: one step per head, since requests admitted before
and after a head swap draft with different heads (decoding.batch.binding).
"""

from __future__ import annotations

import torch

from decoding.decider.context import Snapshot
from decoding.drafts.head_graph import head_steps
from decoding.drafts.feature_proposer import FeatureProposer
from decoding.tree_proposer import DraftTree, TreeProposer, Growth, empty_tree
from decoding.stopping import DraftLevel, Frontier
from decoding.tree import ANCHOR, TreeLayout


class Drafting:
    """One request's tree being drafted this round (see the module docstring)."""

    def __init__(self, proposer: TreeProposer, committed: list[int], generator, position: int,
                 hidden: bool = False):
        if proposer.roots_from_target:
            raise ValueError("batched rounds draft lossless trees only (not the longest-branch mode)")
        self.p, self.committed, self.gen = proposer, committed, generator
        self.position, self.hidden = position, hidden
        self.tree = DraftTree(TreeLayout(()), [], [])
        self.grow = Growth()
        self.frontier = [ANCHOR]
        self._h = self._row = None
        if isinstance(proposer, FeatureProposer):  # as FeatureProposer.propose: its features first
            proposer.model.ingest()
            if not proposer.model.ready(len(committed)):
                self.frontier = []
        proposer.snapshot = Snapshot(proposer, committed, len(committed))

    @property
    def done(self) -> bool:
        return not self.frontier or self.tree.layout.max_depth >= self.p.layout.max_depth

    def read(self) -> Frontier:
        """Feed the last level to the draft; the frontier's q, as the budget sees it."""
        tree = self.tree
        start, end = tree.fed, tree.size
        logits, h = self.p.model.feed(self.committed, tree.layout, tree.tokens[start:end], start, end,
                                      hidden=self.hidden)
        return self._fed(start, end, logits, h)

    def plan(self):
        """read() cut at the feature head's one step (FeatureCache.plan): (the step's arguments or
        None, done((logits, h) or None) -> read()'s frontier); None for another draft."""
        if not isinstance(self.p, FeatureProposer):
            return None
        tree = self.tree
        start, end = tree.fed, tree.size
        args, finish = self.p.model.plan(self.committed, tree.layout, tree.tokens[start:end], start, end)
        return args, lambda out: self._fed(start, end, *finish(*(out or (None, None)), self.hidden))

    def _fed(self, start: int, end: int, logits, h) -> Frontier:
        p, tree = self.p, self.tree
        tree.fed = end
        fed = [ANCHOR] if start == end else list(range(start, end))
        self._row = {n: i - len(fed) for i, n in enumerate(fed)}
        self._h = h
        for par in self.frontier:
            p.take_q(tree, par, logits[self._row[par]])
        return p.frontier_of(tree, self.grow, self.frontier, h, self._row, self.position)

    def draw(self, counts: list[int]) -> DraftLevel | None:
        """Draw counts[i] children under frontier node i (None: nothing drawn, drafting ends)."""
        keep = [(par, c) for par, c in zip(self.frontier, counts) if c > 0]
        if not keep:
            self.frontier = []
            return None
        self.frontier = [par for par, _ in keep]
        tree = self.tree
        level = self.p.fill_level(tree, self.grow, {par: tree.q[par] for par in self.frontier}, self.gen,
                                   [c for _, c in keep], tree.q_own)
        if self._h is not None:
            level.parent_hidden = self._h[[self._row[par] for par in self.frontier]]
        level.position = self.position
        tree.levels.append(level)
        self._level = level
        return level

    def expand(self, keep: list[bool]) -> None:
        self.frontier = [n for n, k in zip(self._level.nodes, keep) if k and self.p.has_children(self.grow, n)]

    def result(self) -> DraftTree:
        if isinstance(self.p, FeatureProposer):
            self.p.model.tree_size = self.tree.size
        return self.tree


@torch.inference_mode()
def read_level(live: list[Drafting | None]) -> list[Frontier | None]:
    """[d.read() for each live drafting], the feature head's steps of every request in ONE step per
    head (decoding.drafts.head_graph.head_steps: its weights read once a level, not once a request)."""
    plans = [d.plan() if d is not None else None for d in live]
    if any(d is not None and p is None for d, p in zip(live, plans)):
        return [d.read() if d is not None else None for d in live]
    stepping = [(d, p) for d, p in zip(live, plans) if d is not None and p[0] is not None]
    heads: dict[int, list] = {}
    for d, p in stepping:
        heads.setdefault(id(d.p.model.draft), []).append((d, p))
    outs = {}
    for group in heads.values():
        got = head_steps(group[0][0].p.model.draft, [d.p.model.cache for d, _ in group], [p[0] for _, p in group])
        outs.update({id(d): o for (d, _), o in zip(group, got)})
    return [p[1](outs.get(id(d))) if d is not None else None for d, p in zip(live, plans)]


def draft_jointly(draftings: list[Drafting | None], budget) -> list[DraftTree]:
    """Every request's tree, level by level, sized by `budget` (budget.JointGrow) across them."""
    while any(d is not None and not d.done for d in draftings):
        live = [d if d is not None and not d.done else None for d in draftings]
        frontiers = read_level(live)
        counts = budget.widths(frontiers)
        levels = [d.draw(c) if d else None for d, c in zip(live, counts)]
        keeps = budget.expand(levels)
        for d, lv, k in zip(live, levels, keeps):
            if d is not None and lv is not None:
                d.expand(k)
    return [d.result() if d is not None else empty_tree() for d in draftings]
