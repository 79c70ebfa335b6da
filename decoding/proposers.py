"""Proposers: draft a token tree level by level until the tree or the stop policy ends it.

One proposer covers every topology: a chain (`sd`), a k-config tree (`mcsd`) and the
fork tree of `ti-mcsd` (k-config (W, 1, ..., 1)). With `roots_from_target` the first level
is taken from the target's distribution instead of the draft's: that is the paper's
longest-branch mode, which is lossy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .cache import CachedModel
from .sampling import SamplingConfig, draw_candidates, warp
from .stopping import DraftLevel, StopPolicy
from .tree import ANCHOR, TreeLayout


@dataclass
class DraftTree:
    layout: TreeLayout
    """Topology actually drafted (a BFS-prefix slice of the full layout)."""
    tokens: list[int]
    valid: list[bool]
    q: dict[int, torch.Tensor] = field(default_factory=dict)
    """Draft distribution at the anchor (key -1) and at every fed node."""
    fed: int = 0
    """Tree nodes the draft's cache holds after this round (levels it has read)."""
    levels: list[DraftLevel] = field(default_factory=list)
    from_draft_start: int = 0
    """First node drafted by the draft model (the level-1 roots are the target's when lossy)."""

    @property
    def size(self) -> int:
        return self.layout.size


def empty_tree() -> DraftTree:
    return DraftTree(TreeLayout(()), [], [])


class TreeProposer:
    """get_candidates / update, in transformers' CandidateGenerator spirit."""

    def __init__(self, draft, layout: TreeLayout, sampling: SamplingConfig,
                 replacement: bool = False, roots_from_target: bool = False):
        self.model = CachedModel(draft)
        self.layout = layout
        self.sampling = sampling
        self.replacement = replacement
        self.roots_from_target = roots_from_target

    def reset(self) -> None:
        self.model.reset()

    def propose(self, committed, stop: StopPolicy, generator, anchor_p=None, position: int = 0,
                hidden: bool = False) -> DraftTree:
        lay = self.layout
        tokens = [0] * lay.size
        valid = [True] * lay.size
        tree = DraftTree(lay, tokens, valid)
        logq = torch.zeros(lay.size)
        depth = 0
        if self.roots_from_target:
            self._fill_level(tree, 1, {ANCHOR: anchor_p}, logq, generator)
            tree.from_draft_start = lay.level_ends[1]
            depth = 1
        while depth < lay.max_depth:
            start, end = tree.fed, lay.level_ends[depth]
            logits, h = self.model.feed(committed, lay, tokens[start:end], start, end, hidden=hidden)
            tree.fed = end
            parents = [ANCHOR] if depth == 0 else list(range(lay.level_ends[depth - 1], end))
            rows = logits[-len(parents):]
            for par, row in zip(parents, rows):
                tree.q[par] = warp(row, self.sampling)
            level = self._fill_level(tree, depth + 1, {p: tree.q[p] for p in parents}, logq, generator)
            depth += 1
            if h is not None:
                level.parent_hidden = h[-len(parents):]
            level.position = position
            tree.levels.append(level)
            if stop.should_stop(level):
                break
        tree.layout = lay.sliced(depth)
        del tokens[tree.layout.size:], valid[tree.layout.size:]
        return tree

    def _fill_level(self, tree: DraftTree, depth: int, dists: dict, logq, generator) -> DraftLevel:
        lay = tree.layout
        nodes = list(range(lay.level_ends[depth - 1], lay.level_ends[depth]))
        for par, q in dists.items():
            kids = lay.children[par + 1]
            toks, ok = draw_candidates(q, len(kids), self.sampling, self.replacement, generator)
            parent_ok = par == ANCHOR or tree.valid[par]
            for node, t, v in zip(kids, toks, ok):
                tree.tokens[node], tree.valid[node] = t, v and parent_ok
                logq[node] = (0.0 if par == ANCHOR else logq[par]) + torch.log(q[t].clamp_min(1e-30))
        parents = list(dists)
        row = {p: i for i, p in enumerate(parents)}
        parent_of = [row[lay.parents[n]] for n in nodes]
        parent_q = torch.stack([dists[p] for p in parents])
        toks = [tree.tokens[n] for n in nodes]
        return DraftLevel(
            depth=depth, nodes=nodes, tokens=toks, valid=[tree.valid[n] for n in nodes],
            q_token=parent_q[parent_of, toks], parent_q=parent_q, parent_of=parent_of,
            parent_nodes=[lay.parents[n] for n in nodes],
            branch=[lay.children[lay.parents[n] + 1].index(n) for n in nodes],
            path_logq=logq[nodes].clone(),
        )

    def commit(self, tree: DraftTree, path) -> None:
        self.model.commit(path, tree.fed)
