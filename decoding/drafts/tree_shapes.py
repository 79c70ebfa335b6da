"""The shapes a draft tree may take, in plain Python (no torch): a k-config parsed from its text
('4,2,2,1'), the fork tree of `ti-mcsd`, and the cap on a tree's nodes with the size check that
enforces it without building anything. decoding.options checks the strategy options with them
before the CLIs import torch (and re-exports them, as decoding.tree does); decoding.tree builds
the trees."""

from __future__ import annotations

MAX_TREE_NODES = 1024
"""Largest draft tree: its mask is size^2 and it is built in Python; far past any tree that
pays off (a 64-node tree already costs a CPU target more than one step does)."""


def tree_size(k_levels) -> int:
    """Nodes of a k-config tree (sum over levels of the product of widths so far); raises
    ValueError past MAX_TREE_NODES without building anything."""
    size = level = 0
    for k in k_levels:
        level = k if level == 0 else level * k
        size += level
        if size > MAX_TREE_NODES:
            widths = ",".join(map(str, k_levels))
            raise ValueError(f"draft tree {widths} has more than {MAX_TREE_NODES} nodes "
                             f"(the cap is MAX_TREE_NODES): use fewer or narrower levels")
    return size


def parse_k_config(text: str | list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """'4,2,2,1' -> (4, 2, 2, 1); every entry must be a positive integer."""
    if isinstance(text, str):
        parts = [s for s in text.replace(" ", "").split(",") if s]
        try:
            ks = tuple(int(s) for s in parts)
        except ValueError:
            raise ValueError(f"bad k-config {text!r}: expected comma-separated integers like 4,2,2,1") from None
    else:
        ks = tuple(int(k) for k in text)
    if not ks or any(k < 1 for k in ks):
        raise ValueError(f"bad k-config {text!r}: needs at least one level and every width >= 1")
    return ks


def fork_k_config(width: int, depth: int) -> tuple[int, ...]:
    """The target-initialized fork tree: `width` branches, each a chain of `depth` tokens."""
    if width < 1 or depth < 1:
        raise ValueError(f"fork tree needs width >= 1 and depth >= 1 (got {width}, {depth})")
    if width * depth > MAX_TREE_NODES:
        raise ValueError(f"fork tree W={width} D={depth} has {width * depth} nodes, more than "
                         f"MAX_TREE_NODES = {MAX_TREE_NODES}: use a smaller width or depth")
    return (width,) + (1,) * (depth - 1)
