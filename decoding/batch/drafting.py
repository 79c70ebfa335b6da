"""Drafting several requests' trees level by level in lockstep, for the joint budget.

Why: TreeProposer.propose drafts one request's whole tree in one call, asking its own stop policy
at each level; a budget across requests must see every request's frontier at the same level
before any child is drawn. `Drafting` is that loop cut at its seams (read a level -> the budget
sizes the children -> draw -> the budget says who goes deeper), over the proposer's own helpers,
so the tree, its q and its bookkeeping are the ones TreeProposer builds. The draft runs per
request (each has its own draft cache); only the target's verify is shared.
"""

from __future__ import annotations

from decoding.decider.context import Snapshot
from decoding.drafts.proposer import FeatureProposer
from decoding.proposers import DraftTree, TreeProposer, Growth, empty_tree
from decoding.sampling import warp
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
        proposer.context = proposer.context.sync(committed)
        proposer.snapshot = Snapshot(proposer.context, len(committed))

    @property
    def done(self) -> bool:
        return not self.frontier or self.tree.layout.max_depth >= self.p.layout.max_depth

    def read(self) -> Frontier:
        """Feed the last level to the draft; the frontier's q, as the budget sees it."""
        p, tree = self.p, self.tree
        start, end = tree.fed, tree.size
        logits, h = p.model.feed(self.committed, tree.layout, tree.tokens[start:end], start, end, hidden=self.hidden)
        tree.fed = end
        fed = [ANCHOR] if start == end else list(range(start, end))
        self._row = {n: i - len(fed) for i, n in enumerate(fed)}
        self._h = h
        for par in self.frontier:
            tree.q[par] = warp(logits[self._row[par]], p.sampling)
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
                                   [c for _, c in keep])
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


def draft_jointly(draftings: list[Drafting | None], budget) -> list[DraftTree]:
    """Every request's tree, level by level, sized by `budget` (budget.JointGrow) across them."""
    while any(d is not None and not d.done for d in draftings):
        live = [d if d is not None and not d.done else None for d in draftings]
        frontiers = [d.read() if d else None for d in live]
        counts = budget.widths(frontiers)
        levels = [d.draw(c) if d else None for d, c in zip(live, counts)]
        keeps = budget.expand(levels)
        for d, lv, k in zip(live, levels, keeps):
            if d is not None and lv is not None:
                d.expand(k)
    return [d.result() if d is not None else empty_tree() for d in draftings]
