"""Whether a round drafts at all (depth 0: a plain `ar` step, one row, no draft step).

Why a gate before the first draft step: the grow rule (decoding.growth) sizes a level once the
draft has read its parents, so by its first decision the round has already paid the draft's step
(and a feature head's catch-up); choosing no node there still costs that step. Where drafting
cannot pay (a long context makes every verify row and draft step dearer, a text the draft reads
badly) a round must skip the draft altogether to run at `ar`'s speed.

The gate compares, at the current context's cost curve:
- plain: 1 token in target(1) ms;
- drafted: the tokens the last drafted rounds committed (1 + accepted nodes), over what those
  rounds' trees cost at this context: verify rows, every draft step, each level's host work
  (policy_ms per parent) and a tree round's fixed host cost (overhead_ms).
A curve on which even certain acceptance of a chain cannot beat plain never drafts. Otherwise it
drafts while the priced history says drafting wins, and, skipping, drafts one round every
`explore_every` or up to 8x rarer as drafting falls behind (the text changes; a skipped round
records nothing).

Lossless as every stop policy: the decision reads only earlier rounds and the cost curve, never
this round's draws, and a skipped round verifies no tree (the target's own next token).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


def tree_ms(cost, nodes: int, draft_sizes: list[int], parents: int) -> float:
    """What a drafted round costs on `cost`: the verify of its nodes with the pending token, its
    draft steps (tokens each fed), its levels' host work (`parents`: the levels' parents, all
    counted) and a tree round's fixed host cost (none without a node: one row was verified)."""
    return (float(cost.target(nodes + 1)) + sum(float(cost.draft(n)) for n in draft_sizes)
            + parents * cost.policy_ms + (cost.overhead_ms if nodes else 0.0))


def can_pay(cost, max_depth: int) -> bool:
    """Could any chain of up to `max_depth` nodes, every one certain to be accepted, beat a plain
    step? (the most a tree of that depth can commit: extra siblings add rows, never tokens)"""
    plain = 1.0 / float(cost.target(1))
    for d in range(1, max(max_depth, 0) + 1):
        if (1 + d) / tree_ms(cost, d, [2] + [1] * (d - 1), d) > plain:
            return True
    return False


@dataclass
class DraftGate:
    """See the module docstring."""

    window: int = 8
    """Drafted rounds remembered (their tokens and tree shapes)."""
    warmup: int = 2
    """Drafted rounds before the history may close the gate."""
    explore_every: int = 16
    """Plain rounds in a row after which one round drafts again (times the squared rate gap,
    at most 8)."""
    max_depth: int = 8
    """Deepest chain the static bound (`can_pay`) considers."""
    _past: deque = field(default_factory=deque, repr=False)
    _plain: int = 0

    def drafts(self, cost) -> bool:
        """Does the next round draft, at this context's `cost`?"""
        if not can_pay(cost, self.max_depth):
            go = False
        elif len(self._past) < self.warmup:
            go = True
        else:
            # skipping, look again every `explore_every` rounds, up to 8x rarer the further
            # drafting falls behind (a look costs what drafting loses against a plain step)
            drafted, plain = self.rate(cost), 1.0 / float(cost.target(1))
            gap = min(8.0, (plain / drafted) ** 2) if drafted > 0 else 8.0
            go = drafted > plain or self._plain >= self.explore_every * gap
        self._plain = 0 if go else self._plain + 1
        return go

    def rate(self, cost) -> float:
        """Tokens per ms the remembered drafted rounds would run at on `cost`."""
        ms = sum(tree_ms(cost, n, s, lv) for _, n, s, lv in self._past)
        return sum(t for t, *_ in self._past) / ms if ms > 0 else float("inf")

    def record(self, tokens: int, nodes: int, draft_sizes: list[int], parents: int) -> None:
        """A drafted round committed `tokens` with a tree of `nodes` (draft steps of
        `draft_sizes` tokens, levels of `parents` parents in all)."""
        self._past.append((tokens, nodes, list(draft_sizes), parents))
        while len(self._past) > self.window:
            self._past.popleft()
