"""One speculation budget for a round of several requests: the grow rule over their union.

Why: with one verify forward for every active request, a row is worth what its node adds to the
round's expected committed tokens, whichever request it belongs to. decoding.growth sizes ONE
request's tree by expected tokens per ms; here the same rule runs over the union of the
requests' frontiers, level by level (every request drafts its level, then the rows are shared):

    rate(k) = (sum over requests of (1 + values in its tree) + top-k candidate values)
              / (target cost at the round's TOTAL rows + k, + every request's draft work so far)

so a confident request gets the rows a hesitant one would waste. Candidates keep growth's order
(pooled values, a prefix of each parent's draws); the merged order takes a prefix of every
request's order. Going one level deeper is decided per request (its draft forward is its own
cost): it continues when its guessed children would raise the JOINT rate after paying it.

Exactness, as in growth.py: a node's child count is fixed from q and what was drawn above it (in
any request) BEFORE its children are drawn, and every drawn node is verified. Another request's
draws are independent of this request's acceptance coins, so per request the law is the target's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from decoding.forward.cost import NODES, CostCurve
from decoding.stopping.gate import DraftGate
from decoding.growth import best_count, candidate_level, child_values, pooled_keys, worth_a_level
from decoding.stopping import DraftLevel, Frontier
from decoding.tree import MAX_TREE_NODES


def merged_order(keys: list[list[float]], branch: list[list[int]], parent_of: list[list[int]],
                 room: list[int]) -> list[tuple[int, int]]:
    """(request, candidate) pairs worth something, by pooled value across requests; within a
    request by (value, draw order, parent) as growth.candidate_order, so any prefix of the merged
    order is a prefix of each request's own order; at most room[r] of request r."""
    cands = [(-k[i], r, b[i], p[i], i) for r, (k, b, p) in enumerate(zip(keys, branch, parent_of))
             for i in range(len(k)) if k[i] > 0.0]
    taken = [0] * len(keys)
    out = []
    for _, r, _, _, i in sorted(cands):
        if taken[r] < room[r]:
            taken[r] += 1
            out.append((r, i))
    return out


@dataclass
class RoundCost:
    """A cost curve read at a round's TOTAL rows: past its largest size (64 tokens: one tree)
    the target's ms grow along the curve's last slope instead of staying flat, so several
    requests' rows (a joining prompt's too) are never priced as free."""

    curve: CostCurve

    def __post_init__(self):
        self.overhead_ms, self.policy_ms = self.curve.overhead_ms, self.curve.policy_ms
        self.last = self.curve.sizes[-1] + (1 if self.curve.unit == NODES else 0)
        self.slope = max(self.curve.target(self.last) - self.curve.target(self.last - 1), 0.0)

    def target(self, n: int) -> float:
        if n <= self.last:
            return self.curve.target(n)
        return self.curve.target(self.last) + self.slope * (n - self.last)

    def draft(self, n: int) -> float:
        return self.curve.draft(n)


@dataclass
class _Req:
    value: dict = field(default_factory=lambda: {-1: 1.0})
    E: float = 1.0
    N: int = 0
    seen: dict = field(default_factory=dict)


@dataclass
class JointGrow:
    """The joint grow rule (see the module docstring); q or a decider's scores as the estimate."""

    scorer: Callable[[DraftLevel], torch.Tensor]
    """[k] estimated acceptance probability of each node of a level (growth.q_scores: q)."""
    cost: CostCurve
    max_width: int = 4
    max_nodes: int = 64
    """Most nodes one request's tree may hold."""
    max_rows: int = 256
    """Most rows of one round's verify (pending tokens included)."""
    label: str = "q"
    needs_hidden: bool = False
    shared_draft: bool = False
    """The draft's forward of a level runs every request's rows at once (a feature head on the lean
    step, decoding.batch.drafting.read_level): a request going deeper pays what its rows add to
    that one forward, not a forward of its own."""
    gate: DraftGate = field(default_factory=DraftGate)
    """Whether a round of ONE request drafts at all (decoding.stopping; with more, the engine's
    measured choice decides)."""
    _reqs: list = field(default_factory=list, repr=False)
    _own: list = field(default_factory=list, repr=False)
    _rows: int = 0
    _feeds: float = 0.0
    _sizes: list = field(default_factory=list, repr=False)
    _parents: int = 0
    _sized: bool = False

    def __post_init__(self):
        if not 1 <= self.max_width <= 64:
            raise ValueError(f"max width must be in 1..64 (got {self.max_width})")
        if not 1 <= self.max_nodes <= MAX_TREE_NODES:
            raise ValueError(f"max_nodes must be in 1..{MAX_TREE_NODES} (got {self.max_nodes})")
        self._cost = RoundCost(self.cost)

    def drafts(self, context: int, explore: bool = True) -> bool:
        """Does a round of one request (`context` cached tokens) draft at all? Before its first
        draft step; False: a plain round (`explore`: DraftGate.drafts)."""
        self._sized = False
        return self.gate.drafts(self.cost.at_context(context), explore, context)

    def timed(self, drafted: bool, ms: float, behind_ms: float = 0.0) -> None:
        """A steady round of one request took `ms` (decoding.stopping.gate.DraftGate.timed)."""
        self.gate.timed(drafted, ms, behind_ms)

    def lookahead(self) -> int:
        return self.gate.lookahead()

    def record(self, accepted: int) -> None:
        """A round of one request was verified: a drafted one (a level sized) goes to the gate's
        history with the tokens it committed and the shape it paid for."""
        if self._sized and len(self._reqs) == 1:
            self.gate.record(1 + accepted, self.nodes, self._sizes, self._parents)
        self._sized = False

    def begin(self, pending_rows: list[int], drafting: list[bool], contexts: list[int] | None = None,
              own: list[JointGrow] | None = None) -> None:
        """A new round: request r feeds pending_rows[r] committed tokens and drafts if drafting[r];
        contexts[r]: its cached tokens (the curve is read at their mean: each row reads its own
        request's keys); own[r]: the budget request r was admitted under, whose scorer and label
        score its nodes (a decider swapped in meanwhile scores only later requests'; default: this)."""
        self._own = list(own) if own is not None else [self] * len(pending_rows)
        curve = self.cost.at_context(sum(contexts) // len(contexts)) if contexts else self.cost
        if self._cost.curve is not curve:
            self._cost = RoundCost(curve)
        self._reqs = [_Req() for _ in pending_rows]
        self._rows = sum(pending_rows)
        n = sum(map(bool, drafting))  # the anchors' steps and the first levels' host work (a parent each)
        self._feeds = n * self._cost.policy_ms + (
            (self._cost.draft(2 * n) if n else 0.0) if self.shared_draft else n * self._cost.draft(2))
        self._sizes, self._parents, self._sized = [2 * n], 0, False

    @property
    def expected(self) -> float:
        return sum(r.E for r in self._reqs)

    @property
    def nodes(self) -> int:
        return sum(r.N for r in self._reqs)

    def _n(self) -> int:
        """The N growth's rate takes: the round's rows less the one it adds itself."""
        return self._rows + self.nodes - 1

    def widths(self, frontiers: list[Frontier | None]) -> list[list[int]]:
        """Children for every frontier node of every request (None: the request drafts no level)."""
        cands, vals, keys = [], [], []
        for r, fr in enumerate(frontiers):
            if fr is None:
                cands.append(None)
                vals.append([])
                keys.append([])
                continue
            st, own = self._reqs[r], self._own[r]
            cand = candidate_level(fr, self.max_width, features=own.label != "q")
            scores = own.scorer(cand)
            st.seen = {(p, t, b): float(x) for p, t, b, x in
                       zip(cand.parent_nodes, cand.tokens, cand.branch, scores.tolist())}
            v = child_values([st.value.get(n, 0.0) for n in fr.nodes], cand.parent_of, cand.valid, scores)
            cands.append(cand)
            vals.append(v)
            keys.append(pooled_keys(v, cand.parent_of))
        self._parents += sum(len(fr.nodes) for fr in frontiers if fr is not None)
        self._sized = True
        room = [self.max_nodes - st.N for st in self._reqs]
        order = merged_order(keys, [c.branch if c else [] for c in cands],
                             [c.parent_of if c else [] for c in cands], room)
        total_room = self.max_rows - self._rows - self.nodes
        k = best_count([vals[r][i] for r, i in order], self.expected, self._n(), self._feeds, self._cost, total_room)
        counts = [[0] * len(fr.nodes) if fr is not None else [] for fr in frontiers]
        for r, i in order[:k]:
            counts[r][cands[r].parent_of[i]] += 1
            self._reqs[r].N += 1
        return counts

    def expand(self, levels: list[DraftLevel | None]) -> list[list[bool]]:
        """After drawing: record each level's node values; per request (most promising first)
        draft one level deeper only where it raises the joint rate after paying its forward."""
        guesses = {}
        keep_val = {}
        for r, level in enumerate(levels):
            if level is None:
                continue
            st = self._reqs[r]
            pv = {row: st.value.get(p, 0.0) for row, p in zip(level.parent_of, level.parent_nodes)}
            scores = self._scores(r, level)
            vals = child_values([pv.get(i, 0.0) for i in range(len(level.parent_q))], level.parent_of,
                                level.valid, scores)
            st.value.update(zip(level.nodes, vals))
            st.E += sum(vals)
            guesses[r] = sorted((v * float(s) for v, s in zip(vals, scores)), reverse=True)
            keep_val[r] = vals
        out: list[list[bool]] = [[] for _ in levels]
        rows = 0  # the next level's rows so far (shared_draft: one forward for all of them)
        for r in sorted(guesses, key=lambda r: -(guesses[r][0] if guesses[r] else 0.0)):
            level, st = levels[r], self._reqs[r]
            n = max(len(level.nodes), 1)
            add = (self._cost.draft(rows + n) - (self._cost.draft(rows) if rows else 0.0)) if self.shared_draft \
                else self._cost.draft(n)
            nxt = self._feeds + add + n * self._cost.policy_ms  # its step, the next level's host work
            room = min(self.max_nodes - st.N, self.max_rows - self._rows - self.nodes)
            go = worth_a_level(guesses[r], self.expected, self._n(), self._feeds, nxt, self._cost, room)
            if go:
                self._feeds, rows = nxt, rows + n
                self._sizes.append(n)
            out[r] = [go and ok and v > 0.0 for ok, v in zip(level.valid, keep_val[r])]
        return out

    def _scores(self, r: int, level: DraftLevel) -> torch.Tensor:
        st = self._reqs[r]
        keys = list(zip(level.parent_nodes, level.tokens, level.branch))
        if all(k in st.seen for k in keys):
            return torch.tensor([st.seen[k] for k in keys])
        return self._own[r].scorer(level)
