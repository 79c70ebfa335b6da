"""Tree topology as data.

A draft tree hangs below an *anchor*: the last committed token. Nodes are numbered in
breadth-first order, so the nodes up to depth d are always a prefix of the node list and a
tree cut short by a stop policy uses the top-left slice of the precomputed mask.

`build_layout(parents)` is the one pure function that turns a topology into what the
models need: an ancestor mask, per-node depths (position offsets) and root-to-leaf
retrieve indices (as Medusa does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from decoding.options import MAX_TREE_NODES, fork_k_config, parse_k_config, tree_size  # noqa: F401 (re-exported)

ANCHOR = -1  # parent id of first-level nodes
def k_config_parents(k_config) -> tuple[int, ...]:
    """Parents of a k-config tree: level d has k_d children under every node of level d-1."""
    parents: list[int] = []
    prev_level = [ANCHOR]
    ks = parse_k_config(k_config)
    tree_size(ks)
    for k in ks:
        level = []
        for p in prev_level:
            for _ in range(k):
                parents.append(p)
                level.append(len(parents) - 1)
        prev_level = level
    return tuple(parents)


@dataclass(frozen=True)
class TreeLayout:
    """A draft tree's topology and everything derived from it (all pure data)."""

    parents: tuple[int, ...]
    """Parent node of each node, ANCHOR (-1) for the first level; BFS order."""
    _slices: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        for i, p in enumerate(self.parents):
            if not (p == ANCHOR or 0 <= p < i):
                raise ValueError(f"node {i} has parent {p}: parents must precede children")
        if list(self.depths) != sorted(self.depths):
            raise ValueError("nodes must be in breadth-first order (non-decreasing depth)")

    @property
    def size(self) -> int:
        return len(self.parents)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """1-based depth of each node (the anchor has depth 0)."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p == ANCHOR else d[p] + 1)
        return tuple(d)

    @property
    def max_depth(self) -> int:
        return self.depths[-1] if self.parents else 0

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """children[0]: the anchor's children; children[i + 1]: node i's, in draft order."""
        ch: list[list[int]] = [[] for _ in range(self.size + 1)]
        for i, p in enumerate(self.parents):
            ch[p + 1].append(i)
        return tuple(tuple(c) for c in ch)

    @cached_property
    def level_ends(self) -> tuple[int, ...]:
        """level_ends[d] = number of nodes of depth <= d (d = 0 .. max_depth)."""
        return tuple(sum(1 for x in self.depths if x <= d) for d in range(self.max_depth + 1))

    @cached_property
    def mask(self) -> torch.Tensor:
        """[N, N] bool: node i attends node j iff j is i itself or one of its ancestors."""
        m = torch.zeros(self.size, self.size, dtype=torch.bool, device="cpu")
        for i in range(self.size):
            j = i
            while j != ANCHOR:
                m[i, j] = True
                j = self.parents[j]
        return m

    @cached_property
    def depth_ids(self) -> torch.Tensor:
        """[N] long: position offset of each node relative to the anchor's position."""
        return torch.tensor(self.depths, dtype=torch.long, device="cpu")

    @cached_property
    def retrieve_indices(self) -> torch.Tensor:
        """[leaves, max_depth] long: node ids on each root-to-leaf path, padded with -1."""
        leaves = [i for i in range(self.size) if not self.children[i + 1]]
        rows = []
        for leaf in leaves:
            path = []
            j = leaf
            while j != ANCHOR:
                path.append(j)
                j = self.parents[j]
            path.reverse()
            rows.append(path + [-1] * (self.max_depth - len(path)))
        return torch.tensor(rows, dtype=torch.long, device="cpu").reshape(len(rows), self.max_depth)

    def path_to(self, node: int) -> list[int]:
        """Node ids from the first level down to `node` inclusive."""
        path = []
        while node != ANCHOR:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def sliced(self, depth: int) -> TreeLayout:
        """The sub-tree of nodes with depth <= `depth` (a BFS prefix; cached)."""
        depth = max(0, min(depth, self.max_depth))
        if depth == self.max_depth:
            return self
        if depth not in self._slices:
            self._slices[depth] = TreeLayout(self.parents[: self.level_ends[depth]])
        return self._slices[depth]


def layout_from_k_config(k_config) -> TreeLayout:
    return TreeLayout(k_config_parents(k_config))


def attention_rows(
    past: int, pending: int, tree_mask: torch.Tensor, start: int, end: int
) -> torch.Tensor:
    """Boolean attention mask for one forward call, shape [pending + end - start, past + pending + end].

    The KV cache holds `past` committed tokens, then (after this call) `pending` committed
    tokens fed causally, then tree nodes 0..end-1 of which start..end-1 are fed now
    (nodes 0..start-1 were fed by an earlier call of the same round). Committed tokens are
    visible to everyone; a tree node sees only itself and its ancestors.
    """
    n_new = end - start
    m = torch.ones(pending + n_new, past + pending + end, dtype=torch.bool, device="cpu")
    if pending:
        m[:pending, past : past + pending] = torch.ones(pending, pending, dtype=torch.bool, device="cpu").tril_()
        m[:pending, past + pending :] = False
    if n_new:
        m[pending:, past + pending :] = tree_mask[start:end, :end]
    return m
