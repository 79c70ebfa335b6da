"""A round's fixed tree as index tensors: what the device round needs to draft, mask, walk and
commit without asking the host.

Rows: row 0 is the pending token (the last committed one, fed with the tree), row 1 + i is tree
node i (breadth-first, decoding.tree). A k-config (k_1, .., k_D) gives every node of level d-1
exactly k_d children, so each level's children are one contiguous block and every step of the
round has a static size. (k_1, .., k_D) = (1,) * D is a chain (`sd`), (W, 1, .., 1) the lossless
fork tree (`ti-mcsd`), () plain decoding (`ar`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from decoding.tree import ANCHOR, k_config_parents


@dataclass(frozen=True)
class RoundShape:
    ks: tuple[int, ...]
    """Children per node at each level (empty: no tree)."""

    @property
    def depth(self) -> int:
        return len(self.ks)

    @cached_property
    def parents(self) -> tuple[int, ...]:
        """Parent ROW of each row (row 0, the pending token, is its own)."""
        return (0,) + tuple(0 if p == ANCHOR else p + 1 for p in (k_config_parents(self.ks) if self.ks else ()))

    @property
    def rows(self) -> int:
        return len(self.parents)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        d = [0]
        for r in range(1, self.rows):
            d.append(d[self.parents[r]] + 1)
        return tuple(d)

    @cached_property
    def levels(self) -> tuple[tuple[int, int], ...]:
        """[start, end) rows of each level 1..D."""
        out, start = [], 1
        for d in range(1, self.depth + 1):
            end = start + sum(1 for x in self.depths if x == d)
            out.append((start, end))
            start = end
        return tuple(out)

    def tensors(self, device) -> ShapeTensors:
        anc = torch.zeros(self.rows, self.rows, dtype=torch.bool)
        for r in range(self.rows):
            a = r
            while True:
                anc[r, a] = True
                if a == 0:
                    break
                a = self.parents[a]
        first_child = [0] * self.rows
        for r in range(self.rows - 1, 0, -1):
            first_child[self.parents[r]] = r
        t = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        return ShapeTensors(t(self.parents), t(self.depths), anc.to(device), t(first_child))

    @property
    def name(self) -> str:
        return "ar" if not self.ks else "k=" + ",".join(map(str, self.ks))


@dataclass
class ShapeTensors:
    parents: torch.Tensor
    """[R] parent row of each row."""
    depths: torch.Tensor
    """[R] depth of each row (0: the pending token)."""
    ancestors: torch.Tensor
    """[R, R] bool: row j is row i or one of its ancestors."""
    first_child: torch.Tensor
    """[R] row of each row's first child (0: none; children of one parent are contiguous)."""


def shape_for(strategy: str, k_levels) -> RoundShape:
    """The round shape of a named strategy's tree (decoding.options.StrategyConfig.k_levels)."""
    return RoundShape(() if strategy == "ar" else tuple(int(k) for k in k_levels))
