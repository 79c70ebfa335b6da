"""The tree proposer: draft a token tree level by level until the tree or the stop policy ends it.

One proposer covers every topology: a chain (`sd`), a k-config tree (`mcsd`) and the
fork tree of `ti-mcsd` (k-config (W, 1, ..., 1)). With `roots_from_target` the first level
is taken from the target's distribution instead of the draft's: that is the paper's
longest-branch mode, which is lossy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from decoding.forward.static import cached_model
from decoding.decider.context import ContextIndex, Snapshot
from decoding.sampling import SamplingConfig, draw_candidates, warp
from decoding.stopping import DraftLevel, Frontier, StopPolicy
from decoding.tree import ANCHOR, TreeLayout

FREE = -2  # full-layout id of a node whose parent's child count the stop policy chose


@dataclass
class DraftTree:
    layout: TreeLayout
    """Topology actually drafted (a BFS-prefix slice of the full layout)."""
    tokens: list[int]
    valid: list[bool]
    q: dict[int, torch.Tensor] = field(default_factory=dict)
    """Draft distribution at the anchor (key -1) and at every fed node, over the target vocabulary."""
    q_own: dict[int, torch.Tensor] = field(default_factory=dict)
    """The same over the draft's own vocabulary, where it has one (TreeProposer.vocab_ids)."""
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
    """get_candidates / update, in transformers' CandidateGenerator spirit.

    `layout` is the largest tree that may be drafted. After each level the stop policy picks
    which of its nodes get their children drafted (`StopPolicy.expand`), so the drafted tree
    is a sub-tree of `layout`, renumbered densely in breadth-first order.
    """

    vocab_ids: list[int] | None = None
    """Target id of each column of the draft's logits, where the draft has a vocabulary of its own
    (a feature head's 8k of the target's 49k); None: its logits are over the target vocabulary.
    Why: q is warped and its candidates drawn over the draft's columns, then scattered to the
    target's (exactly 0 elsewhere, as the acceptance rules read it): softmax and top-k over 49k
    entries, most of them masked, were ~0.25 ms of every level on an AVX2 Zen 3."""

    behind_ms = 0.0
    """Wall ms the latest propose spent catching the draft up on rounds it did not draft (a
    feature head's entries beyond one): a run that drafts every round does not pay it, so a
    stop policy's timing of drafted rounds leaves it out (decoding.stopping.gate.DraftGate.timed)."""

    def __init__(self, draft, layout: TreeLayout, sampling: SamplingConfig,
                 replacement: bool = False, roots_from_target: bool = False):
        self.model = self.cache_for(draft)
        self.layout = layout
        self.sampling = sampling
        self.replacement = replacement
        self.roots_from_target = roots_from_target
        self._layouts: dict[tuple[int, ...], TreeLayout] = {}
        self.context = ContextIndex()
        self.snapshot: Snapshot | None = None

    @staticmethod
    def cache_for(draft):
        """The draft's incremental cache (a feature head has its own)."""
        return cached_model(draft)

    def reset(self) -> None:
        self.model.reset()

    def plain(self, ahead: int = 0, committed: int | None = None) -> None:
        """A round without a tree (one row: the pending token; `ahead` plain rounds sure to
        follow, at `committed` tokens). A draft model's cache catches up at the next propose; a
        feature head overrides this to take in the target's features."""

    def propose(self, committed, stop: StopPolicy, generator, anchor_p=None, position: int = 0,
                hidden: bool = False) -> DraftTree:
        tree = DraftTree(TreeLayout(()), [], [])
        grow = Growth()
        self.snapshot = Snapshot(self, committed, len(committed))
        frontier = [ANCHOR]  # nodes whose children are drafted next
        if self.roots_from_target:
            self.fill_level(tree, grow, {ANCHOR: anchor_p}, generator)
            tree.from_draft_start = tree.size
            frontier = list(range(tree.size))
        while frontier and tree.layout.max_depth < self.layout.max_depth:
            # feed the whole last level (a contiguous block: the caches stay simple), but draw
            # children only below the frontier
            start, end = tree.fed, tree.size
            logits, h = self.model.feed(committed, tree.layout, tree.tokens[start:end], start, end, hidden=hidden)
            tree.fed = end
            fed = [ANCHOR] if start == end else list(range(start, end))
            row = {n: i - len(fed) for i, n in enumerate(fed)}
            for par in frontier:
                self.take_q(tree, par, logits[row[par]])
            counts = stop.widths(self.frontier_of(tree, grow, frontier, h, row, position)) \
                if stop.sizes_children else None
            if counts is not None:  # the policy sizes each node's children (decoding.growth)
                frontier = [p for p, c in zip(frontier, counts) if c > 0]
                counts = [c for c in counts if c > 0]
                if not frontier:
                    break
            level = self.fill_level(tree, grow, {p: tree.q[p] for p in frontier}, generator, counts, tree.q_own)
            if h is not None:
                level.parent_hidden = h[[row[p] for p in frontier]]
            level.position = position
            tree.levels.append(level)
            keep = stop.expand(level)
            frontier = [n for n, k in zip(level.nodes, keep) if k and self.has_children(grow, n)]
        return tree

    def take_q(self, tree: DraftTree, par: int, logits: torch.Tensor) -> None:
        """q at node `par` from the draft's logits there: tree.q[par], and tree.q_own[par] where
        the draft's columns are its own vocabulary (`vocab_ids`)."""
        q = warp(logits, self.sampling)
        if self.vocab_ids is None:
            tree.q[par] = q
        else:
            tree.q_own[par], tree.q[par] = q, self.widen(q)

    def set_vocab(self, ids: torch.Tensor, vocab: int) -> None:
        """The draft's columns are these target ids (`vocab_ids`) of a `vocab`-token vocabulary."""
        self._ids, self._vocab, self.vocab_ids = ids, vocab, ids.tolist()

    def widen(self, q: torch.Tensor) -> torch.Tensor:
        """q over the draft's own vocabulary -> over the target's (0 outside it)."""
        return q.new_zeros((*q.shape[:-1], self._vocab)).index_copy_(-1, self._ids, q)

    def has_children(self, grow: Growth, node: int) -> bool:
        if grow.full[node] == FREE:
            return grow.depth[node] < self.layout.max_depth
        return bool(self.layout.children[grow.full[node] + 1])

    def frontier_of(self, tree: DraftTree, grow: Growth, frontier, h, row, position) -> Frontier:
        return Frontier(
            depth=1 if frontier == [ANCHOR] else grow.depth[frontier[0]] + 1, nodes=list(frontier),
            q=torch.stack([tree.q[p] for p in frontier]),
            path_logq=[0.0 if p == ANCHOR else grow.logq[p] for p in frontier],
            valid=[p == ANCHOR or tree.valid[p] for p in frontier], size=tree.size,
            hidden=None if h is None else h[[row[p] for p in frontier]], position=position,
            paths=[grow.path(p) for p in frontier], context=self.snapshot,
            q_own=torch.stack([tree.q_own[p] for p in frontier]) if self.vocab_ids is not None else None,
            vocab_ids=self.vocab_ids)

    def fill_level(self, tree: DraftTree, grow: Growth, dists: dict, generator, counts=None,
                   own: dict | None = None) -> DraftLevel:
        """Draw the children of every parent in `dists`: as many as the full layout gives it,
        or `counts[row]` where the stop policy sized them (those nodes are FREE of the layout).
        own: the same distributions over the draft's own vocabulary, drawn from where given."""
        nodes, parent_of, branch, kids_of = [], [], [], []
        for row, (par, q) in enumerate(dists.items()):
            if counts is not None:
                kids = [FREE] * counts[row]
            else:
                kids = self.layout.children[(grow.full[par] if par != ANCHOR else ANCHOR) + 1]
            small = own.get(par) if own else None
            toks, ok = draw_candidates(q if small is None else small, len(kids), self.sampling, self.replacement,
                                       generator)
            if small is not None:
                toks = [self.vocab_ids[t] for t in toks]
            parent_ok = par == ANCHOR or tree.valid[par]
            for b, (kid, t, v) in enumerate(zip(kids, toks, ok)):
                nodes.append(len(tree.tokens))
                tree.tokens.append(t)
                tree.valid.append(v and parent_ok)
                kids_of.append((kid, par, t))
                parent_of.append(row)
                branch.append(b)
        parent_q = torch.stack(list(dists.values()))
        toks = [tree.tokens[n] for n in nodes]
        q_token = parent_q[parent_of, toks]
        # the path log q of the whole level in one host read (a read per node is a sync each on a GPU)
        for (kid, par, t), lq in zip(kids_of, torch.log(q_token.clamp_min(1e-30)).tolist()):
            grow.add(kid, par, (0.0 if par == ANCHOR else grow.logq[par]) + lq, 1 if par == ANCHOR else grow.depth[par] + 1, t)
        tree.layout = self._layout(grow)
        return DraftLevel(
            depth=tree.layout.max_depth, nodes=nodes, tokens=toks, valid=[tree.valid[n] for n in nodes],
            q_token=q_token, parent_q=parent_q, parent_of=parent_of,
            parent_nodes=[grow.parents[n] for n in nodes], branch=branch,
            path_logq=torch.tensor([grow.logq[n] for n in nodes], device=parent_q.device),
            prefixes=[grow.path(grow.parents[n]) for n in nodes], context=self.snapshot,
        )

    def _layout(self, grow: Growth) -> TreeLayout:
        n = len(grow.full)
        depth = self.layout.depths[n - 1] if n <= self.layout.size else -1
        if not grow.free and grow.full[-1] == n - 1 and self.layout.level_ends[depth] == n:
            return self.layout.sliced(depth)  # whole levels of the full layout: cached slice
        key = tuple(grow.parents)
        if key not in self._layouts:
            if len(self._layouts) > 4096:
                self._layouts.clear()
            self._layouts[key] = TreeLayout(key)
        return self._layouts[key]

    def commit(self, tree: DraftTree, path) -> None:
        self.model.commit(path, tree.fed)


@dataclass
class Growth:
    """Book-keeping of a tree being drafted: full-layout id, parent and path log q per node."""

    full: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    logq: list[float] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    paths: list[tuple[int, ...]] = field(default_factory=list)
    free: bool = False

    def add(self, full_id: int, parent: int, logq: float, depth: int, token: int) -> None:
        self.full.append(full_id)
        self.parents.append(parent)
        self.logq.append(logq)
        self.depth.append(depth)
        self.paths.append(self.path(parent) + (token,))
        self.free = self.free or full_id == FREE

    def path(self, node: int) -> tuple[int, ...]:
        """Tokens from the anchor's child down to `node` (() for the anchor)."""
        return () if node == ANCHOR else self.paths[node]
